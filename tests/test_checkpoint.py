"""Tests for checkpoint.py: a checkpoint written by train.py before the code was restructured (commit 72fa8ac,
kept in tests/data/ckpt_before_restructure with what that code computed from it) still loads, gives the same
logits, and resumes training exactly where that code would have gone; device and dtype settings resolve."""

import json
import os
import shutil

import pytest
import torch

from checkpoint import CheckpointError, load_model, resolve_device, resolve_dtype
from test_train import in_dir, records, workdir  # noqa: F401 (workdir is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

OLD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ckpt_before_restructure")


def expected():
    with open(os.path.join(OLD, "expected.json")) as f:
        return json.load(f)


def test_a_checkpoint_from_before_the_restructure_gives_the_same_logits(device):
    old = expected()
    model, meta = load_model(os.path.join(OLD, "ckpt.pt"), device)
    assert meta["tokenizer"] == "char" and meta["chars"][old["prompt_ids"][0]] == old["prompt"][0]
    with torch.no_grad():
        logits = model(torch.tensor([old["prompt_ids"]], device=device))[0][0, -4:]
    # the reference was computed on the CPU
    torch.testing.assert_close(logits.cpu(), torch.tensor(old["last_4_logits"]), atol=2e-5, rtol=0)


def test_a_checkpoint_from_before_the_restructure_resumes_as_it_would_have(workdir, tmp_path):  # noqa: F811
    """On the CPU (old["settings"] say --device=cpu): the records to match are what the old code computed there."""
    import train

    old = expected()
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    shutil.copy(os.path.join(OLD, "ckpt.pt"), out_dir / "ckpt.pt")
    with in_dir(workdir):
        train.main(old["settings"].split() + [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=6",
                                              "--eval_interval=4"])
    resumed = [{k: v for k, v in r.items() if k in ("iter", "loss", "val_loss", "train_loss")} for r in records(out_dir)]
    assert [r["iter"] for r in resumed] == [r["iter"] for r in old["resumed_records"]]
    for ours, theirs in zip(resumed, old["resumed_records"]):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), (ours, theirs)


# resolve_device and resolve_dtype: CUDA faked where needed, so these run the same on any machine


def test_device_and_dtype_settings(monkeypatch):
    assert resolve_device("cpu") == "cpu"
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert resolve_device("auto") == "cpu"
    assert resolve_dtype("auto", "cpu") == torch.float32 and resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(CheckpointError, match="dtype must be"):
        resolve_dtype("float8", "cpu")


@pytest.mark.parametrize("capability, expected", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                                  ((8, 0), torch.bfloat16), ((8, 9), torch.bfloat16),
                                                  ((9, 0), torch.bfloat16)])
def test_auto_precision_is_bfloat16_from_ampere_on_and_float16_before(monkeypatch, capability, expected):
    """V100 (7.0) and T4 (7.5) only emulate bfloat16 (torch.cuda.is_bf16_supported() says True on a T4)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args, **kwargs: "Fake GPU")
    assert resolve_dtype("auto", "cuda") == expected and resolve_dtype("auto", "cuda:1") == expected
    assert resolve_dtype("float32", "cuda") == torch.float32 and resolve_dtype("float16", "cuda") == torch.float16
    if expected == torch.float16:
        with pytest.raises(CheckpointError, match=r"Fake GPU, compute capability 7\.\d\) only emulates bfloat16; "
                                                  r"use --dtype=float16"):
            resolve_dtype("bfloat16", "cuda")
    else:
        assert resolve_dtype("bfloat16", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == resolve_dtype("auto", "mps") == torch.float32  # no CUDA query there


def test_a_cuda_device_becomes_the_current_one_and_no_cuda_is_a_one_line_error(monkeypatch):
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert resolve_device("cuda:1") == "cuda:1" and current == ["cuda:1"]  # compile and fused AdamW use it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CheckpointError, match="sees no CUDA GPU; use --device=cpu"):
        resolve_device("cuda")
