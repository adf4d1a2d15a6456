"""Files a run cannot afford to lose, never left half-written by a crash or a full disk (atomic_open: checkpoints,
shards, metadata, plots) nor mixed up by a second process (lock_folder: train.py's and compare.py's out_dir)."""

import contextlib
import json
import os

from gpt import UserError

try:
    import fcntl  # POSIX; Windows has no flock, and there lock_folder locks nothing
except ImportError:
    fcntl = None


@contextlib.contextmanager
def atomic_open(path, mode="wb"):
    """A temp file next to `path`, moved there once the block succeeded and the data is on disk: a crash, kill or full
    disk leaves the old file (or none), never a torn one (a SIGKILL may leave the temp; the next write replaces it)."""
    tmp = f"{path}.tmp"  # same folder, so os.replace is atomic
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path, obj, **dump_args):
    """obj as JSON, written through atomic_open (dump_args: json.dumps's); a failed write is a UserError."""
    try:
        with atomic_open(path) as f:
            f.write(json.dumps(obj, **dump_args).encode())
    except OSError as e:
        raise UserError(f"cannot write {path} ({write_failure(e)})") from None


def write_failure(error):
    """Why a write failed, in a few words ("No space left on device", "File too large", ...). torch.save
    reports a failed write as a RuntimeError ("unexpected pos ...") raised while handling the OSError."""
    cause = error if isinstance(error, OSError) else error.__context__
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return (str(error) or type(error).__name__).splitlines()[0]


def lock_folder(folder, holder):
    """folder (made if missing) locked: an exclusive lock on folder/lock, held until the returned file is closed or
    the process ends (the OS releases it even after a kill, so a stale lock file never blocks). Held by another
    process (a holder: "training run"), or a folder that cannot be written: a UserError that says so."""
    try:
        os.makedirs(folder, exist_ok=True)
        f = open(os.path.join(folder, "lock"), "a+")  # "a+": opening does not erase the holder's pid
    except OSError as e:
        raise UserError(f"cannot use out_dir {folder} ({write_failure(e)})") from None
    try:
        if fcntl:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "unknown"  # "unknown": the holder has not written it yet
        f.close()
        raise UserError(f"{folder} is in use by another {holder} (process {pid}); let it finish or stop it, or use "
                        "another --out_dir") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f
