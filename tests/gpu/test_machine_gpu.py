"""The machine record (longtrain.device.machine) on a real card (skipped without CUDA): what a checkpoint records
to tell two same-seed runs' machines apart."""

import importlib.metadata
import shutil

import pytest
import torch

from longtrain.device import machine, machine_words, same_numerics

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def test_a_cuda_machine_record_names_the_cards_sms_cublas_and_uuid():
    rec = machine(torch.device("cuda"))
    props = torch.cuda.get_device_properties(0)
    assert rec["sms"] == props.multi_processor_count and rec["capability"] == f"{props.major}.{props.minor}"
    assert rec["uuid"] == str(props.uuid) and rec["cuda"] == str(torch.version.cuda)
    has_cublas_wheel = any((d.metadata["Name"] or "").startswith("nvidia-cublas") for d in importlib.metadata.distributions())
    assert ("cublas" in rec) == has_cublas_wheel, rec
    assert ("driver" in rec) == (shutil.which("nvidia-smi") is not None), rec  # 2026-12-03: an -i query missed it
    assert f"({props.multi_processor_count} SMs)" in machine_words(rec)
    assert same_numerics(rec, machine(torch.device("cuda")))
    rec["sms"] = -1  # the card is read once per process (functools.cache): a caller's record is its own copy
    assert machine(torch.device("cuda"))["sms"] == props.multi_processor_count
