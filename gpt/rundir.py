"""The out_dir of a training run, as train.py's rank 0 holds it: a lock from RunDir() to close(), so one run at a time
writes there; metrics.jsonl (also sent to wandb if asked); ckpt.pt through atomic_open, so the last checkpoint stays
whole whatever stops a write (a full disk, a second Ctrl-C). A failed write stops the run in one line."""

import contextlib
import json
import os

import torch

from gpt import UserError
from gpt.files import atomic_open, lock_folder, write_failure


class RunDir:
    def __init__(self, settings):
        self.out_dir, self.wandb, self.created = settings["out_dir"], None, not os.path.isdir(settings["out_dir"])
        self.ckpt_path, self.log_path = (os.path.join(self.out_dir, name) for name in ("ckpt.pt", "metrics.jsonl"))
        self.lock = lock_folder(self.out_dir, "training run")  # before anything in out_dir is read or written
        if settings["init_from"] != "resume" and os.path.exists(self.ckpt_path) and not settings["overwrite"]:
            self.close()
            raise UserError(f"{self.ckpt_path} holds an earlier run, which a run from {settings['init_from']} would "
                            "replace; continue it with --init_from=resume, train into another --out_dir, or replace "
                            "it with --overwrite")

    def start(self, settings, resumed_iter):
        """A resumed run continues the log from its checkpoint (of iteration resumed_iter); any other starts afresh,
        removing what an earlier run left (the constructor refused a checkpoint there unless overwrite=True)."""
        if settings["wandb_log"]:  # imported before anything is removed
            try:
                import wandb
            except ImportError:
                raise UserError("wandb_log=True needs wandb, which is not installed: pip install wandb "
                                "(or drop --wandb_log)") from None
        if resumed_iter is not None:
            from gpt.resume import keep_records_until
            with failing_write(self.log_path):
                keep_records_until(self.log_path, resumed_iter)
        else:
            if os.path.exists(self.ckpt_path):
                print(f"overwrite: removing the earlier run's {self.ckpt_path} and {self.log_path}")
            for path in (self.ckpt_path, self.log_path):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        if settings["wandb_log"]:
            self.wandb = wandb
            wandb.init(project=settings["wandb_project"], name=settings["wandb_run_name"], config=settings,
                       dir=self.out_dir)

    def log(self, record):
        with failing_write(self.log_path), open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb:
            self.wandb.log(record, step=record["iter"])

    def save(self, checkpoint):
        save_checkpoint(self.ckpt_path, checkpoint)

    def close(self):
        if self.wandb:
            self.wandb.finish()
        self.lock.close()  # releases the lock
        if self.created and os.listdir(self.out_dir) == ["lock"]:  # a run that failed before writing anything
            with contextlib.suppress(OSError):  # leaves no folder holding only its lock
                os.remove(os.path.join(self.out_dir, "lock"))
                os.rmdir(self.out_dir)


@contextlib.contextmanager
def failing_write(path):
    """A failed write of path in out_dir as one line: the OS's reason, and the way on (ckpt.pt is never cut short)."""
    try:
        yield
    except UserError:  # said already (keep_records_until's torn log)
        raise
    except Exception as e:  # OSError, or torch's RuntimeError around one, or an object that cannot be saved
        raise UserError(f"could not write {path} ({write_failure(e)}); the last checkpoint this run saved, if any, is "
                        "whole: free some space and continue from it with --init_from=resume") from None


def save_checkpoint(path, checkpoint):
    """torch.save through atomic_open: the checkpoint saved before stays until this one is whole."""
    with failing_write(path), atomic_open(path) as f:  # a file object: torch then keeps a failed write's OSError
        torch.save(checkpoint, f)
