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


# resolve_device and resolve_dtype on the CPU (on faked GPUs: test_fake_cuda.py)


def test_device_and_dtype_settings():
    assert resolve_device("cpu") == "cpu"
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert resolve_device("auto") == "cpu"
    assert resolve_dtype("auto", "cpu") == torch.float32 and resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(CheckpointError, match="dtype must be"):
        resolve_dtype("float8", "cpu")
