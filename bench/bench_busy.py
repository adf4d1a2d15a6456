"""Training and sampling speed on a machine shared with other work: config/small.py alone, beside a second copy of
itself, and beside a test suite, under each thread setting; sample.py alone, beside a training run and beside the
test suite. The tables for bench/RESULTS.md.

    python bench/bench_busy.py                         # every scenario x setting, 300 iterations each
    python bench/bench_busy.py --iters 150 --settings default,one_thread
    python bench/bench_busy.py --command sample        # sample.py --prompt "ROMEO:" from out-small (train it first)

Scenarios: "alone"; "beside a copy" (two identical train.py runs at once; their mean ms/iter); "beside tests" (a
pytest run of tests/test_model.py and tests/test_invariants.py, restarted until the training ends, with torch's
default threads, as a user's suite would run). Settings, each the environment of the measured train.py runs:
  default      torch's defaults (a thread per core, OpenMP's spinning wait)
  one_thread   OMP_NUM_THREADS=1
  passive      OMP_WAIT_POLICY=PASSIVE (waiting threads sleep instead of spinning)
  auto         none of the above: train.py's own choice (--threads=0, the default: machine.py), which these
               figures decided; the others pass --threads=<cores> (or 1) so that train.py keeps what they set
Each cell is the median ms/iter of the logged intervals after the first two. Run it on an otherwise quiet machine:
the scenarios bring their own load.

sample.py (--command sample): README's `python sample.py --prompt "ROMEO:"` (500 tokens) from --out_dir, --repeats
times per cell, the median tokens/s; "beside training" is config/small.py training with torch's default threads (as
a user's run would before this machine.py), restarted until the cell ends. Settings as above, through the
environment (sample.py has no --threads): default and passive also set OMP_NUM_THREADS=<cores> (torch's count, kept:
what sample.py did before it shared the CPU), auto sets nothing (machine.SharedCpu decides). The table's factor is
how many times slower than alone with the default, for both commands.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gpt.cpuinfo import cpu_name  # noqa: E402

SETTINGS = {"default": {}, "one_thread": {"OMP_NUM_THREADS": "1"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            "auto": {}}
SCENARIOS = {"train": ("alone", "beside a copy", "beside tests"),
             "sample": ("alone", "beside training", "beside tests")}
SPEED = re.compile(r"^\d+ tokens in [\d.]+ s \(([\d.]+) tokens/s")  # sample.py's speed line (stderr)
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "GOMP_SPINCOUNT")


def train(out_dir, iters, env, threads):
    command = [sys.executable, "train.py", "config/small.py", f"--out_dir={out_dir}", f"--max_iters={iters}",
               "--eval_interval=100000", "--overwrite=True", f"--threads={threads}"]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ms_per_iter(proc, out_dir):
    output = proc.communicate()[0]
    if proc.returncode:
        sys.exit(f"error: train.py failed:\n{output[-2000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        timed = [json.loads(line)["ms_per_iter"] for line in f if "ms_per_iter" in line]
    return statistics.median(timed[2:] or timed), output


def tests_in_a_loop():
    """A CPU-heavy test run, restarted whenever it ends (a shell loop: killed with its process group)."""
    pytest = f"{sys.executable} -m pytest -q -p no:cacheprovider tests/test_model.py tests/test_invariants.py"
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    return subprocess.Popen(["bash", "-c", f"while true; do {pytest} > /dev/null 2>&1; done"], cwd=ROOT, env=env,
                            start_new_session=True)


def training_in_a_loop(work):
    """config/small.py training with torch's default threads, restarted whenever it ends (killed with its group)."""
    train = (f"{sys.executable} train.py config/small.py --out_dir={os.path.join(work, 'load')} --max_iters=100000 "
             f"--eval_interval=100000 --overwrite=True --threads={os.cpu_count()}")
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    return subprocess.Popen(["bash", "-c", f"while true; do {train} > /dev/null 2>&1; done"], cwd=ROOT, env=env,
                            start_new_session=True)


def sample_cell(scenario, setting, repeats, out_dir, work):
    """The median tokens/s of `repeats` sample.py runs (500 tokens of "ROMEO:") in this scenario and setting."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV} | SETTINGS[setting]
    if setting != "auto":  # the count kept (torch's own by default: sample.py before it shared the CPU)
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    load = {"beside training": training_in_a_loop, "beside tests": lambda work: tests_in_a_loop()}.get(scenario)
    load = load(work) if load else None
    speeds, said = [], []
    try:
        if load:
            time.sleep(5)  # the load running (a training run past its start, the suite's first tests)
        for _ in range(repeats):
            result = subprocess.run([sys.executable, "sample.py", f"--out_dir={out_dir}", "--prompt=ROMEO:",
                                     "--device=cpu"], cwd=ROOT, env=env, capture_output=True, text=True)
            if result.returncode:
                sys.exit(f"error: sample.py failed:\n{result.stderr[-2000:]}")
            lines = result.stderr.splitlines()
            speeds += [float(m.group(1)) for m in map(SPEED.match, lines) if m]
            said += [line for line in lines if "busy" in line]
    finally:
        if load:
            os.killpg(load.pid, 9)
            load.wait()
    return statistics.median(speeds), said


def cell(scenario, setting, iters, work):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV} | SETTINGS[setting]
    threads = 0 if setting == "auto" else 1 if setting == "one_thread" else os.cpu_count()
    load = tests_in_a_loop() if scenario == "beside tests" else None
    try:
        if load:
            time.sleep(5)  # the suite's first tests running
        copies = 2 if scenario == "beside a copy" else 1
        dirs = [os.path.join(work, f"{setting}_{scenario.replace(' ', '_')}_{i}") for i in range(copies)]
        procs = [train(d, iters, env, threads) for d in dirs]
        results = [ms_per_iter(p, d) for p, d in zip(procs, dirs)]
    finally:
        if load:
            os.killpg(load.pid, 9)
            load.wait()
    said = [line for _, output in results for line in output.splitlines() if "busy" in line]
    return statistics.mean(ms for ms, _ in results), said


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--command", default="train", choices=SCENARIOS, help="whose speed: train.py or sample.py")
    parser.add_argument("--iters", type=int, default=300, help="train: iterations per run")
    parser.add_argument("--out_dir", default="out-small",
                        help="sample: the run to sample from (python train.py config/small.py)")
    parser.add_argument("--repeats", type=int, default=5, help="sample: runs per cell, their median")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--scenarios", help="default: every scenario of the command")
    args = parser.parse_args()
    known = SCENARIOS[args.command]
    settings, scenarios = args.settings.split(","), (args.scenarios.split(",") if args.scenarios else list(known))
    if not set(settings) <= SETTINGS.keys() or not set(scenarios) <= set(known):
        sys.exit(f"error: --settings from {','.join(SETTINGS)}; --scenarios from {','.join(known)}")
    sampling = args.command == "sample"
    out_dir = next((d for d in (os.path.abspath(args.out_dir), os.path.join(ROOT, args.out_dir))
                    if os.path.exists(os.path.join(d, "ckpt.pt"))), None)
    if sampling and out_dir is None:
        sys.exit(f"error: no checkpoint in {args.out_dir}; train it first: python train.py config/small.py")
    unit = "tokens/s" if sampling else "ms/iter"
    what = (f"sample.py --prompt=ROMEO: from {args.out_dir}, {args.repeats} runs" if sampling
            else f"config/small.py, {args.iters} iterations")
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start; "
          f"{what}, {unit} (median)", flush=True)
    work = tempfile.mkdtemp(prefix="bench_busy_")
    table = {}
    for scenario in scenarios:
        for setting in settings:
            if sampling:
                table[scenario, setting], said = sample_cell(scenario, setting, args.repeats, out_dir, work)
            else:
                table[scenario, setting], said = cell(scenario, setting, args.iters, work)
            print(f"{scenario:>15} | {setting:>10}: {table[scenario, setting]:7.1f} {unit}"
                  + (f"  (said: {said[0]})" if said else ""), flush=True)
    print("\n| scenario | " + " | ".join(settings) + " |\n| --- |" + " --- |" * len(settings))
    for scenario in scenarios:
        alone = table.get(("alone", "default"))
        slower = (lambda value: alone / value) if sampling else (lambda value: value / alone)
        cells = [f"{table[scenario, s]:.1f}" + (f" ({slower(table[scenario, s]):.2g}x)" if alone else "")
                 for s in settings]
        print(f"| {scenario} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
