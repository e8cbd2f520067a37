import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    # Fresh but reproducible random inputs per test; 2 cores on CI.
    torch.manual_seed(int(os.environ.get("LONGTRAIN_TEST_SEED", "1234")))
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped without it (`-m "not gpu"` leaves them out altogether)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
