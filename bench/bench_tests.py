"""
How long the test suite takes, and where the time goes: runs `python -m pytest` (the whole suite, or the files and
options given) in a fresh process, then prints the wall time, the seconds of each file and the slowest tests, each
test's set-up (its fixtures' share) and tear-down included; the CPU seconds the suite used, in all, by file, by
test; and beside each test over 15 s, the files whose tests ran while it did (what shared the cores). Speed is
measured here, never asserted in a test.

    python bench/bench_tests.py                                  # the whole suite, as README's command runs it
    python bench/bench_tests.py tests/test_invariants.py         # the fast check
    python bench/bench_tests.py --save=after.json --before=before.json   # and a column of an earlier run's figures
    python bench/bench_tests.py -- -n0                           # every test in one process (no pytest-xdist workers)

Run it on a quiet machine: the figures are wall-clock seconds, and another job on the same cores moves them. The whole
suite runs its files side by side, a process per core (pytest.ini's -n auto): a test's seconds then include the
other processes' share of the cores; -n0 gives each test's own. The CPU seconds are the work itself, whatever else ran
beside: a test's own process's, and those of the processes it started and waited for; a process still running when
its test ends (inductor's compile workers, a fixture's background run) counts in the total only, or for the test that
waits for it.
"""

import argparse
import collections
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gpt.cpuinfo import cpu_flags, cpuinfo_field  # noqa: E402

LIMIT_S = 15.0  # no test, its set-up included, should take longer (issue 56)
CPU_LOG_ENV = "BENCH_TESTS_CPU_LOG"  # where each pytest process that runs tests appends a line per test (its CPU, when)


def cpu_seconds(who=resource.RUSAGE_SELF):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def own_and_waited_cpu_seconds():
    return cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A pytest hook (this file is loaded as a plugin in each pytest process, `-p bench.bench_tests`): the CPU seconds
    of each test, its set-up and tear-down included, and when it ran, in the process that runs it (not pytest-xdist's
    controller)."""
    start, started = own_and_waited_cpu_seconds(), time.time()
    result = yield
    if os.environ.get(CPU_LOG_ENV):
        with open(os.environ[CPU_LOG_ENV], "a") as f:  # [test id, CPU seconds, [start, end]]
            f.write(json.dumps([item.nodeid, round(own_and_waited_cpu_seconds() - start, 3), [started, time.time()]])
                    + "\n")
    return result


def beside(spans, test):
    """{file: seconds}: how long each file's tests ran while test ran (spans: {test id: [start, end]}; those of its own
    process ran before or after it), longest first: what shared the cores with it."""
    start, end = spans[test]
    overlap = collections.Counter()
    for other, (other_start, other_end) in spans.items():
        if other != test:
            overlap[other.split("::")[0]] += max(0.0, min(end, other_end) - max(start, other_start))
    return {path: seconds for path, seconds in overlap.most_common() if seconds > 0}


def machine():
    """e.g. "AMD EPYC (family 25, model 17), AVX-512, 2 cores, torch 2.13.0+cpu": which CPU the figures came from."""
    import torch
    flags = cpu_flags()
    vector = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    family, model = cpuinfo_field("cpu family"), cpuinfo_field("model")
    return (f"{cpuinfo_field('model name') or 'unknown CPU'} (family {family}, model {model}), {vector}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}")


def run_suite(pytest_args, log_path):
    """Run pytest with a JUnit report; return its figures: wall_s, exit_code, tests ({test id: seconds}), summary (its
    last output line), processes (that ran the tests: pytest-xdist's workers, else 1; None under -q, where xdist does
    not say), cpu_s (the run's and all its processes'), tests_cpu ({test id: CPU seconds}) and spans ({test id: [start,
    end]}, in seconds since the epoch)."""
    with tempfile.TemporaryDirectory() as tmp:
        report, cpu_log = os.path.join(tmp, "report.xml"), os.path.join(tmp, "cpu.jsonl")
        start, cpu_start = time.perf_counter(), cpu_seconds(resource.RUSAGE_CHILDREN)
        with open(log_path, "w") as log:
            code = subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "bench.bench_tests",
                                    f"--junitxml={report}", *pytest_args], cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, env=dict(os.environ, **{CPU_LOG_ENV: cpu_log}))
        wall, cpu = time.perf_counter() - start, cpu_seconds(resource.RUSAGE_CHILDREN) - cpu_start
        tests = {}  # junit's time is set-up + call + tear-down (pytest's junit_duration_report=total)
        if os.path.exists(report):
            for case in ElementTree.parse(report).getroot().iter("testcase"):
                path = case.get("classname").replace(".", "/") + ".py"
                tests[f"{path}::{case.get('name')}"] = float(case.get("time"))
        tests_cpu, spans = {}, {}
        if os.path.exists(cpu_log):
            with open(cpu_log) as f:
                for test, cpu_s, span in map(json.loads, f):
                    tests_cpu[test], spans[test] = cpu_s, span
    with open(log_path) as log:
        lines = [line.strip() for line in log if line.strip()]
    workers = [int(m.group(1)) for m in map(re.compile(r"created: (\d+)/\d+ workers").match, lines) if m]
    quiet = any(arg.startswith("-q") or arg == "--quiet" for arg in pytest_args)  # xdist then says nothing
    return dict(wall_s=round(wall, 1), exit_code=code, tests=tests, summary=lines[-1].strip("= ") if lines else "",
                processes=workers[0] if workers else None if quiet else 1, cpu_s=round(cpu, 1), tests_cpu=tests_cpu,
                spans=spans)


def by_file(tests):
    files = collections.defaultdict(list)
    for test, seconds in tests.items():
        files[test.split("::")[0]].append(seconds)
    return {path: (sum(times), len(times)) for path, times in files.items()}


def print_tables(result, before, slowest):
    before_files = by_file(before["tests"]) if before else {}
    cpu_files = by_file(result["tests_cpu"])
    column = lambda seconds: f"{seconds:9.1f}" if seconds is not None else "        -"  # noqa: E731
    print(f"\n{'file':40s} {'seconds':>9s} {'CPU s':>9s} {'tests':>6s}" + (f" {'before':>9s}" if before else ""))
    for path, (seconds, count) in sorted(by_file(result["tests"]).items(), key=lambda item: -item[1][0]):
        previous = before_files.get(path, (None,))[0]
        print(f"{path:40s} {seconds:9.1f} {column(cpu_files.get(path, (None,))[0])} {count:6d}"
              + (f" {column(previous)}" if before else ""))
    print(f"\nthe {slowest} slowest tests (set-up included), their CPU seconds" + (", and before" if before else ""))
    for test, seconds in sorted(result["tests"].items(), key=lambda item: -item[1])[:slowest]:
        mark = "  OVER 15 s" if seconds > LIMIT_S else ""
        print(f"{seconds:7.1f} {column(result['tests_cpu'].get(test))}"
              + (f" {column(before['tests'].get(test))}" if before else "") + f"  {test}{mark}")
        others = beside(result["spans"], test) if mark and test in result["spans"] else {}
        if others:  # why it took so long: what shared the cores with it
            print("                 beside it: " + ", ".join(f"{path} {overlap:.1f} s"
                                                        for path, overlap in list(others.items())[:3]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pytest_args", nargs="*", help="files and options for pytest (default: the whole suite)")
    parser.add_argument("--slowest", type=int, default=20, help="how many of the slowest tests to list (default 20)")
    parser.add_argument("--save", help="write the figures to this JSON file")
    parser.add_argument("--before", help="a JSON file saved by an earlier run: its figures in a column beside")
    parser.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "bench_tests.log"),
                        help="pytest's own output goes here (default: bench_tests.log in the temp folder)")
    args = parser.parse_args()
    try:
        before = json.load(open(args.before)) if args.before else None
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot read --before {args.before} ({e}); give a file that --save wrote")
    result = dict(machine=machine(), command=" ".join(["python -m pytest", *args.pytest_args]),
                  **run_suite(args.pytest_args, args.log))
    wall, cpu, processes = result["wall_s"], result["cpu_s"], result["processes"]
    side_by_side = {None: "processes not known under -q", 1: "one process"}.get(processes,
                                                                             f"{processes} processes side by side")
    print(f"{result['command']} ({side_by_side}): {wall:.1f} s wall ({wall / 60:.1f} min), exit {result['exit_code']}: "
          f"{result['summary']}")
    print(f"machine: {result['machine']}")
    print(f"CPU: {cpu:.0f} s, all its processes together ({cpu / wall:.2f} cores kept busy on average); "
          f"{sum(result['tests_cpu'].values()):.0f} s of it counted in the tests' processes and those they waited for")
    if before:
        print(f"before: {before['wall_s']:.1f} s wall ({before['wall_s'] / 60:.1f} min) on {before['machine']}")
    print_tables(result, before, args.slowest)
    over = [test for test, seconds in result["tests"].items() if seconds > LIMIT_S]
    print(f"\ntests over {LIMIT_S:.0f} s: {len(over)}; pytest's output: {args.log}")
    if args.save:
        with open(args.save + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.save + ".tmp", args.save)


if __name__ == "__main__":
    main()
