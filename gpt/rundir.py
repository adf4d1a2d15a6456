"""
The out_dir of a training run, as train.py's rank 0 holds it: a lock, so one run at a time writes there; metrics.jsonl
(also sent to wandb if asked); ckpt.pt, written with Ctrl-C held off. A failed write (a full disk, a quota) stops the
run with a message naming the checkpoint that is still intact.
"""

import contextlib
import json
import math
import os
import signal
import time

from gpt import UserError
from gpt.checkpoint import save_checkpoint
from gpt.files import FolderInUse, atomic_open, lock_folder, read_jsonl, write_failure
from model import GPTConfig


class RunDir:
    """A run's out_dir, locked from construction to close()."""

    def __init__(self, settings):
        self.out_dir = settings["out_dir"]
        self.ckpt_path = os.path.join(self.out_dir, "ckpt.pt")
        self.log_path = os.path.join(self.out_dir, "metrics.jsonl")
        self.saved_iter = None  # the iteration of the checkpoint on disk, once this run resumed or saved one
        self.wandb, self.created = None, not os.path.isdir(self.out_dir)
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            self.lock = lock_folder(self.out_dir)  # before anything in out_dir is read or written
        except FolderInUse as e:
            raise UserError(f"{self.out_dir} is in use by another training run (process {e.pid}); let it finish "
                            "or stop it, or use another --out_dir") from None
        except OSError as e:
            raise UserError(f"cannot use out_dir {self.out_dir} ({write_failure(e)})") from None
        if settings["init_from"] != "resume" and os.path.exists(self.ckpt_path) and not settings["overwrite"]:
            self.close()
            raise UserError(f"{self.ckpt_path} holds an earlier run, which a run from {settings['init_from']} would "
                            "replace; continue it with --init_from=resume, train into another --out_dir, or replace "
                            "it with --overwrite")

    def start(self, settings, resumed_iter):
        """A resumed run continues the log from its checkpoint (of iteration resumed_iter); any other starts afresh,
        removing what an earlier run left (the constructor refused a checkpoint there unless overwrite=True)."""
        wandb = import_wandb() if settings["wandb_log"] else None  # before anything is removed
        if resumed_iter is not None:
            self.saved_iter = resumed_iter
            self.keep_records_until(resumed_iter)
        else:
            if os.path.exists(self.ckpt_path):
                print(f"overwrite: removing the earlier run's {self.ckpt_path} and {self.log_path}")
            for path in (self.ckpt_path, self.log_path):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        if wandb:
            self.wandb = wandb
            wandb.init(project=settings["wandb_project"], name=settings["wandb_run_name"], config=settings,
                       dir=self.out_dir)

    def keep_records_until(self, start_iter):
        """Keep the records up to start_iter (this run makes the later ones again), dropping a torn last line."""
        if not os.path.exists(self.log_path):
            return
        try:
            records, torn = read_jsonl(self.log_path)
        except ValueError as e:
            raise UserError(f"{e}; repair or delete that line, then resume again") from None
        if torn is not None:
            print(f"{self.log_path}: dropped its torn last line ({torn.strip()[:40]!r}), left by a run that "
                  "stopped while writing it")
        for lineno, record in records:
            if not isinstance(record, dict) or not isinstance(record.get("iter"), int):
                raise UserError(f"{self.log_path}, line {lineno}: not a metrics record (no iter); repair or delete "
                                "that line, then resume again")
        try:
            with atomic_open(self.log_path, "w") as f:
                f.writelines(json.dumps(record) + "\n" for _, record in records if record["iter"] <= start_iter)
        except OSError as e:
            raise self.write_failed(self.log_path, e) from None

    def log(self, record):
        try:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise self.write_failed(self.log_path, e) from None
        if self.wandb:
            self.wandb.log(record, step=record["iter"])

    def save(self, checkpoint):
        """Write ckpt.pt atomically, with SIGINT and SIGTERM held until it is on disk: a stop never cuts it short."""
        with signals_deferred():
            try:
                save_checkpoint(self.ckpt_path, checkpoint)
            except UserError as e:
                raise UserError(f"{e}; {self.intact()}") from None
        self.saved_iter = checkpoint["iter_num"]

    def intact(self):
        if self.saved_iter is None:
            return "this run has saved no checkpoint yet"
        return (f"{self.ckpt_path} still holds the checkpoint of iter {self.saved_iter}: continue from it with "
                "--init_from=resume")

    def write_failed(self, path, error):
        return UserError(f"could not write {path} ({write_failure(error)}); {self.intact()}")

    def close(self):
        if self.wandb:
            self.wandb.finish()
        self.lock.close()  # releases the lock
        if self.created and os.listdir(self.out_dir) == ["lock"]:  # a run that failed before writing anything
            with contextlib.suppress(OSError):  # leaves no folder holding only its lock
                os.remove(os.path.join(self.out_dir, "lock"))
                os.rmdir(self.out_dir)


def import_wandb():
    try:
        import wandb  # only needed when asked for
    except ImportError:
        raise UserError("wandb_log=True needs wandb, which is not installed: pip install wandb "
                        "(or drop --wandb_log)") from None
    return wandb


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM that arrive inside the block are delivered at its end, a second Ctrl-C included."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


# Settings a resume may change without changing the run, left out of its "settings changed" line: init_from and
# overwrite are about how it starts, out_dir is where the checkpoint lies now (a moved run), threads fits the machine.
RESUME_NOISE = ("init_from", "overwrite", "out_dir", "threads")
FROM_CHECKPOINT = set(GPTConfig.__dataclass_fields__) - {"block_size"}  # a resume takes the model's config from it


def resume_report(checkpoint, settings, defaults, lr_multiplier):
    """The lines rank 0 prints on resuming: the checkpoint's iteration, best val loss and save time, then one line of
    the settings that differ from its run, if any, with the learning rate's jump where the schedule (lr_multiplier)
    moved it. A setting the checkpoint predates counts as its default (what that code did)."""
    it, best = checkpoint["iter_num"], checkpoint["best_val_loss"]
    about = [f"best val loss {best:.4f}" if math.isfinite(best) else "no val loss yet"]
    if checkpoint.get("saved_at") is not None:  # checkpoints before it was saved have none
        about.append(f"saved at {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(checkpoint['saved_at']))}")
    lines = [f"resumed from iteration {it} of {settings['max_iters']} ({', '.join(about)})"]
    before = dict(defaults, **checkpoint["settings"])
    show = lambda value: repr(value) if value == "" else str(value)  # as typed on a command line
    changed = {key: f"{key} {show(before[key])} -> {show(value)}" for key, value in settings.items()
               if key not in RESUME_NOISE and before[key] != value}
    if not changed:
        return lines
    used = [change for key, change in changed.items() if key not in FROM_CHECKPOINT]
    unused = [change for key, change in changed.items() if key in FROM_CHECKPOINT]
    parts = [", ".join(used)] if used else []
    if unused:
        parts.append(f"with no effect (the model is the checkpoint's): {', '.join(unused)}")
    line = f"settings changed since the checkpoint: {'; '.join(parts)}"
    try:
        lr_before = before["learning_rate"] * lr_multiplier(it, before)
        lr_now = settings["learning_rate"] * lr_multiplier(it, settings)
        if not math.isclose(lr_before, lr_now, rel_tol=1e-6):
            line += f"; the learning rate at iteration {it} goes from {lr_before:.2e} to {lr_now:.2e}"
    except (ZeroDivisionError, TypeError):  # a learning rate of 0, or a schedule setting of the wrong type
        pass
    return lines + [line]
