"""Run by tests under torchrun (gloo): every rank saves its part of checkpoints 1 and 2 of DIR.

Each rank writes `cache.rankRRRRR` (rows filled with its rank) and its own `rank_meta`; rank 0 also
writes the model. `LONGTRAIN_TEST_KILL_IN_SAVE=2:R` kills rank R during the second save.
"""

import sys

import torch

from longtrain.train import distributed
from longtrain.train.checkpoint import CheckpointManager
from longtrain.train.checkpoint.ranks import cache_group

ranks, _, _ = distributed.setup("ddp", torch.device("cpu"))
manager = CheckpointManager(sys.argv[1], keep=3)
for step in (1, 2):
    tensors = {cache_group(ranks.rank): {"seen": torch.full((2,), 10 * step + ranks.rank)}}
    if ranks.is_main:
        tensors["model"] = {"w": torch.full((3,), float(step))}
    path = manager.save(step, tensors=tensors, meta={"layout": {"world_size": ranks.world_size}}, rank_meta={"rank": ranks.rank},
        ranks=ranks)
    print(f"rank {ranks.rank} saved {path}", flush=True)
distributed.teardown()
