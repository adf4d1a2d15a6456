"""--help on every command that takes settings: each setting with its default and the comment beside it in the
script's DEFAULTS, read from the source, exit status 0, and nothing else done."""

import contextlib
import io
import os
import sys
import types

import pytest

import attention
import eval as eval_py
import export
import sample
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {"train": train, "sample": sample, "eval": eval_py, "export": export, "attention": attention}


@pytest.fixture(scope="module")
def helps(tmp_path_factory):
    """Each command's main() with --help (and sample.py's with -h), in this process: the test is about what it prints
    and does, not about its process. Each runs in an empty folder of its own (so that anything it wrote would show):
    {(command, flag): (result, folder)}, result's returncode the SystemExit's code."""
    runs, cwd = {}, os.getcwd()
    try:
        for command, flag in [(command, "--help") for command in COMMANDS] + [("sample", "-h")]:
            folder = tmp_path_factory.mktemp(command)
            os.chdir(folder)
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
                COMMANDS[command].main([flag])
            runs[command, flag] = types.SimpleNamespace(returncode=e.value.code, stdout=out.getvalue(),
                                                        stderr=err.getvalue()), folder
    finally:
        os.chdir(cwd)
    return runs


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_every_setting_with_its_default_and_does_nothing_else(helps, command):
    result, folder = helps[command, "--help"]
    assert result.returncode == 0 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"usage: python {command}.py [config/file.py ...] [--setting=value ...]"
    for key, value in COMMANDS[command].DEFAULTS.items():
        assert any(line.startswith(f"  --{key}={value!r}") for line in lines), key
    assert os.listdir(folder) == []


def test_dash_h_is_help_too(helps):
    assert helps["sample", "-h"][0].stdout == helps["sample", "--help"][0].stdout


def test_help_shows_each_comment_beside_its_setting_and_the_groups(helps):
    out = helps["train", "--help"][0].stdout
    eval_interval = next(line for line in out.splitlines() if line.startswith("  --eval_interval="))
    assert eval_interval.split(None, 1)[1] == "evaluate (and checkpoint) every this many iterations"
    assert "\noutput and logging:\n  --out_dir='out'" in out and "\nsystem:\n  --device='auto'" in out
    # a comment continued on a deeper-indented line belongs to the setting above it, not to a new group
    max_seconds = out[out.index("  --max_seconds="):out.index("  --warmup_iters=")]
    assert "the learning rate decaying on that clock" in " ".join(max_seconds.split())
    assert "\nlearning rate decaying" not in out
    # the model's settings come from GPTConfig through **MODEL_DEFAULTS, listed under that line's comment
    assert "(every GPTConfig field (see model.py)" in out and "  --n_layer=6" in out


def test_help_asks_other_modules_for_no_attribute(monkeypatch):
    """--help finds its script among the imported modules. It asked each for DEFAULTS, and transformers' lazy module
    answers any attribute by importing a submodule: with transformers 5.20 imported (on Python 3.10), --help failed
    on its aria model's missing torchvision. A module that raises on every attribute read stands in for it."""
    def fails(name):
        raise ModuleNotFoundError("No module named 'torchvision'")

    lazy = types.ModuleType("lazy")
    lazy.__getattr__ = fails  # the module's own __getattr__ (PEP 562), as transformers' _LazyModule answers
    monkeypatch.setitem(sys.modules, "lazy", lazy)
    monkeypatch.delitem(sys.modules, "sample")
    monkeypatch.setitem(sys.modules, "sample", sample)  # after it in sys.modules: the search meets it first
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        sample.main(["--help"])
    assert out.getvalue().startswith("usage: python sample.py") and "--prompt=" in out.getvalue()
