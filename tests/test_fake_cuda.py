"""The GPU paths on a CPU-only machine: CUDA faked at torch's C boundary (conftest.py's fake_cuda), so torch's own
Python checks run on the project's real arguments. Every entry point started with --device=cuda, cuda:1 and auto
gets through its device, dtype and config setup to its first CUDA allocation, where a CPU-only torch stops it;
device and dtype resolve as on a GPU machine, and torch's queries answer for each card of the fake's table as torch 2.13
does on that card. On a torch built with CUDA the fake cannot hold, and these tests skip (tests/test_cuda_build.py)."""

import os
import re
import subprocess
import sys
import traceback

import pytest
import torch

import attention
import eval as eval_script
import export
import sample
from conftest import fake_cuda_site
from gpt import UserError
from gpt.device import resolve_device, resolve_dtype
from test_train import TINY, in_dir, train_main, trained, workdir  # noqa: F401(fixtures)

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
    export.main([f"--out_dir={trained}", f"--to={tmp_path / 'hf'}", "--unchecked=True"])  # transformers or not
    assert (tmp_path / "hf" / "model.safetensors").exists()


# resolve_device and resolve_dtype on the faked GPUs


def test_a_cuda_device_with_an_index_becomes_the_current_one(fake_cuda):
    """torch.compile, fused AdamW and the caching allocator use the current device; plain "cuda" is it already."""
    current = fake_cuda()
    assert resolve_device("cuda:1") == "cuda:1" and current == [1]
    assert resolve_device("cuda") == "cuda" and current == [1]  # torch.cuda.set_device("cuda") would raise
    assert resolve_device("auto") == "cuda"
    with pytest.raises(UserError, match=r"has 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_no_cuda_is_a_one_line_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match="sees no CUDA GPU; use --device=cpu"):
        resolve_device("cuda")


# What torch 2.13 answers on each card of the fake's table (conftest.fake_cuda_site.CARDS), written from NVIDIA's
# specifications and torch's code, not from the fake: the name as torch.cuda.get_device_name prints it; the compute
# capability (V100: Volta, 7.0; T4: Turing, 7.5; A100: Ampere, 8.0; RTX 4090: Ada, 8.9; H100: Hopper, 9.0);
# is_bf16_supported(including_emulation=False), which is major >= 8 (bfloat16 tensor cores, Ampere on; tf32 too);
# and is_bf16_supported(), which also says True below 8.0 where a bfloat16 tensor can be made on the card, as on
# every card torch runs on (its arithmetic is emulated through float32).
REAL_CARDS = {
    "Tesla V100-SXM2-16GB": ((7, 0), False, True),
    "Tesla T4": ((7, 5), False, True),
    "NVIDIA A100-SXM4-80GB": ((8, 0), True, True),
    "NVIDIA GeForce RTX 4090": ((8, 9), True, True),
    "NVIDIA H100 80GB HBM3": ((9, 0), True, True),
}


def test_the_fake_has_the_cards_tested_here():
    assert set(fake_cuda_site.CARDS) == set(REAL_CARDS)


@pytest.mark.parametrize("card", REAL_CARDS)
def test_each_card_answers_as_torch_does_on_it(fake_cuda, card):
    """torch's own get_device_name, get_device_capability, is_bf16_supported and is_tf32_supported on the faked
    card, for every way of naming a device (None and plain "cuda": the current one)."""
    capability, native_bf16, bf16 = REAL_CARDS[card]
    fake_cuda(card)
    for device in (None, 0, 1, "cuda", "cuda:1", torch.device("cuda", 1)):
        assert torch.cuda.get_device_name(device) == card, device
        assert torch.cuda.get_device_capability(device) == capability, device
    assert torch.cuda.is_bf16_supported(including_emulation=False) is native_bf16
    assert torch.cuda.is_bf16_supported() is bf16  # torch's default: with emulation
    assert torch.cuda.is_tf32_supported() is native_bf16


def test_a_bad_device_raises_as_in_torch(fake_cuda):
    """torch.cuda.get_device_properties (under get_device_name and get_device_capability) resolves the device with
    torch.cuda._utils._get_device_index and raises AssertionError("Invalid device id") outside 0..device_count()-1;
    a CPU device is a ValueError there; set_device's C function rejects the ordinal."""
    current = fake_cuda()
    for query in (torch.cuda.get_device_name, torch.cuda.get_device_capability, torch.cuda.get_device_properties):
        for device in (2, "cuda:2", torch.device("cuda", 2), -1):
            with pytest.raises(AssertionError, match="^Invalid device id$"):
                query(device)
        with pytest.raises(ValueError, match="Expected a cuda device, but got: cpu"):
            query("cpu")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(2)
    torch.cuda.set_device("cuda:1")
    assert torch.cuda.current_device() == 1 and current == [1]


def test_a_compute_capability_gives_the_tables_card_of_it_named_fake_gpu(fake_cuda):
    """fake_cuda((7, 5)) (tests/test_gpu_check.py's way) is the table's T4 under the name "Fake GPU"; a capability or
    a name the table lacks is an error, not a card with made-up answers."""
    fake_cuda((7, 5))
    assert torch.cuda.get_device_name(1) == fake_cuda_site.NAME == "Fake GPU"
    assert torch.cuda.get_device_capability(1) == (7, 5)
    assert torch.cuda.is_bf16_supported() and not torch.cuda.is_bf16_supported(including_emulation=False)
    with pytest.raises(ValueError, match=r"no card of compute capability \(8, 6\)"):
        fake_cuda((8, 6))
    with pytest.raises(ValueError, match="no card 'Tesla P100-PCIE-16GB'"):
        fake_cuda("Tesla P100-PCIE-16GB")


def test_a_subprocess_gets_the_card_by_its_name(fake_cuda):
    """FAKE_CUDA carries the card's name to a subprocess's sitecustomize (a capability is tested by test_gpu_check)."""
    fake_cuda("Tesla T4")
    code = ("import torch; c = torch.cuda; print(c.device_count(), c.get_device_name('cuda:1'), "
            "c.get_device_capability(1), c.is_bf16_supported(), c.is_bf16_supported(including_emulation=False))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout == "2 Tesla T4 (7, 5) True False\n", result.stderr


def test_a_subprocess_gets_the_fake_once_it_imports_torch_and_keeps_it_through_torch_dynamo(fake_cuda):
    """A subprocess that never imports torch does not get it imported by the fake (gpu_check's prepare scripts); one
    that imports torch._dynamo (torch.compile's first step) gets dynamo as on a CPU build (it binds no CUDA stream,
    which would be an ImportError here) and then the card, as one that imports torch alone does."""
    fake_cuda("Tesla T4")
    code = "import sys; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "False\n"
    code = ("import torch._dynamo.device_interface as d, torch; "
            "print(d.get_cuda_stream, torch.cuda.device_count(), torch.cuda.get_device_name(1))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout == "None 2 Tesla T4\n", result.stderr


@pytest.mark.parametrize("card", REAL_CARDS)
def test_auto_precision_is_bfloat16_from_ampere_on_and_float16_before(fake_cuda, card):
    """V100 (7.0) and T4 (7.5) only emulate bfloat16 (torch.cuda.is_bf16_supported() says True on a T4)."""
    fake_cuda(card)
    expected = torch.bfloat16 if REAL_CARDS[card][1] else torch.float16
    assert resolve_dtype("auto", "cuda") == expected and resolve_dtype("auto", "cuda:1") == expected
    assert resolve_dtype("float32", "cuda") == torch.float32 and resolve_dtype("float16", "cuda") == torch.float16
    if expected == torch.float16:
        with pytest.raises(UserError, match=rf"this GPU \({re.escape(card)}, compute capability 7\.\d\) only "
                                                  r"emulates bfloat16; use --dtype=float16"):
            resolve_dtype("bfloat16", "cuda")
    else:
        assert resolve_dtype("bfloat16", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == resolve_dtype("auto", "mps") == torch.float32  # no CUDA query there
