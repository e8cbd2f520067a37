"""Which device and dtype a command runs on: `auto` resolved, names checked, the one table of dtypes; and the
machine a run trained on (`machine`), which a checkpoint records."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import platform
import subprocess
from collections.abc import Iterator

import torch

from longtrain.errors import RecipeError, UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def pick_device(device: str) -> str:
    """"cpu" or "cuda" for auto | cpu | cuda (auto: cuda when one is visible)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise UsageError(f"must be auto, cpu or cuda; got {device!r}", arg="device")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("cuda: no CUDA device is visible; use cpu", arg="device")
    return device


def pick_dtype(dtype: str | None, device: str) -> str:
    """A name of DTYPES; None: bfloat16 on cuda, float32 on the cpu."""
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    if dtype not in DTYPES:
        raise UsageError(f"must be one of {', '.join(DTYPES)}; got {dtype!r}", arg="dtype")
    return dtype


def train_device(choice: str) -> torch.device:
    """`fit`'s device for train.device (auto | cpu | cuda). cuda on a machine without one is a recipe that cannot
    work here (exit 2, as `generate --device cuda` is)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise RecipeError("train.device is cuda but no CUDA device is visible; use `--set train.device=cpu`")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


# The parts of a machine that decide a run's rounding: train.deterministic repeats a run bit for bit where these
# agree, not across them (the recall circuit of one seed formed on H100s and not on H200s: benchmarks/README.md).
# The device count too: ranks sum their gradients in another order than one process does. A card's SM count
# (cuBLAS's and Inductor's split choices read it) and the cuBLAS build, recorded since 2026-12-03, after same-seed
# H200 runs of two sessions differed with the other keys equal; a record from before lacks them (not compared then).
# The driver and the card's UUID are recorded, not compared (the kernels are compiled before the driver sees them).
NUMERICS_KEYS = ("device", "devices", "torch", "cuda", "triton", "sms", "cublas")


@contextlib.contextmanager
def warm_up_aside(device: torch.device) -> Iterator[None]:
    """Run the block on the card's one warm-up stream, after the current stream's work and before its next: where a
    CUDA-graph capture warms up (the decoder's step, the trainer's chunk). One stream per card, not one per capture:
    cuBLAS keeps a workspace per stream for the life of the process (32 MiB on Hopper; torch.cuda.empty_cache does
    not free it), so a new stream for every capture would keep 32 MiB more after each (up to torch's 32 pooled streams)."""
    side = _warmup_stream(card_index(device))
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            yield
    finally:  # also when the block fails (the decoder then steps eagerly, on the current stream)
        torch.cuda.current_stream(device).wait_stream(side)


@functools.cache
def _warmup_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


def card_index(device: torch.device) -> int:
    """The CUDA device's index ("cuda" alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def machine(device: torch.device, world_size: int = 1) -> dict[str, str | int]:
    """What a run trains on: the device's model (a GPU's name, or the CPU's architecture), how many of them, and
    the versions of the software whose kernels compute its numbers."""
    rec: dict[str, str | int] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "devices": world_size,
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        rec["cuda"] = str(torch.version.cuda)
        rec.update(cuda_card(device))
    try:
        import triton

        rec["triton"] = triton.__version__
    except ImportError:
        pass
    return rec


def cuda_card(device: torch.device) -> dict[str, str | int]:
    """The card beyond its name: SMs, compute capability, the cuBLAS build torch loads, the driver, and its UUID
    (which physical card: two runs of one card kind that differ tell by it whether they ran on one)."""
    return dict(_cuda_card(card_index(device)))


@functools.cache  # every checkpoint records it: read the card, the wheels and nvidia-smi once per process
def _cuda_card(index: int) -> dict[str, str | int]:
    props = torch.cuda.get_device_properties(index)
    rec: dict[str, str | int] = {"sms": props.multi_processor_count, "capability": f"{props.major}.{props.minor}"}
    cublas = [d.version for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").startswith("nvidia-cublas")]
    if cublas:  # a pip-installed CUDA torch loads cuBLAS from its nvidia-cublas wheel, which an image may pin apart
        rec["cublas"] = cublas[0]
    if (driver := driver_version()) is not None:
        rec["driver"] = driver
    rec["uuid"] = str(props.uuid)
    return rec


def driver_version() -> str | None:
    """The NVIDIA driver's version ("580.159.04") by nvidia-smi, or None where it is not found. One driver per host,
    so no card is named (torch's UUID lacks the "GPU-" prefix nvidia-smi's -i needs: such a query came back empty)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def cpu_name() -> str:
    """"cpu (x86_64, AVX512)": the architecture and the vector kernels torch picked for it (they decide its sums)."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    return f"cpu ({platform.machine()}" + (f", {capability})" if capability else ")")


def machine_words(rec: dict) -> str:
    """"NVIDIA H200 × 2 (132 SMs), torch 2.11.0, CUDA 12.8, cuBLAS 12.8.4.1, Triton 3.6.0" for a `machine` record
    (the parts it has: older records lack the SMs and cuBLAS)."""
    n = rec.get("devices", 1)
    return (f"{rec.get('device', '?')}" + (f" × {n}" if n > 1 else "") + (f" ({rec['sms']} SMs)" if rec.get("sms") else "")
            + f", torch {rec.get('torch', '?')}" + (f", CUDA {rec['cuda']}" if rec.get("cuda") else "")
            + (f", cuBLAS {rec['cublas']}" if rec.get("cublas") else "") + (f", Triton {rec['triton']}" if rec.get("triton") else ""))


def same_numerics(a: dict, b: dict) -> bool:
    """Whether two `machine` records agree on everything that decides the rounding (NUMERICS_KEYS; a key that one of
    them lacks, recorded only since a later release, is not compared)."""
    return all(a.get(k) == b.get(k) for k in NUMERICS_KEYS if k in a and k in b)
