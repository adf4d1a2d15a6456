"""
How much of this repo a newcomer reads to train and to sample: run `python train.py config/small.py` (a few
iterations) and a default `python sample.py` for real, and at exit count the lines (as `wc -l` counts them) of every
repo file in sys.modules plus the script itself. Prints one row per command and the files behind it.

    python bench/bench_lines.py            # trains into a temporary out_dir, then samples from it
"""

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run inside the command's own process: at exit, the repo files it imported, with their line counts.
COUNTER = """
import atexit, os, runpy, sys
root, script = sys.argv[1], sys.argv[2]
def count():
    files = {os.path.abspath(script)}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and os.path.isabs(path) and path.startswith(root + os.sep) and os.sep + ".venv" + os.sep not in path:
            files.add(os.path.abspath(path))
    with open(os.environ["LINES_OUT"], "w") as out:
        for path in sorted(files):
            with open(path, "rb") as f:
                out.write(f"{f.read().count(bytes([10]))} {os.path.relpath(path, root)}\\n")
atexit.register(count)
sys.argv = sys.argv[2:]
sys.path.insert(0, root)
runpy.run_path(script, run_name="__main__")
"""


def imported_lines(argv, out_file):
    """[(lines, path)] of the repo files that `python argv...` imports, run for real from the repo root."""
    env = dict(os.environ, LINES_OUT=out_file)
    subprocess.run([sys.executable, "-c", COUNTER, ROOT, *argv], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    with open(out_file) as f:
        return [(int(n), path) for n, path in (line.split(" ", 1) for line in f.read().splitlines())]


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = os.path.join(tmp, "out-small")
        runs = {"train": ["train.py", "config/small.py", f"--out_dir={out_dir}", "--max_iters=20",
                          "--eval_interval=10", "--eval_iters=2"],
                "sample": ["sample.py", f"--out_dir={out_dir}", "--prompt=ROMEO:", "--max_new_tokens=20"]}
        for name, argv in runs.items():
            counted = imported_lines(argv, os.path.join(tmp, f"{name}.txt"))
            print(f"{name}: {len(counted)} files, {sum(n for n, _ in counted):,} lines")
            for n, path in counted:
                print(f"  {n:5d} {path}")


if __name__ == "__main__":
    main()
