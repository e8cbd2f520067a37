"""longtrain: train language models on long documents with SparseK attention."""

__version__ = "0.1.0"


def load(checkpoint, *, device: str = "auto", dtype: str | None = None):
    """A checkpoint or run dir ready to `.generate(prompts)` and `.score(texts)` (longtrain.api.Model).

    Imported on first use, so `import longtrain` stays light (no torch).
    """
    from longtrain.api import load as _load

    return _load(checkpoint, device=device, dtype=dtype)
