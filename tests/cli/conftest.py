from tests.train.tiny import workspace  # noqa: F401  (the tiny-run fixture)
