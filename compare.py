"""
Is my change better, or noise? Train a baseline and a change over several seeds at an equal budget and
compare their final val losses against the spread between seeds:

    python compare.py baseline=config/small.py relu2="config/small.py --mlp=relu2" --seeds=5
    python compare.py config/small.py --seeds=5 --iters=600       # one group: how far apart seeds land

Each group is a name and train.py's arguments (a config file and --key=value overrides); the first group is
the baseline. Every run is train.py as it is, in its own process, in <out_dir>/<group>/seed<N>, and the
budget is the same for all of them: --iters, --tokens (iterations from each group's tokens per iteration) or
--seconds of wall time (train.py's max_seconds; the learning rate decays on that clock), with the schedule
fitted to it. Seed N of every group shares its data order, so the groups are compared seed by seed (a paired
t-interval); the verdict is "better" or "worse" only when the 95% interval of the difference excludes zero.

<out_dir>/comparison.json holds the settings and results; <out_dir>/compare.png the groups' curves with
their spread. Running the same command again resumes: finished runs are kept, an interrupted one continues
from its checkpoint, and new groups or more seeds may be added. To compare an edit of model.py, run the
baseline group first, edit, then run the command again with a second group:

    python compare.py baseline=config/small.py --seeds=5 --out_dir=cmp-edit
    # ...edit model.py...
    python compare.py baseline=config/small.py edit=config/small.py --seeds=5 --out_dir=cmp-edit

A group's runs are all made with one version of the code: more seeds later mean the baseline's first, without the
edit, then the command again with it (asked the other way round, the baseline's new seeds are refused).
"""

import argparse
import functools
import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys

from configurator import configure
from gpt import UserError
from gpt.files import lock_folder, write_json
from gpt.metrics import read_jsonl
from gpt.shards import load_meta

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train.py")
CODE_FILES = ("model.py", "train.py")  # an edit to these makes runs of one group incomparable
MIN_EVALS = 5  # points per val curve at the least, a budget of iterations or tokens given
SET_BY_COMPARE = ("out_dir", "seed", "init_from", "overwrite", "max_iters", "max_seconds", "lr_decay_iters")
FIRST_SEED = 1337  # train.py's default: a comparison's first seed is the run `python train.py <config>` makes
NAME = re.compile(r"[A-Za-z_][\w.-]*")


# ----------------------------------------------------------------------------------------------------
# Statistics: small samples, so a t-interval, with the t quantile computed from the density


def t_cdf(x, df, steps=400):
    """P(T <= x) for Student's t with df degrees of freedom and x >= 0: 1/2 plus the density's integral from
    0 to x by Simpson's rule."""
    def density(t):
        return math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
                        - (df + 1) / 2 * math.log1p(t * t / df))
    h = x / steps
    inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
    return 0.5 + h / 3 * (density(0) + inner + density(x))


@functools.lru_cache  # a few distinct (p, df) per comparison, each a bisection over numerical integrals
def t_quantile(p, df):
    """The x with P(T <= x) = p, for p in (0.5, 1), by bisection."""
    low, high = 0.0, 1000.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def summary(values):
    """n, mean and sample standard deviation (None for one value) of a list of numbers."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return dict(n=n, mean=mean, sd=sd)


def paired_difference(base, change, confidence=0.95):
    """change - base over the seeds both have, as the mean difference, its interval and a verdict. Lower val
    loss is better. One seed has no spread to judge a difference by, so it gets no verdict."""
    seeds = sorted(set(base) & set(change))
    diffs = [change[s] - base[s] for s in seeds]
    result = dict(seeds=len(seeds), mean=sum(diffs) / len(diffs) if diffs else None, low=None, high=None)
    if len(diffs) < 2:
        result["verdict"] = "no verdict: one seed has no spread to judge by; run --seeds=3 or more"
        return result
    stats = summary(diffs)
    half = t_quantile(1 - (1 - confidence) / 2, len(diffs) - 1) * stats["sd"] / math.sqrt(len(diffs))
    result.update(low=stats["mean"] - half, high=stats["mean"] + half)
    if stats["sd"] == 0 and stats["mean"] == 0:
        result["verdict"] = "no difference: every seed gave the same val loss"
    elif result["high"] < 0:
        result["verdict"] = "better"
    elif result["low"] > 0:
        result["verdict"] = "worse"
    else:
        result["verdict"] = f"cannot tell at {len(diffs)} seeds" + seeds_to_resolve(stats)
    return result


def seeds_to_resolve(stats, confidence=0.95):
    """The seeds at which a difference of this mean and spread would clear its interval (up to 50)."""
    if stats["mean"] == 0:
        return ""
    for n in range(stats["n"] + 1, 51):
        if t_quantile(1 - (1 - confidence) / 2, n - 1) * stats["sd"] / math.sqrt(n) < abs(stats["mean"]):
            return f" (were it real and this size, about {n} seeds would show it)"
    return " (were it real and this size, it would take more than 50 seeds to show)"


# ----------------------------------------------------------------------------------------------------
# The comparison: groups, budget, runs


def parse_group(spec, index):
    """(name, train.py arguments) from "name=args" or plain "args" (then named after its config file)."""
    name, sep, rest = spec.partition("=")
    if not (sep and NAME.fullmatch(name)):
        name, rest = None, spec
    args = shlex.split(rest)
    if not args:
        raise UserError(f"group {spec!r} has no train.py arguments; give e.g. name=config/small.py")
    if name is None:
        configs = [a for a in args if a.endswith(".py")]
        name = os.path.splitext(os.path.basename(configs[0]))[0] if configs else f"group{index + 1}"
    for arg in args:
        key = arg[2:].partition("=")[0].replace("-", "_") if arg.startswith("--") else None  # as configure reads it
        if key in SET_BY_COMPARE:
            raise UserError(f"group {name} sets --{key}, which compare.py sets for every run; give the budget as "
                            "--iters, --tokens or --seconds and the output folder as --out_dir")
    return name, args


def resolve(name, args):
    """The settings a group's runs train with (train.py's defaults, config files and overrides), checked as train.py
    checks them: a group's mistake is found before another group's runs train."""
    import train  # torch and the model: only once the command line has been checked

    try:
        return train.check_settings(configure(train.DEFAULTS, args))
    except UserError as e:
        raise UserError(f"group {name}: {e}") from None


def tokens_per_iter(settings):
    from gpt.parallel import micro_steps_per_process  # the global batch's rule, one process

    return settings["batch_size"] * settings["block_size"] * micro_steps_per_process(settings, 1)


def budget_iters(budget, settings, name):
    """The iterations a group's runs train for: the budget's, or as many as its tokens make, or, for a budget of
    seconds, more than any run gets through (the clock stops it)."""
    kind, value = budget["kind"], budget["value"]
    if kind == "seconds":
        return 10 ** 12
    iters = value if kind == "iters" else value // tokens_per_iter(settings)
    if iters < 1:
        raise UserError(f"--tokens={value} is less than one iteration of group {name} "
                        f"({tokens_per_iter(settings):,} tokens); give a larger budget")
    return iters


def budget_args(budget, iters, eval_interval):
    """train.py arguments that give a run the budget, with the learning-rate schedule fitted to it, and evaluations
    often enough that each val curve has MIN_EVALS points at least (a config's eval_interval may outlast a small
    budget)."""
    if budget["kind"] == "seconds":  # the decay then runs on the clock (train.lr_multiplier)
        return [f"--max_seconds={budget['value']}", f"--max_iters={iters}", "--lr_decay_iters=0"]
    evals = [f"--eval_interval={max(1, iters // MIN_EVALS)}"] if iters // eval_interval < MIN_EVALS else []
    return [f"--max_iters={iters}", f"--lr_decay_iters={iters}", *evals]


def check_comparable(settings):
    """Val losses compare only on the same data and tokenizer: one dataset for every group; each group's model as
    train.py will make it on that data (checked now, as the settings are)."""
    import train  # resolve's import already

    datasets = {name: s["dataset"] for name, s in settings.items()}
    if len(set(datasets.values())) > 1:
        listed = ", ".join(f"{name}: {d}" for name, d in datasets.items())
        raise UserError(f"the groups train on different datasets ({listed}), whose val losses do not compare; "
                        "give every group the same --dataset")
    dataset = next(iter(datasets.values()))
    meta = load_meta(os.path.join("data", dataset))  # the dataset is prepared, or a UserError says how to prepare it
    for name, group_settings in settings.items():
        try:
            train.model_config(group_settings, meta)
        except UserError as e:
            raise UserError(f"group {name}: {e}") from None


def code_version():
    """A short hash of the files whose edits change what a run computes."""
    digest = hashlib.sha256()
    for name in CODE_FILES:
        with open(os.path.join(HERE, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def load_comparison(path, out_dir, budget, groups):
    """The comparison already in out_dir, checked against this command: the same budget, and each group it
    has with the same arguments. A folder holding something else is refused, never overwritten."""
    if not os.path.exists(path):
        if os.path.isdir(out_dir) and set(os.listdir(out_dir)) - {"lock"}:
            raise UserError(f"{out_dir} exists and holds no comparison.json; give another --out_dir")
        return dict(budget=budget, groups={}, runs={})
    try:
        with open(path) as f:
            saved = json.load(f)
        saved_budget, saved_groups = saved["budget"], saved["groups"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a comparison written by compare.py ({type(e).__name__}); give another "
                        "--out_dir") from None
    if saved_budget != budget:
        raise UserError(f"{out_dir} holds a comparison at another budget ({saved_budget['value']} "
                        f"{saved_budget['kind']}); give the same budget or another --out_dir")
    for name, args in groups.items():
        if name in saved_groups and saved_groups[name]["args"] != args:
            raise UserError(f"{out_dir} has a group {name} with other arguments ({shlex.join(saved_groups[name]['args'])}); "
                            "give this group another name, or use another --out_dir")
    return saved


def run_training(argv, log_path):
    """One train.py run in its own process, its output going to log_path; the exit status. Ctrl-C reaches the
    run too, which saves a checkpoint: it is waited for, not killed (as subprocess.run would) while it saves."""
    with open(log_path, "a") as log:
        process = subprocess.Popen([sys.executable, TRAIN, *argv], stdout=log, stderr=subprocess.STDOUT)
        try:
            return process.wait()
        except KeyboardInterrupt:
            process.wait()
            raise


def run_result(run_dir, budget, iters):
    """A finished run's final evaluation and speed, from its metrics.jsonl; None if it stopped short of the
    budget (a signal: train.py then saves a checkpoint and exits cleanly)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    records = [r for _, r in read_jsonl(path)[0]] if os.path.exists(path) else []
    evals = [r for r in records if "val_loss" in r]
    speeds = [r["ms_per_iter"] for r in records if "ms_per_iter" in r]
    if not evals or (evals[-1]["time"] < budget["value"] if budget["kind"] == "seconds" else evals[-1]["iter"] < iters):
        return None
    return dict(val_loss=evals[-1]["val_loss"], iters=evals[-1]["iter"], seconds=round(evals[-1]["time"], 2),
                ms_per_iter=round(sum(speeds) / len(speeds), 2) if speeds else None)


def last_line(path):
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else "no output"


def train_run(name, seed, args, comparison, out_dir, threads, code, budget, iters):
    """Train (or continue) one group's run for one seed, and record its result in the comparison."""
    run_dir = os.path.join(out_dir, name, f"seed{seed}")
    record = comparison["runs"].setdefault(name, {}).get(str(seed))
    if record and "val_loss" in record:
        return
    if record and record["code"] != code:
        raise UserError(f"{name} seed {seed} was started with other code ({', '.join(CODE_FILES)} hash "
                        f"{record['code']}, now {code}); undo the edit to finish it, or use another --out_dir")
    # A group is one version of the code: more seeds of the baseline, asked for after model.py was edited for the
    # change, would otherwise be trained with the change in them
    finished = {r["code"] for r in comparison["runs"][name].values() if "val_loss" in r}
    if finished and code not in finished:
        raise UserError(f"{name}'s runs were made with other code ({', '.join(CODE_FILES)} hash "
                        f"{', '.join(sorted(finished))}, now {code}), so seed {seed} would not be {name}; undo the edit "
                        f"and run {name} alone with these --seeds, then redo it, or use another --out_dir")
    resume = os.path.exists(os.path.join(run_dir, "ckpt.pt"))
    os.makedirs(run_dir, exist_ok=True)
    argv = [*args, f"--out_dir={run_dir}", f"--seed={seed}", f"--threads={threads}",
            "--init_from=resume" if resume else "--overwrite=True"]
    print(f"{name} seed {seed}: {'continuing' if resume else 'training'} (log: {os.path.join(run_dir, 'train.log')})",
          flush=True)
    comparison["runs"][name][str(seed)] = dict(code=code)
    save_comparison(comparison, out_dir)
    status = run_training(argv, os.path.join(run_dir, "train.log"))
    if status != 0:
        raise UserError(f"{name} seed {seed} stopped: {last_line(os.path.join(run_dir, 'train.log'))}; fix "
                        "that and run the same command again (finished runs are kept)")
    result = run_result(run_dir, budget, iters)
    if result is None:
        raise UserError(f"{name} seed {seed} stopped before its budget (log: {os.path.join(run_dir, 'train.log')}); "
                        "run the same command again to continue it")
    comparison["runs"][name][str(seed)] = dict(code=code, **result)
    save_comparison(comparison, out_dir)


def save_comparison(comparison, out_dir):
    write_json(os.path.join(out_dir, "comparison.json"), comparison, indent=1)


def results(comparison, names, seeds):
    """Per group, the seeds' val losses summarized, and the code that ran them; per later group, its paired
    difference from the first (the baseline)."""
    runs = {name: [(seed, comparison["runs"][name].get(str(seed), {})) for seed in seeds] for name in names}
    losses = {name: {seed: r["val_loss"] for seed, r in group if "val_loss" in r} for name, group in runs.items()}
    groups = {name: dict(summary(list(losses[name].values())), code=sorted({r["code"] for _, r in group if r}))
              for name, group in runs.items()}
    differences = {f"{name} - {names[0]}": paired_difference(losses[names[0]], losses[name]) for name in names[1:]}
    return dict(groups=groups, differences=differences)


def report(comparison, names, seeds):
    """The table printed at the end: every run, every group, every difference."""
    lines = [f"{'group':<16} {'seed':>6} {'val loss':>9} {'iters':>7} {'seconds':>8}"]
    for name in names:
        for seed in seeds:
            r = comparison["runs"][name][str(seed)]
            lines.append(f"{name:<16} {seed:>6} {r['val_loss']:>9.4f} {r['iters']:>7} {r['seconds']:>8.1f}")
    lines.append(f"{'group':<16} {'runs':>6} {'mean val':>9} {'sd':>7}  code ({', '.join(CODE_FILES)})")
    for name, g in comparison["results"]["groups"].items():
        sd = f"{g['sd']:.4f}" if g["sd"] is not None else "-"
        lines.append(f"{name:<16} {g['n']:>6} {g['mean']:>9.4f} {sd:>7}  {', '.join(g['code'])}")
    for label, d in comparison["results"]["differences"].items():
        interval = f" (95% interval {d['low']:+.4f} to {d['high']:+.4f}, paired by seed)" if d["low"] is not None else ""
        mean = f"{d['mean']:+.4f}" if d["mean"] is not None else "-"
        lines.append(f"{label}: {mean}{interval}: {d['verdict']}")
    return "\n".join(lines)


def plot_groups(comparison, names, out_dir, seeds):
    """compare.png: each group's curves, its mean and the spread between its seeds."""
    import plot

    groups = {name: [plot.read_metrics(os.path.join(out_dir, name, f"seed{seed}")) for seed in seeds]
              for name in names}
    path = os.path.join(out_dir, "compare.png")
    plot.save(plot.draw_groups(groups), path)
    return path


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("groups", nargs="+", help='name="train.py arguments"; the first is the baseline')
    parser.add_argument("--seeds", type=int, default=3, help="runs per group, seeds 1337, 1338, ... (default 3)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--iters", type=int, help="iterations per run (default: the first group's max_iters)")
    budget.add_argument("--tokens", type=int, help="training tokens per run")
    budget.add_argument("--seconds", type=float, help="wall-clock seconds per run, evaluation included")
    parser.add_argument("--out_dir", default="compare", help="where the runs and comparison.json go")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="CPU threads per run, fixed so that a run's losses do not depend on the machine's load")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        raise UserError(f"--seeds must be at least 1, got {args.seeds}")
    groups = dict(parse_group(spec, i) for i, spec in enumerate(args.groups))
    if len(groups) < len(args.groups):
        raise UserError("two groups have the same name; name them, e.g. baseline=config/small.py change=...")
    settings = {name: resolve(name, group_args) for name, group_args in groups.items()}
    check_comparable(settings)
    first = next(iter(settings.values()))
    kind = next((k for k in ("iters", "tokens", "seconds") if getattr(args, k) is not None), "iters")
    value = getattr(args, kind) if getattr(args, kind) is not None else first["max_iters"]
    if not 0 < value < math.inf:  # nan, once written to comparison.json, would never equal itself again
        raise UserError(f"--{kind} must be a positive number, got {value}")
    budget = dict(kind=kind, value=value)
    iters = {name: budget_iters(budget, settings[name], name) for name in groups}
    full_args = {name: [*group_args, *budget_args(budget, iters[name], settings[name]["eval_interval"])]
                 for name, group_args in groups.items()}
    seeds = list(range(FIRST_SEED, FIRST_SEED + args.seeds))

    out_dir = args.out_dir
    lock = lock_folder(out_dir, "compare.py")
    try:
        path = os.path.join(out_dir, "comparison.json")
        comparison = load_comparison(path, out_dir, budget, groups)
        for name, group_args in groups.items():
            comparison["groups"].setdefault(name, dict(args=group_args))
        comparison["seeds"] = seeds
        code = code_version()
        print(f"{len(groups)} group(s) x {len(seeds)} seed(s), {value} {kind} per run, into {out_dir}")
        for seed in seeds:  # seed by seed: an early stop leaves complete pairs to compare
            for name in groups:
                train_run(name, seed, full_args[name], comparison, out_dir, args.threads, code, budget, iters[name])
        comparison["results"] = results(comparison, list(groups), seeds)
        save_comparison(comparison, out_dir)
        print(report(comparison, list(groups), seeds))
        print(f"{path}, {plot_groups(comparison, list(groups), out_dir, seeds)}")
        return comparison
    finally:
        lock.close()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # the shell's status for Ctrl-C, as every command exits with
        print("interrupted: the run in progress saved a checkpoint; run the same command to continue", file=sys.stderr)
        sys.exit(130)
