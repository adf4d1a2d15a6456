"""The GPU paths on a CPU-only machine: CUDA faked at torch's C boundary (conftest.py's fake_cuda), so torch's own
Python checks run on the project's real arguments. Every entry point started with --device=cuda, cuda:1 and auto
gets through its device, dtype and config setup to its first CUDA allocation, where a CPU-only torch stops it;
device and dtype resolve as on a GPU machine."""

import os
import re
import traceback

import pytest
import torch

import attention
import eval as eval_script
import export
import sample
from checkpoint import CheckpointError, resolve_device, resolve_dtype
from conftest import fake_cuda_site
from test_train import TINY, in_dir, train_main, trained, workdir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPELLINGS = {"cuda": 0, "cuda:1": 1, "auto": 0}  # --device=..., and the current device it leaves
# What a CPU-only torch raises at the first call that needs the CUDA runtime (torch.cuda._lazy_init)
NO_RUNTIME = "libcudart functions unavailable"
# A line of the project's that makes or moves a tensor onto a device
ALLOCATION = re.compile(r"\.to\(|device=|\.cuda\(|torch\.(empty|zeros|ones|full|tensor|arange)\(")


def last_project_frame(error):
    """The innermost frame of the traceback in the repo's own code (not torch's, not the tests')."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if f.filename.startswith(ROOT + os.sep) and os.sep + "tests" + os.sep not in f.filename
              and os.sep + ".venv" + os.sep not in f.filename]
    assert frames, "".join(traceback.format_exception(error))
    return frames[-1]


def assert_reached_first_allocation(run):
    """run() stops at torch's CUDA runtime start (nothing else went wrong first), in a line of the repo's that
    allocates on or moves to the device, after the device and dtype setup."""
    with pytest.raises(AssertionError, match=NO_RUNTIME) as raised:
        run()
    frame = last_project_frame(raised.value)
    assert ALLOCATION.search(frame.line), f"{frame.filename}:{frame.lineno} {frame.line}"
    assert frame.name not in ("resolve_device", "resolve_dtype", "configure"), frame
    return frame


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_train_reaches_its_first_cuda_allocation(fake_cuda, workdir, tmp_path, spelling):  # noqa: F811
    current = fake_cuda()
    args = [a for a in TINY if not a.startswith(("--device", "--dtype"))] + [f"--device={spelling}", "--dtype=auto"]
    with in_dir(workdir):
        frame = assert_reached_first_allocation(lambda: __import__("train").main(args + [f"--out_dir={tmp_path}"]))
    assert frame.name == "train" and current == [SPELLINGS[spelling]]


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("script", [sample, eval_script, attention], ids=["sample", "eval", "attention"])
def test_sample_eval_and_attention_reach_their_first_cuda_allocation(fake_cuda, trained, script, spelling):  # noqa: F811
    current = fake_cuda()
    assert_reached_first_allocation(lambda: script.main([f"--out_dir={trained}", f"--device={spelling}"]))
    assert current == [SPELLINGS[spelling]]


def test_export_converts_on_the_cpu_where_cuda_is_there(fake_cuda, trained, tmp_path):  # noqa: F811
    """export.py has no device setting: it converts a CPU fp32 copy, so a GPU machine changes nothing for it."""
    fake_cuda()
    assert torch.cuda.is_available()
    export.main([f"--out_dir={trained}", f"--to={tmp_path / 'hf'}"])
    assert (tmp_path / "hf" / "model.safetensors").exists()


# resolve_device and resolve_dtype on the faked GPUs


def test_a_cuda_device_with_an_index_becomes_the_current_one(fake_cuda):
    """torch.compile, fused AdamW and the caching allocator use the current device; plain "cuda" is it already."""
    current = fake_cuda()
    assert resolve_device("cuda:1") == "cuda:1" and current == [1]
    assert resolve_device("cuda") == "cuda" and current == [1]  # torch.cuda.set_device("cuda") would raise
    assert resolve_device("auto") == "cuda"
    with pytest.raises(CheckpointError, match=r"has 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_no_cuda_is_a_one_line_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(CheckpointError, match="sees no CUDA GPU; use --device=cpu"):
        resolve_device("cuda")


@pytest.mark.parametrize("capability, expected", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                                  ((8, 0), torch.bfloat16), ((8, 9), torch.bfloat16),
                                                  ((9, 0), torch.bfloat16)])
def test_auto_precision_is_bfloat16_from_ampere_on_and_float16_before(fake_cuda, capability, expected):
    """V100 (7.0) and T4 (7.5) only emulate bfloat16 (torch.cuda.is_bf16_supported() says True on a T4)."""
    fake_cuda(capability)
    assert resolve_dtype("auto", "cuda") == expected and resolve_dtype("auto", "cuda:1") == expected
    assert resolve_dtype("float32", "cuda") == torch.float32 and resolve_dtype("float16", "cuda") == torch.float16
    if expected == torch.float16:
        with pytest.raises(CheckpointError, match=rf"{fake_cuda_site.NAME}, compute capability 7\.\d\) only emulates "
                                                  r"bfloat16; use --dtype=float16"):
            resolve_dtype("bfloat16", "cuda")
    else:
        assert resolve_dtype("bfloat16", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == resolve_dtype("auto", "mps") == torch.float32  # no CUDA query there
