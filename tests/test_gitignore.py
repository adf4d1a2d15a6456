"""What the commands write by default, and what README and docs/ tell a user to write, is ignored by git: a user's
`git status` after the quick start and the examples shows none of it."""

import glob
import os
import re
import runpy
import subprocess

import pytest

import attention
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_outputs():
    """Paths (relative to the repo) that a command writes when the user names none."""
    paths = {attention.DEFAULTS["out"], train.DEFAULTS["out_dir"] + "/ckpt.pt", "out-gpu-check/gpu_check_cpu.json"}
    for script in ("compare.py", "plot.py"):  # argparse defaults: read from the source, as --help shows them
        with open(os.path.join(ROOT, script)) as f:
            for flag, default in re.findall(r'add_argument\("--(out|out_dir)", default="([^"]+)"', f.read()):
                paths.add(default + ("/comparison.json" if flag == "out_dir" else ""))
    for config in glob.glob(os.path.join(ROOT, "config", "*.py")):  # each config's out_dir
        paths.add(runpy.run_path(config).get("out_dir", train.DEFAULTS["out_dir"]) + "/ckpt.pt")
    return sorted(paths)


def documented_outputs():
    """The files and folders README's and docs/'s commands write: --to, --json, --out_json and --out values."""
    paths = set()
    for page in [os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "*.md")):
        with open(page) as f:
            for value in re.findall(r"--(?:to|json|out_json|out)[= ]([\w./-]+)", f.read()):
                paths.add(value.rstrip("/") + ("/config.json" if value.endswith("/") else ""))
    return sorted(paths)


@pytest.mark.parametrize("path", default_outputs() + documented_outputs())
def test_git_ignores_what_the_commands_write(path):
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
    assert result.returncode == 0, f"{path} would show in git status"
