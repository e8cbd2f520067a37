"""longtrain.device's machine record on the CPU: which keys decide a run's rounding, how a record reads, the driver
query (tests/gpu/test_machine_gpu.py reads a real card)."""

from longtrain.device import driver_version, machine_words, same_numerics


def test_machines_that_differ_only_in_sms_or_cublas_do_not_share_numerics_and_older_records_still_compare():
    """A card's SM count and the cuBLAS build decide a GPU run's rounding; a record saved before they were recorded
    compares on the keys it has (no false "saved on another machine" for every old checkpoint)."""
    old = {"device": "NVIDIA H200", "devices": 1, "torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0"}
    new = {**old, "sms": 132, "cublas": "13.1.0.3", "driver": "580.95.05", "uuid": "GPU-1", "capability": "9.0"}
    assert same_numerics(old, new) and same_numerics(new, old)
    assert same_numerics(new, {**new, "driver": "575.57.08", "uuid": "GPU-2"})  # recorded, not compared
    assert not same_numerics(new, {**new, "sms": 114})
    assert not same_numerics(new, {**new, "cublas": "13.0.2.14"})
    assert not same_numerics(old, {**old, "triton": "3.5.1"})
    assert machine_words(new) == "NVIDIA H200 (132 SMs), torch 2.11.0+cu130, CUDA 13.0, cuBLAS 13.1.0.3, Triton 3.6.0"
    assert machine_words(old) == "NVIDIA H200, torch 2.11.0+cu130, CUDA 13.0, Triton 3.6.0"


def test_the_driver_version_comes_from_nvidia_smi_and_is_none_without_it(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 580.159.04\necho 580.159.04\n")  # one line per card, one driver
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert driver_version() == "580.159.04"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert driver_version() is None
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert driver_version() is None


def test_gpu_tests_skip_without_cuda_and_under_the_interpreter(monkeypatch):
    """The `gpu` tests run only on CUDA with compiled kernels: under TRITON_INTERPRET=1 they would pass on the
    interpreter's kernels and say nothing about the GPU's."""
    import torch

    from tests.conftest import gpu_skip_reason

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_skip_reason() == "needs CUDA (marked gpu)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in gpu_skip_reason()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert gpu_skip_reason() is None
