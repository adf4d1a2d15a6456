import atexit
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile

import pytest
import torch

FAKE_CUDA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda")  # CUDA faked at torch's C boundary
_spec = importlib.util.spec_from_file_location("fake_cuda_site", os.path.join(FAKE_CUDA_DIR, "sitecustomize.py"))
fake_cuda_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_cuda_site)

# Kernel choices and compiled code (kernels.cache_dir()) go to a folder of this session's, not the user's ~/.cache:
# each session measures afresh, and subprocesses (sample.py, eval.py) share it through the environment.
if "GPT_CACHE_DIR" not in os.environ:
    os.environ["GPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpt-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GPT_CACHE_DIR"], ignore_errors=True)
# torch.compile's code there too, where sample.py keeps it (kernels.use_compile_cache): a test compiling without
# sample.py used inductor's own folder in /tmp, kept across sessions, warm where the suite ran before and cold on a
# fresh machine, as CI's (tests/test_kernels.py alone: 14 s warm, 46 s cold on an AMD EPYC)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["GPT_CACHE_DIR"], "inductor"))
# Inductor's check that the compiler builds for the CPU's vector ISA (a probe per ISA compiled, ~8 s in a new cache
# folder, then loaded in a new process each, ~1.4 s in every process that compiles) is skipped: the ISA is the one the
# CPU's flags name, as the probes find on any machine with a C++ compiler, which compiling needs anyway
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


@pytest.hookimpl(optionalhook=True)  # -p no:xdist leaves it unknown
def pytest_xdist_auto_num_workers(config):
    """pytest.ini's `-n auto`: the suite's files spread over one process per core (pytest-xdist; a file's tests stay in
    one process, its module fixtures made once), which fills the cores that a test waiting on one single-threaded
    command leaves idle. None where the command names one file (the fast check: starting workers would cost more than
    its seconds) or debugs (--pdb needs the tests in this process)."""
    files = {arg.split("::")[0] for arg in config.args}  # tests/test_x.py::test_y names tests/test_x.py
    one_file = len(files) == 1 and next(iter(files)).endswith(".py")
    if one_file or config.getoption("usepdb"):
        return 0
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def sigint_as_in_a_terminal():
    """preexec_fn of a command a test sends SIGINT (Ctrl-C): its default disposition, which Python turns into
    KeyboardInterrupt. A command inherits an ignored SIGINT, and pytest-xdist's workers ignore it, as does a shell
    without job control for a command it runs in the background."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


# The file collected last: its runs of bench/gpu_check.py keep more than a core busy for ~100 s, and beside them the
# other worker's tests ran 2-3 times slower (a compile test took 17.9 s); last, it has the machine nearly to itself
LAST = "test_gpu_check.py"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """Each test that takes the device fixture is marked `device`: `TEST_DEVICE=cuda python -m pytest -m device` runs
    on a GPU just the tests that use it (~260 of ~1,100: under 2 minutes on an H200; bench/gpu_check.py's tests row).
    LAST's tests go last (pytest-xdist hands the files out in this order: pytest.ini's --no-loadscope-reorder)."""
    items.sort(key=lambda item: item.path.name == LAST)  # stable: the others keep their order
    for item in items:
        own_parameters = item.callspec.params if hasattr(item, "callspec") else {}  # its own "device" is not it
        if "device" in getattr(item, "fixturenames", ()) and "device" not in own_parameters:
            item.add_marker(pytest.mark.device)


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


# Why the fake_cuda tests skip on a torch built with CUDA (the fixture's docstring); None on a CPU-only build
NO_FAKE_CUDA = ("faked CUDA needs a CPU-only torch; this one is built with "
                + (f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}")
                + " (bench/gpu_check.py tests the GPU paths on the GPU)") if torch.backends.cuda.is_built() else None


@contextlib.contextmanager
def faked_mps():
    """A Mac's answer that its MPS device is there, faked at torch's C boundary (torch._C._mps_is_available), so that
    --device=mps gets past resolve_device to what a test checks next. torch keeps its first answer: cleared around."""
    mps_is_available = torch._C._mps_is_available
    torch._C._mps_is_available = lambda: True
    torch.backends.mps.is_available.cache_clear()
    try:
        yield
    finally:
        torch._C._mps_is_available = mps_is_available
        torch.backends.mps.is_available.cache_clear()


@pytest.fixture
def mps_present():
    """faked_mps around a test."""
    with faked_mps():
        yield


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine with two CUDA GPUs, faked at torch's C boundary only (tests/fake_cuda/sitecustomize.py): call
    fake_cuda() in a test, fake_cuda("Tesla T4") for a card of the fake's table (fake_cuda_site.CARDS), or
    fake_cuda((7, 5)) for the table's card of that compute capability, named "Fake GPU". It fakes this process and,
    through PYTHONPATH and FAKE_CUDA, every Python subprocess the test starts; the first real CUDA call (an
    allocation) still fails, in torch.cuda._lazy_init. Returns the current device as a one-item list [index].

    Calling it skips the test where torch is built with CUDA, the fake's premise gone: there _lazy_init finds the CUDA
    runtime, so --device=cuda runs on a real GPU (or fails for want of a driver) instead of stopping at the first
    allocation, cuda:1 is a real card or none, and device_count() is the machine's (NVML's) count.
    bench/gpu_check.py's rows test the GPU paths there, on the GPU itself. tests/test_cuda_build.py checks this."""
    def install(card=(8, 0)):
        if NO_FAKE_CUDA:  # when called, not at set-up: a test that takes the fixture for some cases only still runs
            pytest.skip(NO_FAKE_CUDA)  # the others (tests/test_quantize.py's unknown_scheme)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [FAKE_CUDA_DIR, os.environ.get("PYTHONPATH")])))
        monkeypatch.setenv("FAKE_CUDA", card if isinstance(card, str) else ".".join(map(str, card)))
        return fake_cuda_site.install(lambda obj, name, value: monkeypatch.setattr(obj, name, value, raising=False),
                                      card)
    return install


def finished(process, timeout=120):
    """The CompletedProcess of a subprocess.Popen started with pipes (stdout, stderr), once it has ended; killed if it
    has not within timeout (the TimeoutExpired then fails the test), so that no test leaves it running."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
