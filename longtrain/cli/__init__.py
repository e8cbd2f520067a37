"""The `longtrain` command line: one module per verb (litgpt's layout), each a thin function.

A verb module imports `app` from `longtrain.cli.app`, registers itself with `@app.command(...)`
and keeps its heavy imports inside the function, so `longtrain -h` stays fast.
"""

from longtrain.cli import (  # noqa: F401  (registers the verbs)
    cache,
    clean,
    eval,
    export,
    fit,
    generate,
    import_hf,
    inspect,
    plot,
    recipes,
    verify_equivalence,
    version,
)
from longtrain.cli.app import app

__all__ = ["app"]
