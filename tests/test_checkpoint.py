"""Tests for checkpoint.py: a checkpoint written by train.py before the code was restructured (commit 72fa8ac,
kept in tests/data/ckpt_before_restructure with what that code computed from it) still loads, gives the same
logits, and resumes training exactly where that code would have gone; a checkpoint that an edited model.py no
longer fits names the tensors; device and dtype settings resolve."""

import json
import os
import re
import runpy
import shlex
import shutil
import sys
from dataclasses import asdict

import pytest
import torch
import torch.nn as nn

import train
from configurator import configure
from gpt import UserError, checkpoint
from gpt.checkpoint import load_model
from gpt.device import resolve_device, resolve_dtype
from test_train import ROOT, TINY, in_dir, records, workdir  # noqa: F401(workdir is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

OLD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ckpt_before_restructure")


def expected():
    with open(os.path.join(OLD, "expected.json")) as f:
        return json.load(f)


def test_a_checkpoint_from_before_the_restructure_gives_the_same_logits(device):
    old = expected()
    model, meta, _ = load_model(os.path.join(OLD, "ckpt.pt"), device)
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


def script_error(monkeypatch, script, *argv):
    """The one-line message a script exits with for argv."""
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    message = e.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


def hinted_train_command(message):
    """The train.py command a message names in backquotes: its arguments after `python train.py`."""
    command = shlex.split(re.search(r"`([^`]+)`", message).group(1))
    assert command[:2] == ["python", "train.py"] and os.path.isfile(os.path.join(ROOT, command[2])), command
    return command[2:]


@pytest.mark.parametrize("script", ["sample.py", "eval.py", "attention.py"])
@pytest.mark.parametrize("asked", ["out dir", os.path.join("run", "model.pt")], ids=["folder", "pt_file"])
def test_no_checkpoint_names_a_train_command_for_the_folder_asked_for(monkeypatch, tmp_path, script, asked):
    """The command trains into the folder asked for (the folder of a .pt file, which it then names); spaces quoted."""
    path = str(tmp_path / asked)
    message = script_error(monkeypatch, script, f"--out_dir={path}", "--device=cpu")
    assert "no checkpoint at " + (path if path.endswith(".pt") else os.path.join(path, "ckpt.pt")) in message
    args = hinted_train_command(message)
    with in_dir(ROOT):
        settings = configure(train.DEFAULTS, args)
    assert settings["out_dir"] == (os.path.dirname(path) if path.endswith(".pt") else path), message
    if path.endswith(".pt"):
        assert f"which writes {os.path.join(os.path.dirname(path), 'ckpt.pt')}" in message, message


@pytest.mark.parametrize("folder, config", [("out-shakespeare-bpe", "config/shakespeare_bpe.py"),
                                            ("out-draft", "config/small_draft.py"), ("out-small", "config/small.py"),
                                            ("my-run", "config/small.py")])
def test_no_checkpoint_names_the_config_that_trains_into_that_folder(monkeypatch, tmp_path, folder, config):
    """A missing out-shakespeare-bpe is trained by config/shakespeare_bpe.py, not by the character model's config."""
    message = script_error(monkeypatch, "sample.py", f"--out_dir={tmp_path / folder}", "--device=cpu")
    assert hinted_train_command(message)[0] == config, message


def test_the_named_train_command_trains_what_sample_py_then_loads(workdir, monkeypatch, tmp_path, capsys):  # noqa: F811
    """The command of the message above, run with tiny settings after it (its config file and --out_dir kept)."""
    import sample

    out_dir = str(tmp_path / "out-nonexistent")
    args = hinted_train_command(script_error(monkeypatch, "sample.py", f"--out_dir={out_dir}", "--device=cpu"))
    with in_dir(workdir):
        train.main([os.path.join(ROOT, args[0]), *TINY, *args[1:], "--max_iters=2", "--eval_interval=2"])
    capsys.readouterr()
    sample.main([f"--out_dir={out_dir}", "--prompt=ROMEO:", "--max_new_tokens=5", "--device=cpu"])
    assert capsys.readouterr().out.startswith("ROMEO:")


# A checkpoint that does not fit an edited model.py: the file is fine, the names say what changed


class AddedTable(checkpoint.GPT):  # an edit adding a tensor, as learned positions do (under a name no edit uses)
    def __init__(self, config):
        super().__init__(config)
        self.added_table = nn.Embedding(config.block_size, config.n_embd)


class WiderMLPs(checkpoint.GPT):  # every layer's MLP another width: tensors of the same names in other shapes
    def __init__(self, config):
        super().__init__(config)
        for block in self.layers:
            block.mlp.gate_proj = nn.Linear(config.n_embd, 2 * config.mlp_width, bias=False)
            block.mlp.up_proj = nn.Linear(config.n_embd, 2 * config.mlp_width, bias=False)


def save_tiny_checkpoint(path, model_class=checkpoint.GPT, n_layer=1):
    """What train.py's checkpoint holds that loading reads, of a tiny model_class."""
    model = model_class(checkpoint.GPTConfig(vocab_size=65, block_size=16, n_layer=n_layer, n_head=2, n_kv_head=1,
                                             n_embd=16))
    chars = ["\n"] + [chr(32 + i) for i in range(64)]
    meta = {"tokenizer": "char", "vocab_size": 65, "eot_token": None, "chars": chars}
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "meta": meta}, path)
    return str(path)


def assert_does_not_fit(message, path, names):
    """One line naming path and the tensors, saying what to do, and not calling the file foreign."""
    assert "\n" not in message and f"{path} does not fit this model.py: {names}" in message, message
    assert "retrain" in message and "not a checkpoint written by train.py" not in message, message


@pytest.mark.parametrize("written_by,loaded_by,names", [
    (checkpoint.GPT, AddedTable, "missing added_table.weight;"),
    (AddedTable, checkpoint.GPT, "unexpected added_table.weight;"),
], ids=["edited_since", "edit_undone"])
def test_a_checkpoint_of_another_model_py_names_the_tensors(monkeypatch, tmp_path, written_by, loaded_by, names):
    """Through sample.py, which exits with the message: a model.py edited after training, or an edit undone."""
    path = save_tiny_checkpoint(tmp_path / "ckpt.pt", written_by)
    monkeypatch.setattr(checkpoint, "GPT", loaded_by)
    assert_does_not_fit(script_error(monkeypatch, "sample.py", f"--out_dir={path}", "--device=cpu"), path, names)


def test_tensors_of_another_shape_are_named_five_at_most(monkeypatch, tmp_path):
    path = save_tiny_checkpoint(tmp_path / "ckpt.pt", n_layer=4)  # 8 tensors of another shape
    monkeypatch.setattr(checkpoint, "GPT", WiderMLPs)
    with pytest.raises(UserError) as error:
        load_model(path)
    names = "other shape: layers.0.mlp.gate_proj.weight 64x16 (model: 128x16), layers.0.mlp.up_proj.weight"
    assert_does_not_fit(str(error.value), path, names)
    assert "layers.2.mlp.gate_proj.weight" in str(error.value) and str(error.value).count("x16 (model:") == 5
    assert "and 3 more;" in str(error.value)


def test_a_file_that_is_not_a_checkpoint_is_called_so(tmp_path):
    """A bare state dict (torch.save(model.state_dict())) loads as a file but is no train.py checkpoint."""
    torch.save(checkpoint.GPT(checkpoint.GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_kv_head=1,
                                                   n_embd=16)).state_dict(), tmp_path / "ckpt.pt")
    with pytest.raises(UserError, match="is not a checkpoint written by train.py"):
        load_model(str(tmp_path / "ckpt.pt"))


class RunsCodeWhenUnpickled:
    """What a malicious ckpt.pt can hold: unpickling it calls os.makedirs(path)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


def test_loading_a_checkpoint_never_runs_code_it_holds(tmp_path):
    """ckpt.pt is read with weights_only=True: a file whose unpickling would run code is refused in one line, and the
    code never runs."""
    made = tmp_path / "made_by_the_file"
    torch.save({"model": RunsCodeWhenUnpickled(str(made))}, tmp_path / "ckpt.pt")
    with pytest.raises(UserError, match="cannot read checkpoint"):
        load_model(str(tmp_path))
    assert not made.exists()


# resolve_device and resolve_dtype on the CPU (on faked GPUs: test_fake_cuda.py)


@pytest.mark.parametrize("device", ["gpu", "cpux", "meta", "cuda:x", "cuda:-1"])
def test_a_device_that_is_not_one_is_a_one_line_error(device):
    """torch's RuntimeError (or, for meta, one after the model loaded) before."""
    message = f"--device={device} is not a device this runs on; use auto, cpu, cuda, cuda:N or mps"
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        resolve_device(device)


def test_mps_where_torch_has_none_is_a_one_line_error():
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(UserError, match=r"^--device=mps, but this torch \(.*\) sees no MPS device; use --device=cpu"):
        resolve_device("mps")


def test_mps_where_torch_has_it_is_the_device_and_autos_choice_without_cuda(mps_present):
    assert resolve_device("mps") == "mps" and resolve_device("mps:0") == "mps:0"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "mps")


def test_device_and_dtype_settings():
    assert resolve_device("cpu") == "cpu" and resolve_device("cpu:0") == "cpu:0"
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert resolve_device("auto") == "cpu"
    assert resolve_dtype("auto", "cpu") == torch.float32 and resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(UserError, match="dtype must be"):
        resolve_dtype("float8", "cpu")
