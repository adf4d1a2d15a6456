"""Tests for experiments/kv_cache.py and experiments/kv_heads.py with tiny settings: their key claims (the cached
step does constant matmul work where the uncached one grows with the context, and gives the same logits; GQA
and MQA shrink the KV cache by n_head / n_kv_head), not their timings, which the scripts print."""

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest
import torch

from experiments import kv_cache, kv_heads
from gpt.tokenizer import Tokenizer, char_meta
from model import GPT, GPTConfig
from test_train import workdir  # noqa: F401 (a fixture)
from conftest import finished

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["kv_cache", "kv_heads", "position", "scaling"]


@pytest.fixture(scope="module", autouse=True)
def scripts():
    """The experiments run as scripts, as experiments/README.md runs them, from the repo, while the in-process tests
    run (each spends a second or more importing torch, on the core those tests leave), each waited for by its test:
    "run", kv_cache.py at its small shape (a Popen), and each name of SCRIPTS, its --help (a Future of the
    CompletedProcess). The --help runs go one at a time beside the run: five processes started at once kept the
    run's test waiting 10 s in a suite run on 2 cores."""
    def command(script, *args):
        return [sys.executable, os.path.join(ROOT, "experiments", f"{script}.py"), *args]

    run = subprocess.Popen(command("kv_cache", "--shape=small", "--repeats=1"), cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as one_at_a_time:
        helps = {script: one_at_a_time.submit(subprocess.run, command(script, "--help"), cwd=ROOT,
                                              capture_output=True, text=True, timeout=120) for script in SCRIPTS}
        yield {"run": run, **helps}
        for future in helps.values():  # tests deselected: the runs not yet started never start
            future.cancel()
        if run.poll() is None:
            run.kill()
        run.communicate()


def tiny(**overrides):
    torch.manual_seed(0)
    return GPT(GPTConfig(**dict(dict(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32),
                                **overrides))).eval()


def test_cached_flops_grow_only_through_attention_and_uncached_flops_with_the_whole_context():
    model = tiny()
    cfg = model.config
    per_key = 4 * cfg.n_layer * cfg.n_head * cfg.head_dim  # q.k and the weighted v, per cached key
    cached = [kv_cache.step_flops(model, n, cached=True) for n in (16, 32, 64)]
    assert cached[1] - cached[0] == per_key * 16 and cached[2] - cached[1] == per_key * 32
    # by hand for one context: every linear layer once per token, the output head once, causal pairs
    weights = {name: m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    body = sum(n for name, n in weights.items() if name != "lm_head")
    assert kv_cache.step_flops(model, 32, cached=False) == 2 * body * 32 + per_key * (32 * 33 // 2) + 2 * weights["lm_head"]
    assert kv_cache.step_flops(model, 32, cached=True) == 2 * body + per_key * 32 + 2 * weights["lm_head"]
    ratios = [kv_cache.step_flops(model, n, False) / kv_cache.step_flops(model, n, True) for n in (16, 32, 64)]
    assert ratios[0] < ratios[1] < ratios[2]


@pytest.mark.parametrize("context", [1, 17, 64])
def test_the_cached_step_gives_the_logits_of_the_whole_context(context):  # experiments/kv_cache.py measures on the CPU
    _, _, difference = kv_cache.measure(tiny(), context, repeats=1)
    assert difference < 1e-5


def test_contexts_double_up_to_block_size():
    assert kv_cache.contexts(1024) == [64, 128, 256, 512, 1024] and kv_cache.contexts(100) == [64]
    assert kv_cache.contexts(32) == [32]


def test_kv_bytes_per_token_shrink_with_the_kv_heads():
    sizes = [kv_heads.kv_bytes_per_token(tiny(n_kv_head=n).config) for n in (4, 2, 1)]
    assert sizes == [2 * 2 * 4 * 8 * 4, 2 * 2 * 2 * 8 * 4, 2 * 2 * 1 * 8 * 4]  # 2 (k, v) x layers x heads x hd x 4 B


def test_a_run_trains_and_reports_its_final_val_loss(tmp_path, monkeypatch, device):
    text = "ROMEO: But soft, what light through yonder window breaks? It is the east. " * 40
    data = tmp_path / "data" / "tiny"
    from data.shakespeare.prepare import write_splits

    write_splits(text, Tokenizer(char_meta(text)), str(data), "tiny")
    config = tmp_path / "tiny.py"
    config.write_text('dataset = "tiny"\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\nbatch_size = 2\n'
                      f'max_iters = 4\neval_interval = 2\neval_iters = 1\ndevice = "{device}"\ncompile = False\n')
    monkeypatch.chdir(tmp_path)
    out_dir = str(tmp_path / "kv1")
    kv_heads.train_run(str(config), out_dir, 1, 1337, [])
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        evals = [json.loads(line) for line in f if "val_loss" in line]
    assert [r["iter"] for r in evals] == [0, 2, 4] and kv_heads.final_val_loss(out_dir) == evals[-1]["val_loss"]
    from gpt.checkpoint import load_model

    model, _, _ = load_model(out_dir)
    assert model.config.n_kv_head == 1  # the run's setting reached the model


# ----------------------------------------------------------------------------------------------------
# Both scripts end to end, as experiments/README.md runs them (at a tiny size)


def test_kv_cache_runs_as_a_script(scripts):
    """`python experiments/kv_cache.py` imports the machine line from bench/ (it failed at start when bench_train
    imported bench_sample as a top-level module): the small shape, one repeat, every context a row."""
    result = finished(scripts["run"], timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("machine: ")
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["64"], ["128"])]
    assert [row[0] for row in rows] == ["64", "128"] and all(float(row[-1]) < 1e-4 for row in rows), result.stdout


def test_kv_heads_runs_its_four_trainings_and_prints_the_table(workdir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """kv_heads.main as `python experiments/kv_heads.py` runs it (its working directory the one holding data/: here a
    tiny dataset's, not the repo's), with tiny training settings passed through to train.py."""
    monkeypatch.setattr(kv_heads, "ROOT", str(workdir))
    monkeypatch.setattr(sys, "argv", ["kv_heads.py", f"--config={os.path.join(ROOT, 'config', 'small.py')}",
                                      f"--out_dir={tmp_path}", "--max_iters=4", "--eval_interval=4", "--eval_iters=1",
                                      "--n_layer=1", "--n_head=4", "--n_embd=32", "--block_size=32", "--batch_size=2",
                                      "--device=cpu", "--compile=False", "--warmup_iters=1"])
    cwd = os.getcwd()
    try:
        kv_heads.main()
    finally:
        os.chdir(cwd)
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["kv4"], ["kv2"], ["kv1"], ["kv4-seed2"])}
    assert list(rows) == ["kv4", "kv2", "kv1", "kv4-seed2"]
    kv_bytes = {name: int(row[4].replace(",", "")) for name, row in rows.items()}
    assert kv_bytes["kv4"] == 2 * kv_bytes["kv2"] == 4 * kv_bytes["kv1"] == kv_bytes["kv4-seed2"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_experiment_starts_as_a_script(scripts, script):
    """`python experiments/NAME.py` as experiments/README.md runs it gets past its imports (kv_heads and kv_cache
    once failed there, importing bench/ modules as top-level ones): --help exits 0 with its usage."""
    result = scripts[script].result()
    assert result.returncode == 0 and result.stdout.startswith(f"usage: {script}.py"), result.stderr


def test_kv_heads_stops_at_the_first_signal_with_the_shells_status(monkeypatch, tmp_path, capsys):
    """A Ctrl-C or SIGTERM during a training (train.main saves and returns the signal) ends kv_heads.py there, as
    compare.py does, with 128 + the signal's number: the runs after it would not hear the signal."""
    import signal
    calls = []
    monkeypatch.setattr(kv_heads.train, "main", lambda argv: calls.append(argv) or signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        kv_heads.train_run("config.py", str(tmp_path / "kv4"), 4, 1337, [])
    assert e.value.code == 128 + signal.SIGTERM and len(calls) == 1
    assert "stopped by SIGTERM during kv4" in capsys.readouterr().err
