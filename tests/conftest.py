"""Shared test configuration: the `gpu` marker and seeded randomness."""

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the H100 with `pytest -m gpu`)")
    config.addinivalue_line("markers", "slow: compiles through Inductor (tens of seconds on CPU)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches cleared before and after a test that compiles (each graph reaches the
    test's backend afresh). Modules use it with ``pytestmark = pytest.mark.usefixtures(...)``."""
    from qattn_compile import _compat

    _compat.reset_dynamo()
    yield
    _compat.reset_dynamo()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
