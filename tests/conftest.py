"""Shared test fixtures."""
import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tests of many tiny ops: one intra-op thread is much faster (and far less noisy on a shared, loaded CPU).
    Opt in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")` or as an argument."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
