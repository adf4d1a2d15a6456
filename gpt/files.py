"""Files a run cannot afford to lose: written whole or not at all (atomic_open), a failed write one line with the
OS's reason (failing_write), one writer at a time in a folder (lock_folder); RunDir: train.py's out_dir, rank 0's."""

import contextlib
import json
import os

from gpt import UserError

RESUME = "; the last checkpoint saved, if any, is whole: free some space and continue from it with --init_from=resume"


@contextlib.contextmanager
def atomic_open(path, mode="wb"):
    """A temp file beside path (so os.replace is atomic), moved there once the block succeeded and the data is on disk:
    a crash, kill or full disk leaves the old file (or none), never a torn one."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a SIGKILL's temp is left: the next write replaces it
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def failing_write(path, way_on=""):
    """A failed write of path as one line with the OS's reason ("No space left on device"), also where torch.save
    raised a RuntimeError ("unexpected pos ...") while handling the OSError; else the error's first line."""
    try:
        yield
    except Exception as e:
        reason = getattr(e if isinstance(e, OSError) else e.__context__, "strerror", None)
        reason = reason or (str(e) or type(e).__name__).splitlines()[0]
        raise UserError(f"could not write {path} ({reason}){way_on}") from None


def write_json(path, obj, **dump_args):
    text = json.dumps(obj, **dump_args)  # first: an object JSON cannot hold is a bug, not a failed write
    with failing_write(path), atomic_open(path) as f:
        f.write(text.encode())


def lock_folder(folder, holder):
    """folder (made if missing) under an exclusive flock on folder/lock, which holds this process's pid, until the
    returned file is closed or the process ends: the OS releases a killed holder's lock, so no stale lock blocks."""
    try:
        os.makedirs(folder, exist_ok=True)
        f = open(os.path.join(folder, "lock"), "a+")  # "a+": opening does not erase the holder's pid
        with contextlib.suppress(ImportError):  # POSIX only: Windows has no fcntl, and there nothing is locked
            import fcntl
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        from gpt.hints import folder_in_use  # imported only on the error, as every hint
        raise UserError(folder_in_use(folder, holder)) from None
    except OSError as e:
        raise UserError(f"cannot use out_dir {folder} ({e.strerror})") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


class RunDir:
    """out_dir, locked from RunDir() to close(): refused where it holds a run that this one would replace (unless
    overwrite); then its metrics.jsonl (sent to wandb too if asked) and ckpt.pt."""

    def __init__(self, settings):
        self.out_dir, self.created, self.wandb = settings["out_dir"], not os.path.isdir(settings["out_dir"]), None
        self.ckpt_path, self.log_path = (os.path.join(self.out_dir, name) for name in ("ckpt.pt", "metrics.jsonl"))
        self.lock = lock_folder(self.out_dir, "training run")  # before anything in out_dir is read or written
        if settings["init_from"] != "resume" and os.path.exists(self.ckpt_path) and not settings["overwrite"]:
            self.close()
            from gpt.hints import overwrite_refused
            raise UserError(overwrite_refused(self.ckpt_path, settings["init_from"]))

    def start(self, settings, resumed):  # once the run is set up: a resumed run's log goes on (gpt/resume.py)
        if settings["wandb_log"]:  # imported before anything is removed
            try:
                import wandb
            except ImportError:
                raise UserError("wandb_log=True needs wandb, which is not installed: pip install wandb") from None
            self.wandb = wandb
        if not resumed:  # the earlier run's files go
            for path in (self.ckpt_path, self.log_path):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                    print(f"overwrite: removed the earlier run's {path}")
        if self.wandb:
            self.wandb.init(project=settings["wandb_project"], name=settings["wandb_run_name"], config=settings,
                            dir=self.out_dir)

    def log(self, record):
        with failing_write(self.log_path, RESUME), open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb:
            self.wandb.log(record, step=record["iter"])

    def save(self, checkpoint):
        import torch  # here, not at the top: plot.py and the prepare scripts write files without torch

        with failing_write(self.ckpt_path, RESUME), atomic_open(self.ckpt_path) as f:  # a file object: torch then
            torch.save(checkpoint, f)  # keeps a failed write's OSError as the context of its RuntimeError

    def close(self):
        if self.wandb:
            self.wandb.finish()
        self.lock.close()  # releases the lock
        if self.created and os.listdir(self.out_dir) == ["lock"]:  # a run that failed before writing anything
            with contextlib.suppress(OSError):  # leaves no folder holding only its lock
                os.remove(os.path.join(self.out_dir, "lock"))
                os.rmdir(self.out_dir)
