import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _own_token_cache(tmp_path_factory):
    """The suite's corpora and tokenizers in a cache of its own (its subprocesses inherit it): running the tests
    leaves the user's ~/.cache/longtrain as it was. A test that needs another cache still sets its own."""
    if "LONGTRAIN_CACHE" in os.environ:  # the caller chose one
        yield
        return
    os.environ["LONGTRAIN_CACHE"] = str(tmp_path_factory.mktemp("longtrain-cache"))
    yield
    del os.environ["LONGTRAIN_CACHE"]


@pytest.fixture(autouse=True)
def _seed_and_threads():
    # Fresh but reproducible random inputs per test; 2 cores on CI.
    torch.manual_seed(int(os.environ.get("LONGTRAIN_TEST_SEED", "1234")))
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield


def gpu_skip_reason() -> str | None:
    """Why the `gpu` tests cannot run here (None: they can). Without CUDA they skip; under TRITON_INTERPRET=1 (README's
    CPU command) their kernels would run in the interpreter, with its small tiles and emulated dots, not compiled
    for the GPU: a pass would say nothing about the kernels, so they do not run (run tests/gpu without it)."""
    if not torch.cuda.is_available():
        return "needs CUDA (marked gpu)"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "TRITON_INTERPRET=1 would run the kernels in Triton's interpreter: run tests/gpu without it"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA and compiled kernels: skipped otherwise, saying why (`-m "not gpu"` leaves them
    out altogether)."""
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
