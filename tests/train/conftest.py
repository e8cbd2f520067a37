from .tiny import workspace  # noqa: F401  (the tiny-run fixture for every test here)
