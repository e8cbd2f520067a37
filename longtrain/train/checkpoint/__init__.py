"""Checkpoints: what `fit` saves and resumes from, and what every other verb loads. The on-disk format:

    RUN_DIR/checkpoints/step-XXXXXXXX/      (checkpoint.dir, if the recipe sets one)
      model.safetensors                     the whole model, gathered on rank 0, as one process writes it
      optimizer.safetensors                 the optimizer's tensors (`state.<param>.<name>`); its JSON part
                                            (param groups, scalars) is in meta.json
      cache.rankRRRRR.safetensors           rank R's per-row caches (ModelCache.state_dict), one per rank
      recipe.yaml, tokenizer.json           the resolved recipe and the tokenizer: a checkpoint copied
                                            anywhere loads on its own (older ones: from RUN_DIR, two levels up)
      meta.json                             format, step, tokens, best validation loss (and its step),
                                            early-stopping count, fp16 loss scaler, the data stream's state
                                            (every row's: the same on every rank), the layout {world_size W,
                                            batch_docs b, rows W·b, parallel}, the corpus fingerprint, the
                                            hashes a resume must match (model, attention, tokenizer), under
                                            "ranks" each rank's RNG state (rng.py), an import's record
                                            (`imported_from`), the machine that saved it (`machine`: the
                                            device's model and count, torch, CUDA and Triton versions), and
                                            under "files" the size and sha256 of every file above.

Writing is atomic: a checkpoint is written into `.tmp-step-XXXXXXXX-<pid>/` beside it, fsynced, then
renamed, so a directory carries its final name only when it is complete and a SIGKILL or a full disk
mid-save leaves the previous checkpoints untouched; on load the recorded sizes and hashes catch files
truncated or corrupted afterwards. With several ranks (torchrun) every rank writes its own files into
the same temporary directory and rank 0, once every rank has reported, writes meta.json and renames
it; a rank that dies mid-save leaves a `.tmp-*` directory that no reader takes for a checkpoint and the
next save removes (on several machines the folder must be on a file system they share).

Why gathered and not sharded: a ~1B-parameter model's fp32 weights and AdamW moments are ~12 GiB, which
rank 0 holds in host memory for the seconds the write takes; in exchange a checkpoint is the same files
whatever wrote it (1 process, N DDP ranks or N FSDP shards), `eval`/`generate` read it unchanged, and a
resume with another world size needs no resharding (ranks.py: W'·b' = W·b keeps every row's document,
position and cache). Checkpoints from before data parallelism (one `cache.safetensors`, one RNG state
in meta.json) read as W = 1.

Modules: storage.py (atomic writes, checks, finding, pruning), checkpointer.py (`fit`'s side: which
checkpoint to resume, and the Checkpointer that saves and restores a run's live parts), loading.py
(the inference verbs' side: a model with its recipe and tokenizer), ranks.py (each rank's part, rows
regrouped on resume), rng.py (every random generator as JSON). Verbs accept a checkpoint dir or a run
dir; a run dir means its newest complete checkpoint.
"""

from longtrain.train.checkpoint.checkpointer import Checkpointer, RunCheckpoints, TrainState, run_hashes
from longtrain.train.checkpoint.loading import LoadedCheckpoint, checkpoint_files, load_checkpoint, load_recipe_and_tokenizer
from longtrain.train.checkpoint.storage import (
    META,
    RECIPE_FILE,
    TOKENIZER_FILE,
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    beside,
    read_meta,
    resolve_checkpoint,
    step_of,
    steps_text,
    weights_problem,
)

__all__ = [
    "META", "RECIPE_FILE", "TOKENIZER_FILE", "CheckpointError", "CheckpointManager", "CheckpointWarning", "Checkpointer",
    "LoadedCheckpoint", "RunCheckpoints", "TrainState", "beside", "checkpoint_files", "load_checkpoint",
    "load_recipe_and_tokenizer", "read_meta", "resolve_checkpoint", "run_hashes", "step_of", "steps_text", "weights_problem",
]
