"""bench/gpu_check.py --tiny on the CPU: every step of the GPU acceptance run works, here with a tiny model, so
that the first GPU session finds a script that runs (its figures there are the point; here they are not)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU, run bench/gpu_check.py itself")
def test_the_gpu_check_runs_every_step_and_says_its_figures_are_not_from_a_gpu(tmp_path):
    out = tmp_path / "check.json"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--tiny", "--no_tests",
                             f"--out={out}"], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not GPU figures" in result.stdout
    figures = json.loads(out.read_text())
    assert "not GPU figures" in figures["device"] and figures["gpu"] is False
    runs = ["train_compile_False", "train_compile_True", "torchrun_ddp", "torchrun_fsdp"]
    for run in runs:
        assert figures[run]["ms_per_iter"] > 0 and figures[run]["tokens_per_sec"] > 0, run
    # one model, one data order: one process, DDP and FSDP on one process (and compile, unused on CPU) end alike
    losses = [figures[run]["final_loss"] for run in runs]
    assert max(losses) - min(losses) < 1e-5, losses
    assert figures["precision"] == "float32"  # what train.py picks on a CPU
    assert all(figures[run]["first_step_s"] > 0 for run in runs)  # timed alone (compilation on CUDA)
    assert figures["peak_memory_gb"] == {"batch 8, compile=False": None, "batch 8, compile=True": None}  # CUDA only
    for compile in (False, True):
        decode = figures[f"sample_compile_{compile}"]
        assert decode["tokens"] == 64 and decode["tokens_per_sec"] > 0 and decode["tokens_per_sec_after_8"] > 0
    assert figures["sample_compiled_over_eager"] > 0
