"""Where longtrain keeps what it can rebuild: one user cache root, never inside the installed package.

`~/.cache/longtrain`: `tokens/` (the token cache, data/cache.py;
`LONGTRAIN_CACHE` moves it) and `numba/` (the compiled selection scan; `NUMBA_CACHE_DIR` moves it).
"""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_root() -> Path:
    return Path.home() / ".cache" / "longtrain"


def use_user_numba_cache() -> None:
    """Point numba's `cache=True` at the user cache before any jitted function is defined.

    By default numba writes beside the source, into the package's `__pycache__`: pip does not
    record those files, so after `pip uninstall` (or `pip install -e` over `pip install .`) an
    empty `longtrain/` folder is left in site-packages and shadows the editable install.
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    os.environ["NUMBA_CACHE_DIR"] = str(user_cache_root() / "numba")
    from numba.core import config

    config.reload_config()  # numba may be imported already: it rereads the environment now
