"""Training speed on a machine shared with other work: config/small.py alone, beside a second copy of itself, and
beside a test suite, under each thread setting. The table for bench/RESULTS.md.

    python bench/bench_busy.py                         # every scenario x setting, 300 iterations each
    python bench/bench_busy.py --iters 150 --settings default,one_thread

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
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench_sample import cpu_model  # noqa: E402

SETTINGS = {"default": {}, "one_thread": {"OMP_NUM_THREADS": "1"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            "auto": {}}
SCENARIOS = ("alone", "beside a copy", "beside tests")
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
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    settings, scenarios = args.settings.split(","), args.scenarios.split(",")
    if not set(settings) <= SETTINGS.keys() or not set(scenarios) <= set(SCENARIOS):
        sys.exit(f"error: --settings from {','.join(SETTINGS)}; --scenarios from {','.join(SCENARIOS)}")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start; "
          f"config/small.py, {args.iters} iterations, ms/iter (median)", flush=True)
    work = tempfile.mkdtemp(prefix="bench_busy_")
    table = {}
    for scenario in scenarios:
        for setting in settings:
            table[scenario, setting], said = cell(scenario, setting, args.iters, work)
            print(f"{scenario:>14} | {setting:>10}: {table[scenario, setting]:7.1f} ms/iter"
                  + (f"  (said: {said[0]})" if said else ""), flush=True)
    print("\n| scenario | " + " | ".join(settings) + " |\n| --- |" + " --- |" * len(settings))
    for scenario in scenarios:
        alone = table.get(("alone", "default"))
        cells = [f"{table[scenario, s]:.1f}" + (f" ({table[scenario, s] / alone:.1f}x)" if alone else "")
                 for s in settings]
        print(f"| {scenario} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
