import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    # Fresh but reproducible random inputs per test; 2 cores on CI.
    torch.manual_seed(int(os.environ.get("LONGTRAIN_TEST_SEED", "1234")))
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
