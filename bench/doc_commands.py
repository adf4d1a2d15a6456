"""Every command in the docs, run as written: the lines of the ```sh and ```bash blocks of README.md, docs/*.md,
experiments/README.md and data/README.md, each classified, and those that can run here run with `bash -c`, in file
order, in a fresh clone of this repo. Prints where each command appears, its class, and for those run the exit
status, the seconds and the last lines of what it printed; then one summary line. Exits 1 if a command run failed.

    python bench/doc_commands.py --list               # classify every command, run nothing
    python bench/doc_commands.py                      # run the "runs" class (many minutes: it trains config/small.py)
    python bench/doc_commands.py --long               # and the "long" class: compare.py, the BPE run, the test suite
    python bench/doc_commands.py --only sample.py     # the commands containing "sample.py", and what they need
    python bench/doc_commands.py --keep               # keep the clone and print its path

Classes (RULES below; the first rule that matches wins): placeholder (a name the user fills in, or a step done by
hand), gpu, network, long (many minutes on 2 CPU cores), runs. A command that reads what another makes needs it
(NEEDS below): the needed command runs first, and one whose need cannot run here is reported "needs <command>" and
not run. A command written in several places runs once. The clone holds the committed tree (HEAD) with this repo's
.venv linked in, so nothing is written inside this repo; it is removed at the end unless --keep.
"""

import argparse
import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^\s*```(sh|bash)\s*$")  # the blocks a reader copies into a shell; ```python and plain ``` are not
HAND_STEP = re.compile(r"^#.*\bedit\b")  # a comment line that is a step (an edit to make by hand); others are skipped

# (class, pattern, why), tried in order. A pattern with a group named "file" matches only when that file is not in
# the repo: FILE:prompt.txt is a placeholder because the docs never make prompt.txt.
RULES = [
    ("placeholder", r"^#", "a step done by hand"),
    ("placeholder", r"\bFILE\b(?!:)|path/to/|\bHOST:|my_tasks/|my_corpus", "a name to fill in"),
    ("placeholder", r"FILE:(?P<file>\S+)", "a file of your own"),
    ("gpu", r"--nproc_per_node=8|config/gpt2_124m\.py", "8 GPUs or the 124M model"),
    ("gpu", r"bench/gpu_check\.py(?!.*--tiny)", "the GPU acceptance run"),
    ("network", r"\bpip install\b", "downloads packages"),
    ("network", r"data/fineweb/prepare\.py(?!.*--data_files)", "streams FineWeb from the hub"),
    ("network", r"--(?:eval_)?tasks=\S*\b(?:hellaswag|arc_\w+|lambada\w*|piqa)\b", "lm-eval tasks from the hub"),
    ("long", r"\bcompare\.py\b", "trains several runs"),
    ("long", r"config/shakespeare_bpe\.py", "trains the BPE model (~6 min)"),
    ("long", r"-m pytest\b", "the test suite (10-15 min)"),
]
RUNS = "runs"

# (pattern, made by): a command matching the pattern reads what the first other command matching "made by" writes.
# A command that matches "made by" itself makes what it needs (train.py config/small_draft.py && sample.py --draft=...).
NEEDS = [
    (r"config/small(_draft)?\.py", r"data/shakespeare_char/prepare\.py"),  # the character shards
    (r"config/shakespeare_bpe\.py", r"data/shakespeare/prepare\.py"),  # the BPE shards
    # out-small: named, or the default out_dir of sample.py, attention.py and eval.py, or resumed
    (r"out-small|(^|&& )python (sample|attention|eval)\.py(?!.*--(out_dir|init_from))|--init_from=resume",
     r"^python train\.py config/small\.py$"),
    (r"--draft=out-draft", r"train\.py config/small_draft\.py"),
    (r"out-shakespeare-bpe", r"train\.py config/shakespeare_bpe\.py"),
    (r"hf:hf-small", r"export\.py .*--to hf-small"),
]


class Command:
    def __init__(self, text):
        self.text = text  # what bash runs; for a step done by hand, the comment line itself
        self.places = []  # (file:line, the line's trailing comment or "")
        self.kind, self.why = classify(text)
        self.needs = []  # Commands that must have run first
        self.missing = []  # NEEDS patterns no doc command makes
        self.result = None  # (exit status or "timeout", seconds, output) once run
        self.skip = ""  # or why it did not run: its class, or "needs"


def doc_files():
    """The Markdown files whose command blocks are read, in report order."""
    names = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT)), "experiments/README.md", "data/README.md"]
    return [name for name in names if os.path.exists(os.path.join(ROOT, name))]


def block_lines(name):
    """(line number, line) for each non-blank line inside a ```sh or ```bash block of one file."""
    inside = False
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if inside and line.strip().startswith("```"):
                inside = False
            elif inside and line.strip():
                yield number, line.strip()
            elif FENCE.match(line):
                inside = True


def split_comment(line):
    """(command, comment): a `#` after whitespace and outside quotes starts the comment, as bash reads it."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i:]
    return line, ""


def classify(text):
    """(class, why) by the first rule of RULES that matches."""
    for kind, pattern, why in RULES:
        match = re.search(pattern, text)
        if match and "file" in match.groupdict() and os.path.exists(os.path.join(ROOT, match["file"])):
            continue  # the file it names ships with the repo: not a placeholder
        if match:
            return kind, f"{why}: {match[0]}"
    return RUNS, ""


def extract():
    """Every distinct command of the docs, in order of first appearance, with every place it appears."""
    commands = {}
    for name in doc_files():
        for number, line in block_lines(name):
            text, comment = split_comment(line)
            if not text and not HAND_STEP.match(comment):
                continue  # a comment line that is no step
            if not text:
                text, comment = comment, ""
            commands.setdefault(text, Command(text)).places.append((f"{name}:{number}", comment))
    return list(commands.values())


def link_needs(commands):
    """Fill each command's needs from NEEDS: the first other command that makes what it reads, preferring one that can
    run here (runs or long) to one that needs the network or a GPU."""
    for command in commands:
        for pattern, made_by in NEEDS:
            if not re.search(pattern, command.text) or re.search(made_by, command.text):
                continue
            makers = [c for c in commands if c is not command and re.search(made_by, c.text)]
            maker = next((c for c in makers if c.kind in (RUNS, "long")), makers[0] if makers else None)
            if maker is None:
                command.missing.append(made_by)
            elif maker not in command.needs:
                command.needs.append(maker)


def select(commands, only):
    """The commands containing `only`, and everything they need, transitively; all when `only` is None."""
    if only is None:
        return list(commands)
    chosen = []
    todo = [c for c in commands if only in c.text]
    while todo:
        command = todo.pop()
        if command not in chosen:
            chosen.append(command)
            todo.extend(command.needs)
    return [c for c in commands if c in chosen]  # back in file order


def make_clone(tmp):
    """A fresh clone of this repo in tmp, with this repo's .venv linked in and the Shakespeare text present."""
    clone = os.path.join(tmp, "repo")
    subprocess.run(["git", "clone", "--quiet", ROOT, clone], check=True)
    os.symlink(os.path.join(ROOT, ".venv"), os.path.join(clone, ".venv"))
    text = os.path.join("data", "shakespeare", "input.txt")
    if not os.path.exists(os.path.join(clone, text)):  # the prepare scripts read it; a trimmed repo's clone may lack it
        shutil.copy(os.path.join(ROOT, text), os.path.join(clone, text))
    return clone


def execute(text, clone, timeout):
    """(exit status or "timeout", seconds, stdout+stderr) of `bash -c text` in the clone, the venv first on PATH."""
    venv = os.path.join(clone, ".venv")
    env = dict(os.environ, VIRTUAL_ENV=venv, PATH=os.path.join(venv, "bin") + os.pathsep + os.environ["PATH"])
    start = time.monotonic()
    # a session of its own, so that a timeout or Ctrl-C ends the whole group (torchrun's workers, compile workers)
    proc = subprocess.Popen(["bash", "-c", text], cwd=clone, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    try:
        output, status = proc.communicate(timeout=timeout)[0], proc.returncode
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as stop:
        with contextlib.suppress(ProcessLookupError):  # it may have ended on its own meanwhile
            os.killpg(proc.pid, signal.SIGKILL)
        output, status = proc.communicate()[0], "timeout"
        if isinstance(stop, KeyboardInterrupt):
            raise
    return status, time.monotonic() - start, output


def runnable(command, long):
    return command.kind == RUNS or (command.kind == "long" and long)


def succeeded(command):
    return command.result is not None and command.result[0] == 0


def run(command, clone, args):
    """Run a command once, after what it needs; or set why it did not run (its class, or "needs")."""
    if command.result or command.skip:
        return
    for need in command.needs:
        run(need, clone, args)
    if not runnable(command, args.long):
        command.skip = command.kind
    elif command.missing or not all(succeeded(need) for need in command.needs):
        command.skip = "needs"
    else:
        command.result = execute(command.text, clone, args.timeout)
        report(command, args)  # as it finishes: a run of many minutes shows its progress


def last_lines(output, count=3):
    """The last non-blank lines as a terminal shows them: of a line redrawn with \\r, its last drawing."""
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in output.split("\n")]
    return [line for line in lines if line.strip()][-count:]


def need_text(need, long):
    where = f"needs `{need.text}` ({need.places[0][0]})"
    if need.result is not None and not succeeded(need):
        return f"{where}, which failed"
    return f"{where}, {need.kind}" if not runnable(need, long) else where


def report(command, args):
    """Print one command: where it appears, its class, and what happened when it ran."""
    print(f"$ {command.text}")
    for place, comment in command.places:
        print(f"    {place}" + (f"  {comment}" if comment else ""))
    print(f"  class: {command.kind}" + (f" ({command.why})" if command.why else ""))
    for made_by in command.missing:
        print(f"  needs a command matching {made_by!r}: none in the docs")
    for need in command.needs:
        if args.list or (command.skip == "needs" and not succeeded(need)):
            print(f"  {need_text(need, args.long)}")
    if command.result is not None:
        status, seconds, output = command.result
        print(f"  exit {status}, {seconds:.1f} s")
        for line in last_lines(output):
            print(f"    | {line}")
    elif command.skip == "long":
        print("  not run (--long runs it)")
    elif command.skip:
        print("  not run")
    print(flush=True)


def summary(commands, chosen):
    """One line: how many ran, failed, and were not run by why."""
    ran = [c for c in chosen if c.result is not None]
    skipped = {}
    for command in chosen:
        if command.skip:
            skipped[command.skip] = skipped.get(command.skip, 0) + 1
    parts = [f"{why} {n}" for why, n in skipped.items()]
    if len(chosen) < len(commands):
        parts.append(f"not selected {len(commands) - len(chosen)}")
    failed = len([c for c in ran if not succeeded(c)])
    return f"ran {len(ran)}, failed {failed}; not run: " + (", ".join(parts) or "none")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="run the long class too (compare.py, BPE training, tests)")
    parser.add_argument("--only", metavar="SUBSTRING", help="run only the commands containing it, and what they need")
    parser.add_argument("--list", action="store_true", help="classify and print every command, run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the temporary clone and print its path")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per command (default 900)")
    args = parser.parse_args()

    commands = extract()
    link_needs(commands)
    chosen = select(commands, args.only)
    if not chosen:
        sys.exit(f"error: no doc command contains {args.only!r}")
    if args.list:
        for command in chosen:
            report(command, args)
        kinds = {}
        for command in chosen:
            kinds[command.kind] = kinds.get(command.kind, 0) + 1
        print(f"{len(chosen)} commands: " + ", ".join(f"{kind} {n}" for kind, n in kinds.items()))
        return

    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                             capture_output=True, text=True).stdout
    if changed:
        print("note: the clone holds HEAD; uncommitted changes are not in it\n")
    tmp, clone = tempfile.mkdtemp(prefix="doc_commands-"), None
    try:
        clone = make_clone(tmp)
        for command in chosen:
            run(command, clone, args)
            if command.skip:
                report(command, args)  # those that ran were reported as they finished
    except KeyboardInterrupt:
        print("interrupted")
        sys.exit(130)
    finally:
        if args.keep:
            print(f"kept: {clone or tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(summary(commands, chosen))
    sys.exit(1 if any(c.result is not None and not succeeded(c) for c in chosen) else 0)


if __name__ == "__main__":
    main()
