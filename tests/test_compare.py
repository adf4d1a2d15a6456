"""Tests for compare.py: the statistics on groups whose truth is known, and whole comparisons of a tiny model
(trained in this process through train.main, as compare.py's own process would run train.py) for the seed
reaching the run, resume, the JSON and the refusals."""

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

import compare
import plot
import train
from conftest import sigint_as_in_a_terminal
from data.shakespeare_char import prepare as prepare_char
from gpt import UserError

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--dataset=shakespeare_char --n_layer=1 --n_head=2 --n_kv_head=1 --n_embd=32 --block_size=32 --batch_size=4 "
        "--eval_iters=2 --eval_interval=10 --log_interval=5 --compile=False --device=cpu --dtype=float32 "
        "--warmup_iters=2 --learning_rate=3e-3 --min_lr=3e-4")
TIME_KEYS = {"seconds", "ms_per_iter"}  # wall-clock figures: the only part of a comparison that may differ


# ----------------------------------------------------------------------------------------------------
# Statistics


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)])
def test_t_quantile_matches_the_printed_table(df, expected):
    assert compare.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)  # two-sided 95% column


def test_a_clear_difference_gets_its_verdict_both_ways():
    base = {s: 1.80 + 0.01 * (-1) ** s for s in range(5)}
    lower = {s: v - 0.05 + 0.002 * s for s, v in base.items()}  # 0.05 better, paired spread 0.002
    better = compare.paired_difference(base, lower)
    assert better["verdict"] == "better" and better["high"] < 0 < -better["low"]
    worse = compare.paired_difference(lower, base)
    assert worse["verdict"] == "worse" and worse["low"] > 0


def test_overlapping_groups_cannot_be_told_apart():
    base = {0: 1.80, 1: 1.75, 2: 1.78}
    change = {0: 1.77, 1: 1.77, 2: 1.77}  # lower on average, but the seeds disagree on the sign
    result = compare.paired_difference(base, change)
    assert result["low"] < 0 < result["high"]
    assert result["verdict"].startswith("cannot tell at 3 seeds")


def test_identical_groups_claim_no_difference():
    base = {0: 1.8, 1: 1.7, 2: 1.75}
    result = compare.paired_difference(base, dict(base))
    assert result["mean"] == 0 and result["verdict"].startswith("no difference")


def test_one_seed_gets_no_verdict():
    result = compare.paired_difference({0: 1.8}, {0: 1.7})
    assert result["low"] is None and result["verdict"].startswith("no verdict: one seed")


def test_the_interval_is_wrong_one_time_in_twenty():
    """Calibration: over many synthetic comparisons, the 95% interval misses the true difference ~5% of the
    time, and groups drawn alike are called better or worse ~5% of the time, not more."""
    rng = random.Random(0)
    trials, misses, false_verdicts = 2000, 0, 0
    for _ in range(trials):
        seeds = range(4)
        shared = {s: rng.gauss(1.75, 0.02) for s in seeds}  # what a seed's data order does to both groups
        base = {s: shared[s] + rng.gauss(0, 0.01) for s in seeds}
        change = {s: shared[s] - 0.01 + rng.gauss(0, 0.01) for s in seeds}
        result = compare.paired_difference(base, change)
        misses += not result["low"] <= -0.01 <= result["high"]
        same = compare.paired_difference(base, {s: shared[s] + rng.gauss(0, 0.01) for s in seeds})
        false_verdicts += same["verdict"] in ("better", "worse")
    assert 0.03 < misses / trials < 0.07
    assert 0.03 < false_verdicts / trials < 0.07


# ----------------------------------------------------------------------------------------------------
# Whole comparisons of a tiny model


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A working directory with data/shakespeare_char, and the same data as a second dataset, `other`."""
    path = tmp_path_factory.mktemp("work")
    prepare_char.main(["--out_dir", str(path / "data" / "shakespeare_char")])
    shutil.copytree(path / "data" / "shakespeare_char", path / "data" / "other")
    return path


@pytest.fixture
def in_workdir(workdir, monkeypatch):
    """compare.main() in the workdir, each run through train.main() in this process (which gives the signal handlers
    back)."""
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(compare, "run_training", train_here)
    return workdir


def train_here(argv, log_path):
    with open(log_path, "a") as log, contextlib.redirect_stdout(log):
        try:
            train.main(argv)
        except UserError as e:
            print(f"error: {e}")
            return 1
    return 0


def comparison_args(out_dir, *groups, seeds=2, iters=12):
    return [*groups, f"--seeds={seeds}", f"--iters={iters}", f"--out_dir={out_dir}", "--threads=1"]


def without_times(comparison):
    """The comparison with its wall-clock figures left out."""
    return json.loads(json.dumps(comparison), object_hook=lambda d: {k: v for k, v in d.items() if k not in TIME_KEYS})


def test_seeds_reach_the_runs_and_the_same_seed_gives_the_same_loss(in_workdir, capsys):
    result = compare.main(comparison_args("cmp", f"a={TINY}", f"b={TINY}"))
    runs = result["runs"]
    assert runs["a"]["1337"]["val_loss"] != runs["a"]["1338"]["val_loss"]  # another seed, another run
    assert runs["a"]["1337"]["val_loss"] == runs["b"]["1337"]["val_loss"]  # the same seed, the same run
    assert runs["a"]["1337"]["iters"] == 12
    assert result["results"]["differences"]["b - a"]["verdict"].startswith("no difference")
    with open(os.path.join("cmp", "comparison.json")) as f:
        assert json.load(f) == result
    assert os.path.getsize(os.path.join("cmp", "compare.png")) > 0
    assert "b - a: +0.0000" in capsys.readouterr().out


def test_an_interrupted_comparison_resumes_to_the_same_result(in_workdir, monkeypatch):
    groups = (f"base={TINY}", f"wide={TINY} --n_embd=48")
    whole = compare.main(comparison_args("whole", *groups, iters=20))

    calls = []

    def stopped_halfway(argv, log_path):  # the second run stops at iteration 9 with a checkpoint, as after Ctrl-C
        calls.append(argv)
        return train_here(argv + ["--max_iters=9"] if len(calls) == 2 else argv, log_path)

    monkeypatch.setattr(compare, "run_training", stopped_halfway)
    with pytest.raises(UserError, match="wide seed 1337 stopped before its budget"):
        compare.main(comparison_args("parts", *groups, iters=20))
    monkeypatch.setattr(compare, "run_training", train_here)
    calls.clear()
    monkeypatch.setattr(compare, "run_training", lambda argv, log: calls.append(argv) or train_here(argv, log))
    resumed = compare.main(comparison_args("parts", *groups, iters=20))
    assert [a[-1] for a in calls] == ["--init_from=resume", "--overwrite=True", "--overwrite=True"]  # base 1337 kept
    assert without_times(resumed) == without_times(whole)


def test_more_seeds_and_a_new_group_reuse_the_finished_runs(in_workdir, monkeypatch):
    compare.main(comparison_args("grow", f"base={TINY}", seeds=2))
    calls = []
    monkeypatch.setattr(compare, "run_training", lambda argv, log: calls.append(argv) or train_here(argv, log))
    result = compare.main(comparison_args("grow", f"base={TINY}", f"relu2={TINY} --mlp=relu2", seeds=3))
    trained = [(a[-4], a[-3]) for a in calls]  # out_dir and seed of each run made
    assert trained == [("--out_dir=grow/relu2/seed1337", "--seed=1337"), ("--out_dir=grow/relu2/seed1338", "--seed=1338"),
                       ("--out_dir=grow/base/seed1339", "--seed=1339"), ("--out_dir=grow/relu2/seed1339", "--seed=1339")]
    assert result["results"]["groups"]["base"]["n"] == 3


def test_a_run_started_with_other_code_is_not_continued(in_workdir, monkeypatch):
    monkeypatch.setattr(compare, "run_training", lambda argv, log: train_here(argv + ["--max_iters=5"], log))
    with pytest.raises(UserError, match="stopped before its budget"):
        compare.main(comparison_args("edited", f"base={TINY}"))
    monkeypatch.setattr(compare, "code_version", lambda: "edited")
    with pytest.raises(UserError, match="was started with other code .* undo the edit"):
        compare.main(comparison_args("edited", f"base={TINY}"))


def test_more_seeds_of_the_baseline_after_an_edit_are_refused_not_trained_with_it(in_workdir, monkeypatch):
    """The README's worked example grown to more seeds: with model.py edited for the change, the baseline's new seeds
    would run the edit; they are refused before anything trains, and made once the edit is undone."""
    code_version = compare.code_version
    compare.main(comparison_args("edit", f"base={TINY}", seeds=2))
    monkeypatch.setattr(compare, "code_version", lambda: "edited")
    compare.main(comparison_args("edit", f"base={TINY}", f"edit={TINY}", seeds=2))
    calls = []
    monkeypatch.setattr(compare, "run_training", lambda argv, log: calls.append(argv) or train_here(argv, log))
    with pytest.raises(UserError, match=r"^base's runs were made with other code .* seed 1339 would not be base; undo"):
        compare.main(comparison_args("edit", f"base={TINY}", f"edit={TINY}", seeds=3))
    assert calls == []
    monkeypatch.setattr(compare, "code_version", code_version)  # the edit undone: the baseline's seed, then the change's
    monkeypatch.setattr(compare, "run_training", train_here)
    compare.main(comparison_args("edit", f"base={TINY}", seeds=3))
    monkeypatch.setattr(compare, "code_version", lambda: "edited")
    result = compare.main(comparison_args("edit", f"base={TINY}", f"edit={TINY}", seeds=3))
    groups = result["results"]["groups"]
    assert groups["base"]["code"] == [code_version()] and groups["edit"]["code"] == ["edited"]  # one version each
    assert groups["base"]["n"] == groups["edit"]["n"] == 3


def test_a_budget_of_tokens_gives_each_group_its_iterations(in_workdir):
    result = compare.main(comparison_args("tokens", f"b4={TINY}", f"b8={TINY} --batch_size=8", seeds=1)[:-3] +
                          ["--tokens=2560", "--out_dir=tokens", "--threads=1"])
    assert result["runs"]["b4"]["1337"]["iters"] == 20 and result["runs"]["b8"]["1337"]["iters"] == 10  # 128, 256/it
    assert result["results"]["differences"]["b8 - b4"]["verdict"].startswith("no verdict: one seed")


def test_a_small_budget_evaluates_often_enough_to_draw_each_val_curve(in_workdir):
    """TINY evaluates every 10 iterations: at 20 iterations a curve would have 3 points; compare.py asks for more."""
    compare.main(comparison_args("evals", f"a={TINY}", seeds=1, iters=20))
    evaluated = [r["iter"] for r in plot.read_metrics(os.path.join("evals", "a", "seed1337"))[1]]  # (train, val)
    assert len(evaluated) >= compare.MIN_EVALS and evaluated[-1] == 20, evaluated
    # a config that evaluates often enough keeps its own interval
    assert compare.budget_args(dict(kind="iters", value=1000), 1000, 100) == ["--max_iters=1000", "--lr_decay_iters=1000"]


def test_a_budget_of_seconds_stops_on_the_clock(in_workdir):
    result = compare.main(comparison_args("clock", f"base={TINY}", seeds=1)[:-3] +
                          ["--seconds=1.5", "--out_dir=clock", "--threads=1"])
    run = result["runs"]["base"]["1337"]
    assert 1.5 <= run["seconds"] < 5 and run["iters"] > 20


def test_lr_decays_on_the_clock_under_max_seconds():
    settings = dict(train.DEFAULTS, warmup_iters=10, max_iters=10 ** 12, lr_decay_iters=0, learning_rate=1e-3,
                    min_lr=1e-4, max_seconds=60)
    assert train.lr_multiplier(5, settings, 0.9) == pytest.approx(0.6)  # warmup still counts iterations
    assert train.lr_multiplier(50, settings, 0.5) == pytest.approx(0.55)  # halfway down the cosine
    assert train.lr_multiplier(50, settings, 1.2) == pytest.approx(0.1)  # past the budget: min_lr


BAD = {  # command -> the start of its one-line error
    "different datasets": ([f"a={TINY}", f"b={TINY} --dataset=other"], "the groups train on different datasets"),
    "tokens below one step": ([f"a={TINY}", "--tokens=10"], "--tokens=10 is less than one iteration of group a"),
    "no budget": ([f"a={TINY}", "--iters=0"], "--iters must be a positive number"),
    "sets its seed": ([f"a={TINY} --seed=3"], "group a sets --seed, which compare.py sets"),
    "same name": ([f"a={TINY}", f"a={TINY} --mlp=relu2"], "two groups have the same name"),
    "unknown setting": ([f"a={TINY} --learnin_rate=1"], "group a: "),
    # found once its runs started, after the other groups' had trained
    "bad setting": ([f"a={TINY}", f"b={TINY} --loss_chunk=-1"], "group b: loss_chunk must be at least 0, got -1"),
    "bad model": ([f"a={TINY}", f"b={TINY} --n_kv_head=3"], "group b: n_head must be divisible by n_kv_head (3)"),
    # nan written to comparison.json never equals itself: the folder refused every budget after it
    "nan budget": ([f"a={TINY}", "--seconds=nan"], "--seconds must be a positive number, got nan"),
    "inf budget": ([f"a={TINY}", "--seconds=inf"], "--seconds must be a positive number, got inf"),
    # a dashed spelling, which configure reads as max_seconds, got past the check
    "sets its budget, dashed": ([f"a={TINY} --max-seconds=1"], "group a sets --max_seconds, which compare.py sets"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_writes_nothing(in_workdir, case):
    args, message = BAD[case]
    with pytest.raises(UserError) as e:
        compare.main(args + [f"--out_dir=bad-{case}"])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert not os.path.exists(f"bad-{case}/comparison.json")


def test_an_out_dir_of_another_comparison_or_anything_else_is_not_touched(in_workdir):
    compare.main(comparison_args("taken", f"a={TINY}", seeds=1))
    with open("taken/comparison.json") as f:
        before = f.read()
    with pytest.raises(UserError, match="a comparison at another budget"):
        compare.main(comparison_args("taken", f"a={TINY}", seeds=1, iters=13))
    with pytest.raises(UserError, match="has a group a with other arguments"):
        compare.main(comparison_args("taken", f"a={TINY} --mlp=relu2", seeds=1))
    with open("taken/comparison.json") as f:
        assert f.read() == before
    os.makedirs("somebody/else")
    with pytest.raises(UserError, match="somebody exists and holds no comparison.json"):
        compare.main(comparison_args("somebody", f"a={TINY}", seeds=1))
    assert sorted(os.listdir("somebody")) == ["else", "lock"]  # the lock compare.py held while it looked


def test_the_plot_band_spans_the_seeds():
    def run(offset):
        train = [dict(iter=i, time=i / 10 + offset, loss=3 - i / 10 + offset) for i in (5, 10)]
        val = [dict(iter=i, time=i / 10 + offset, train_loss=0, val_loss=3 - i / 10 + offset) for i in (0, 10)]
        return train, val
    fig = plot.draw_groups({"g": [run(0.0), run(0.3), run(0.1)]})
    band = fig.axes[0].collections[0].get_paths()[0].vertices
    assert band[:, 1].min() == pytest.approx(2.0) and band[:, 1].max() == pytest.approx(3.3)  # lowest, highest seed
    val_line = [line for line in fig.axes[0].lines if "val" in line.get_label()][0]
    assert list(val_line.get_ydata()) == pytest.approx([3 + 0.4 / 3, 2 + 0.4 / 3])  # the mean of the seeds


def test_ctrl_c_leaves_a_checkpoint_and_the_same_command_finishes(in_workdir, capsys):
    """The real command in its own process: Ctrl-C reaches compare.py and its train.py, which saves a checkpoint
    (compare.py waits for it rather than killing it); the same command then continues that run and finishes (run in
    this process: what it proves is the continuation, not the process). Ctrl-C comes once the log shows iteration 5
    (training under way, the run's signal handler installed): of the run's 200 iterations, 195 are still to go, ~1 s
    of work (~5 ms each), ten times the 0.1 s between the test's looks at the log."""
    workdir, args = in_workdir, [f"a={TINY} --eval_interval=100000", "--seeds=1", "--iters=200", "--out_dir=ctrl-c",
                                 "--threads=1"]
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "compare.py"), *args], cwd=workdir,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=sigint_as_in_a_terminal)
    log = workdir / "ctrl-c" / "a" / "seed1337" / "train.log"
    deadline = time.time() + 120
    while not (log.exists() and "iter 5:" in log.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 130 and "interrupted: the run in progress saved a checkpoint" in output, output
    assert "stopped by signal" in log.read_text()
    compare.main(args)  # raises where a run fails
    assert "a seed 1337: continuing" in capsys.readouterr().out and "resumed from iteration" in log.read_text()
    with open(workdir / "ctrl-c" / "comparison.json") as f:
        assert json.load(f)["runs"]["a"]["1337"]["iters"] == 200
