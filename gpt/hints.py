"""
What error messages suggest: the setting or file meant by a misspelt one, the command that makes a missing file (a
dataset's prepare script, the train.py run that writes a checkpoint), what to do with an out_dir that is taken. Imported
only when such an error is raised, so that the default run does not read them.
"""

import difflib
import glob
import os
import re
import shlex
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
DATA_ROOT = os.path.join(ROOT, "data")
# nanoGPT's names for what is called otherwise here: a nanoGPT habit gets the right hint, not the nearest spelling
NANOGPT_NAMES = {"start": "prompt", "decay_lr": "lr_schedule", "config/train_shakespeare_char.py": "config/small.py",
                 "config/train_gpt2.py": "config/gpt2_124m.py", "config/finetune_shakespeare.py": "config/small.py"}


def did_you_mean(word, options):
    """ " (did you mean 'x'?)" for the option a misspelt or nanoGPT-named word most likely meant, else "". """
    ours = NANOGPT_NAMES.get(word.removeprefix("./"))
    close = [ours] if ours in options else difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def config_file_hint(path):
    """did_you_mean for a config file that cannot be read, among config/*.py (the working directory's); a setting
    written without its dashes (max_iters=10), as the setting."""
    key, is_setting, value = path.partition("=")
    if is_setting and key.isidentifier():
        return f"; a setting takes two dashes: --{key}={value}"
    return did_you_mean(path, glob.glob("config/*.py"))


def bad_init_from(init_from):
    gpt2 = ("; GPT-2's own weights are another architecture (learned positions, LayerNorm, GELU), hf: loads a Llama or "
            "Qwen3 folder (docs/interop.md)") if init_from.startswith("gpt2") else ""
    return f"init_from must be scratch, resume or hf:path/to/folder, got {init_from!r}{gpt2}"


def config_file_error(path, error):
    """A config file's error as "path, line N: Kind: message": for an error raised while it ran, the innermost line of
    the file itself, even if the error came from something it called."""
    if isinstance(error, SyntaxError):
        return f"{path}, line {error.lineno}: SyntaxError: {error.msg}"
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == path]
    return f"{path}, line {lines[-1]}: {type(error).__name__}: {error}"


def prepare_script(name):
    path = os.path.join(DATA_ROOT, name, "prepare.py")
    return path if os.path.isfile(path) else None


def prepare_command(data_dir):
    """The command, run from the current directory, that writes the dataset folder data_dir, or None where there is no
    data/<name>/prepare.py. A script writes into its own folder by default; any other folder needs --out_dir."""
    script = prepare_script(os.path.basename(os.path.normpath(data_dir)))
    if script is None:
        return None
    if os.path.realpath(data_dir) != os.path.realpath(os.path.dirname(script)):
        return f"python {shlex.quote(script)} --out_dir {shlex.quote(str(data_dir))}"
    in_root = os.path.realpath(os.getcwd()) == os.path.realpath(os.path.dirname(DATA_ROOT))
    return f"python {os.path.relpath(script) if in_root else shlex.quote(script)}"


def rerun(data_dir):
    command = prepare_command(data_dir)
    return f"re-run `{command}`" if command else "re-run the prepare script that wrote it"


def missing_shards(data_dir):
    """What to do about a dataset folder without a split's shards: the command that writes them, if there is one."""
    command = prepare_command(data_dir)
    return f"prepare them with `{command}`" if command else ("write them with a prepare script's --out_dir "
                                                             "(data/README.md)")


def datasets_hint(data_dir):
    """For a missing dataset folder with no prepare script: the datasets there are, those prepared next to data_dir,
    and a command for one: the closest name first, then shakespeare_char and shakespeare (no hours of downloading)."""
    names = sorted(n for n in os.listdir(DATA_ROOT) if prepare_script(n))
    if not names:
        return f"there is no prepare script under {DATA_ROOT}"
    parent = os.path.dirname(os.path.normpath(data_dir))
    prepared = [n for n in names if glob.glob(os.path.join(parent, n, "*_train_*.bin"))]
    close = difflib.get_close_matches(os.path.basename(os.path.normpath(data_dir)), names, n=1)
    order = list(dict.fromkeys(close + [n for n in ("shakespeare_char", "shakespeare") if n in names] + names))
    ready = [n for n in order if n in prepared][:1]
    to_prepare = [n for n in order if n not in prepared][:1]
    hint = f"the datasets are {', '.join(names)} (data/<name>/prepare.py)"
    if prepared:
        hint += f", prepared already: {', '.join(prepared)}"
    todo = [f"pass --dataset={n}" for n in ready] + [
        f"prepare one, e.g. `{prepare_command(os.path.join(parent, n))}`, then pass --dataset={n}" for n in to_prepare]
    if close and close[0] not in prepared:  # the name meant, most likely: first
        todo.reverse()
    return f"{hint}; {', or '.join(todo)}"


def missing_dataset(data_dir):
    """What to do about a dataset folder that does not exist: run its data/<name>/prepare.py if there is one, else
    one of the datasets there are."""
    command = prepare_command(data_dir)
    return f"prepare it with `{command}`" if command else datasets_hint(data_dir)


def train_command(path, config=None, extra=""):
    """The train.py command, in backquotes, that writes the checkpoint asked for at path (for a .pt file not named
    ckpt.pt: the ckpt.pt it writes in that folder, to load instead). config: the config file to name (default: the
    one whose out_dir the folder is named after, else config/small.py); extra: more arguments."""
    out_dir = os.path.dirname(path) or "."
    config = config or config_for(out_dir)
    command = f"`python train.py {config} --out_dir={shlex.quote(out_dir)}{extra}`"
    if os.path.basename(path) != "ckpt.pt":
        command += f", which writes {os.path.join(out_dir, 'ckpt.pt')}: load that"
    return command


def folder_in_use(folder, holder):
    """Why a folder whose lock another process holds cannot be used: that process, whose pid is in its lock file."""
    with open(os.path.join(folder, "lock")) as f:
        pid = f.read().strip() or "unknown"  # "unknown": the holder has not written it yet
    return f"{folder} is in use by another {holder} (process {pid}); let it finish or stop it, or use another --out_dir"


def overwrite_refused(ckpt_path, init_from):
    return (f"{ckpt_path} holds an earlier run, which a run from {init_from} would replace; continue it with "
            "--init_from=resume, train into another --out_dir, or replace it with --overwrite")


def config_for(out_dir):
    """The config file (config/NAME.py) whose out_dir the folder is named after, else config/small.py: a missing
    out-shakespeare-bpe is trained by config/shakespeare_bpe.py, not by the character model's config."""
    for path in sorted(glob.glob(os.path.join(ROOT, "config", "*.py"))):
        with open(path, encoding="utf-8") as f:  # read, not run: a hint must not execute a config
            named = re.search(r"^out_dir\s*=\s*[\"']([^\"']+)[\"']", f.read(), re.M)
        if named and named.group(1) == os.path.basename(os.path.normpath(out_dir)):
            return f"config/{os.path.basename(path)}"
    return "config/small.py"
