"""`longtrain import`: a local Hugging Face model folder (Llama, GPT-NeoX/Pythia) as a longtrain run."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from longtrain.cli.app import app, fail


@app.command("import")
def import_hf(
    hf_dir: Path = typer.Argument(..., help="Hugging Face model folder: config.json, *.safetensors (or a sharded index), tokenizer.json"),
    out: Path = typer.Option(..., "--out", help="run directory to create (its checkpoint is RUN_DIR/checkpoints/step-00000000)"),
    attention: str = typer.Option(
        None, "--attention",
        help="sparsek+sw | sparsek | sw | sparsek+linear+sw | linear+sw | full (full: the model as it was). Default: a folder "
        "`longtrain export` wrote keeps its own (config.json's longtrain_sparsek), any other gets sparsek+sw",
        show_default=False,
    ),
    topk: int = typer.Option(None, "--topk",
        help="k, SparseK keys per query (default: the export's own, else 512, the paper's fine-tuning)"),
    window: int = typer.Option(None, "--window", help="w, sliding-window width (default: the export's own, else 512)"),
    score_init: str = typer.Option("mimic", "--score-init", help="mimic (w = W_Q W_Kᵀ 1 / ||·||, paper 3.5) | random"),
    score_groups: str = typer.Option(
        None, "--score-groups", help="shared (one scoring vector per layer) | per_kv_head (default: the export's own, else shared)",
        show_default=False,
    ),
    seed: int = typer.Option(0, "--seed", help="seed of a random score init"),
) -> None:
    """Convert a Hugging Face model folder into a longtrain run dir that fit/eval/generate take (no network)."""
    from longtrain.interop.hf_import import import_hf as run_import
    from longtrain.model.attention_types import USES

    choices = {"--attention": (attention, tuple(USES)), "--score-init": (score_init, ("mimic", "random")),
               "--score-groups": (score_groups, ("shared", "per_kv_head"))}
    for flag, (value, allowed) in choices.items():
        if value is not None and value not in allowed:
            raise fail(f"{flag} {value!r}: choose one of {', '.join(allowed)}", 2)
    for flag, value in (("--topk", topk), ("--window", window)):
        used = attention is None or flag[2:] in USES[attention]  # unset: the folder's type decides
        if value is not None and (value < 1 or not used):
            raise fail(f"{flag} {value}: " + ("must be at least 1" if used else f"attention {attention} has no {flag[2:]}"), 2)
    path, notes, finetune = run_import(
        hf_dir, out, attention=attention, topk=topk, window=window, score_init=score_init, score_groups=score_groups, seed=seed
    )
    console = Console(soft_wrap=True)
    for note in notes:
        console.print(note, markup=False)
    console.print(f"imported {hf_dir} → {path}", markup=False)
    console.print(f"fine-tune: longtrain fit {finetune} --set train.init_from={out}", markup=False)
