"""Move a trained checkpoint's weights between device calls (equivalence_gpu.sh): `export RUN OUT` writes
OUT/model.safetensors.part-0.. (15 MiB each) plus recipe.yaml and tokenizer.json; `rebuild DIR RUN`
writes a complete checkpoint under RUN/checkpoints from them (the model only: enough to evaluate)."""

import sys
from pathlib import Path

PART = 15 * 2**20


def export(run: Path, out: Path) -> None:
    from longtrain.train.checkpoint import RECIPE_FILE, TOKENIZER_FILE, resolve_checkpoint

    ckpt = resolve_checkpoint(run)
    data = (ckpt / "model.safetensors").read_bytes()
    for i in range(0, len(data), PART):
        (out / f"model.safetensors.part-{i // PART}").write_bytes(data[i : i + PART])
    for name in (RECIPE_FILE, TOKENIZER_FILE):
        (out / name).write_bytes((ckpt / name).read_bytes())
    print(f"exported {ckpt} ({len(data):,} bytes of weights)")


def rebuild(parts: Path, run: Path) -> None:
    from safetensors.torch import load

    from longtrain.train.checkpoint import RECIPE_FILE, TOKENIZER_FILE, CheckpointManager

    chunks = sorted(parts.glob("model.safetensors.part-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    model = load(b"".join(p.read_bytes() for p in chunks))
    files = {name: (parts / name).read_bytes() for name in (RECIPE_FILE, TOKENIZER_FILE)}
    path = CheckpointManager(run, keep=1).save(1, tensors={"model": model}, meta={}, files=files)
    print(f"rebuilt {path}")


if __name__ == "__main__":
    {"export": export, "rebuild": rebuild}[sys.argv[1]](Path(sys.argv[2]), Path(sys.argv[3]))
