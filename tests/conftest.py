import os

import pytest
import torch

# The device the tests that take one (the `device` fixture) run on: TEST_DEVICE=cuda python -m pytest runs them
# on the GPU. Tests about the CPU on purpose (its int8 kernels, faked CUDA, CPU timings, Hugging Face references)
# stay there.
DEVICE = os.environ.get("TEST_DEVICE", "cpu")


def pytest_configure(config):
    """A TEST_DEVICE this machine does not have stops the run with one line, before any test fails or skips for it."""
    try:
        torch.empty(1, device=DEVICE)
    except (RuntimeError, AssertionError) as e:  # an unknown name, no such device, or a torch built without it
        reason = (str(e).strip() or type(e).__name__).splitlines()[0].split(". ")[0][:200]
        raise pytest.UsageError(f"TEST_DEVICE={DEVICE}, but this machine cannot use it ({reason}); "
                                "unset TEST_DEVICE to run on the CPU") from None


@pytest.fixture(scope="session")
def device():
    """The device string from TEST_DEVICE ("cpu" if unset), e.g. "cuda"."""
    return DEVICE


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """On CUDA, fp32 matmuls in fp32 before each test: train.main turns TF32 on process-wide (tests call it in
    process), which would move fp32 results by ~1e-3 and make every tolerance here meaningless."""
    if torch.device(DEVICE).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run several times faster on one thread, and far faster on a machine busy with other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
