"""The out_dir of a training run, as train.py's rank 0 holds it: a lock, from RunDir() to close(), so one run at a time
writes there; metrics.jsonl (also sent to wandb if asked); ckpt.pt, written to a temp file and renamed, so the last
checkpoint stays whole whatever stops a write (a full disk, a second Ctrl-C). A failed write stops the run in one line."""

import contextlib
import json
import os

import torch

from gpt import UserError
from gpt.files import FolderInUse, atomic_open, lock_folder, write_failure


class RunDir:
    def __init__(self, settings):
        self.out_dir = settings["out_dir"]
        self.ckpt_path = os.path.join(self.out_dir, "ckpt.pt")
        self.log_path = os.path.join(self.out_dir, "metrics.jsonl")
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
        if settings["wandb_log"]:  # imported before anything is removed
            try:
                import wandb
            except ImportError:
                raise UserError("wandb_log=True needs wandb, which is not installed: pip install wandb "
                                "(or drop --wandb_log)") from None
        if resumed_iter is not None:
            from gpt.resume import keep_records_until
            try:
                keep_records_until(self.log_path, resumed_iter)
            except OSError as e:
                raise write_failed(self.log_path, e) from None
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
        try:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise write_failed(self.log_path, e) from None
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


def write_failed(path, error):
    """The UserError of a failed write in out_dir: the OS's reason, and the way on (ckpt.pt was never cut short)."""
    return UserError(f"could not write {path} ({write_failure(error)}); the last checkpoint this run saved, if any, is "
                     "whole: free some space and continue from it with --init_from=resume")


def save_checkpoint(path, checkpoint):
    """torch.save through atomic_open: the checkpoint saved before stays until this one is whole."""
    try:
        with atomic_open(path) as f:  # a file object, not a path: torch then keeps the OSError of a failed write
            torch.save(checkpoint, f)
    except Exception as e:  # OSError, or torch's RuntimeError around one, or an object that cannot be saved
        raise write_failed(path, e) from None
