import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run several times faster on one thread, and far faster on a machine busy with other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
