"""The faked-CUDA tests on a torch built with CUDA, emulated on this CPU-only one: they must skip there, not fail.

The fake (tests/fake_cuda) only holds on a CPU-only build, where torch.cuda._lazy_init stops every entry point at its
first CUDA allocation with "libcudart functions unavailable". On a CUDA build _lazy_init finds the runtime, so the
runs those tests expect to stop there go on (on a GPU) or fail otherwise (no driver). A pytest run in a subprocess
with a plugin of ours makes its torch look built with CUDA 12.8 as far as torch's Python reads it, on a machine with
one GPU or none, and runs every test that takes the fake_cuda fixture (tests/test_fake_cuda.py's, whole, and
tests/test_gpu_check.py's). On a torch really built with CUDA the plugin emulates nothing: the run is the real one.
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_REASON = "faked CUDA needs a CPU-only torch; this one is built with "  # conftest.py's NO_FAKE_CUDA

PLUGIN = '''
"""A torch built with CUDA, as torch's Python sees it, on a CPU-only torch (tests/test_cuda_build.py); keeps only the
tests that take the fake_cuda fixture, and all of tests/test_fake_cuda.py's."""
import os
import types

import torch
import torch._dynamo  # first: on import it binds CUDA's C functions wherever torch._C looks built with CUDA

GPUS = int(os.environ["EMULATED_CUDA_GPUS"])
if not torch.backends.cuda.is_built():
    torch._C._has_cuda = True  # torch.backends.cuda.is_built()
    torch.version.cuda = "12.8"
    # A CUDA build's C module has these: _lazy_init checks the first ("Torch not compiled with CUDA enabled"),
    # is_available calls it, and device_count once CUDA is started
    torch._C._cuda_getDeviceCount = lambda: GPUS
    torch._C._cuda_getDevice = lambda: 0
    # device_count() asks NVML first until CUDA is started: the machine's real count (-1: no driver to ask)
    torch.cuda._device_count_nvml = lambda: GPUS or -1
    # The runtime's bindings: _lazy_init's "libcudart functions unavailable" check is `_cudart is None`
    torch.cuda._cudart = types.SimpleNamespace()

    # What _lazy_init's queued calls read: the architectures compiled for (None: unknown, and torch leaves out its
    # capability warnings) and, for a seed set before it ran, a generator per card
    torch._C._cuda_getArchFlags = lambda: None

    def cuda_init():  # _lazy_init's driver start: on a machine without a GPU, the error a CUDA build gives there
        if not GPUS:
            raise RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU "
                               "and installed a driver from http://www.nvidia.com/Download/index.aspx")
        # as torch's C start-up does, one per card it counts (CPU generators stand in)
        torch.cuda.default_generators = tuple(torch.Generator() for _ in range(torch._C._cuda_getDeviceCount()))

    torch._C._cuda_init = cuda_init


def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if "fake_cuda" in item.fixturenames or item.path.name == "test_fake_cuda.py"]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
    for item in keep:
        item.user_properties.append(("fake_cuda", "fake_cuda" in item.fixturenames))
'''


GPUS = {"one_gpu": 1, "no_gpu": 0}


@pytest.fixture(scope="module")
def emulated_runs(tmp_path_factory):
    """The pytest run of each case of GPUS, side by side (each costs seconds), skipping the cases a torch built with
    CUDA cannot emulate: {gpus: (its output, its JUnit XML report)}. Each in one process (pytest.ini's options, -n
    among them, left out): the emulation holds in the process its plugin loads in."""
    folder = tmp_path_factory.mktemp("emulated")
    (folder / "emulate_cuda_build.py").write_text(PLUGIN)
    runs = {}
    for gpus in GPUS.values():
        if torch.backends.cuda.is_built() and gpus != 1:
            continue
        env = {name: value for name, value in os.environ.items() if name != "FAKE_CUDA"}
        env.update(EMULATED_CUDA_GPUS=str(gpus), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
        report = folder / f"report-{gpus}.xml"
        runs[gpus] = report, subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "emulate_cuda_build", "-p", "no:cacheprovider", "-rs",
             "-o", "addopts=", f"--junitxml={report}", "tests/test_fake_cuda.py", "tests/test_gpu_check.py"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        outputs = {gpus: proc.communicate(timeout=600) for gpus, (_, proc) in runs.items()}
        return {gpus: (subprocess.CompletedProcess(proc.args, proc.returncode, *outputs[gpus]), report)
                for gpus, (report, proc) in runs.items()}
    finally:
        for _, proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("gpus", GPUS.values(), ids=GPUS.keys())
def test_the_fake_cuda_tests_skip_on_a_cuda_build(emulated_runs, gpus):
    """One GPU: the tests' runs would go on, on the GPU. None (a CUDA wheel on a CPU machine, pip's default on
    Linux): _lazy_init fails with "Found no NVIDIA driver" instead of the AssertionError the tests expect."""
    if torch.backends.cuda.is_built() and gpus != 1:
        pytest.skip(f"this torch is built with CUDA: nothing is emulated, the {gpus}-GPU case would rerun the real one")
    result, report = emulated_runs[gpus]
    output = result.stdout + result.stderr
    assert result.returncode == 0, output  # 0: every test collected passed or skipped
    cases = {}
    for case in ElementTree.parse(report).iter("testcase"):
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases[f"{case.get('classname')}::{case.get('name')}"] = (properties.get("fake_cuda"), case)
    assert not [name for name, (_, case) in cases.items() if case.find("failure") is not None
                or case.find("error") is not None], output
    fake = {name: case for name, (uses, case) in cases.items() if uses == "True"}
    by_the_fixture = []
    for name, case in fake.items():
        skipped = case.find("skipped")
        assert skipped is not None, (name, output)  # none passed: it would have run the fake on this torch
        reason = skipped.get("message")
        by_the_fixture += [name] if reason.startswith(SKIP_REASON) else []
        # or, with a GPU, a test's own guard before it calls the fake (tests/test_gpu_check.py's whole-check runs)
        assert name in by_the_fixture or gpus and "this machine has CUDA" in reason, (name, reason)
    # the fake's tests of both files were there: each kind in tests/test_gpu_check.py, and most of
    # tests/test_fake_cuda.py (all but a few of its tests take the fixture), skipped by the fixture
    assert any(name.startswith("tests.test_gpu_check::test_on_a_gpu_every_command") for name in fake), sorted(cases)
    assert "tests.test_gpu_check::test_what_the_rows_decide_on_a_gpu" in by_the_fixture, sorted(cases)
    assert sum(name.startswith("tests.test_fake_cuda::") for name in by_the_fixture) >= 20, sorted(cases)
    if not torch.backends.cuda.is_built():  # the emulated build's version, in the reason
        assert all("built with CUDA 12.8 " in fake[name].find("skipped").get("message") for name in by_the_fixture)
