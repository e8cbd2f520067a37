"""Which device and dtype a command runs on: `auto` resolved, names checked, the one table of dtypes."""

from __future__ import annotations

import torch

from longtrain.errors import TrainingError, UsageError

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
    """`fit`'s device for train.device (auto | cpu | cuda)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device is cuda but no CUDA device is visible; use `--set train.device=cpu`")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)
