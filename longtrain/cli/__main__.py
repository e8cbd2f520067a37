"""`python -m longtrain.cli ...` (and `torchrun -m longtrain.cli ...`)."""

from longtrain.cli import app

app()
