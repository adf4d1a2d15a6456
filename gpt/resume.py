"""
Continuing a run from its checkpoint (init_from="resume"), imported by train.py only then: the checkpoint read (under
torchrun by rank 0, sent to the others), the optimizers', data loader's and loss scale's state restored, the lines
printed about it, and metrics.jsonl cut back to the checkpoint's iteration.
"""

import json
import math
import os
import time

from gpt import UserError
from gpt.checkpoint import load_checkpoint
from gpt.files import RESUME, atomic_open, failing_write
from gpt.metrics import read_jsonl
from model import GPTConfig


def resume_checkpoint(path, world_size, device, max_iters):
    """out_dir/ckpt.pt, with iterations left before max_iters; under torchrun read by rank 0 and sent to the others."""
    if world_size == 1:
        checkpoint = load_checkpoint(path)
    else:
        from gpt.parallel import checkpoint_from_rank0

        checkpoint = checkpoint_from_rank0(path, device)
    if checkpoint["iter_num"] >= max_iters:
        raise UserError(f"{path} is at iteration {checkpoint['iter_num']} already, so max_iters={max_iters} leaves "
                        f"nothing to train; pass a larger --max_iters to continue it")
    return checkpoint


def restore(checkpoint, optimizer, model, optimizers, loader, scaler):
    """(iter_num, best_val_loss, elapsed) of the checkpoint, its optimizer, data and loss-scale state loaded (the run
    continues at the loss scale its skipped steps lowered, not at a fresh 65536); its tensors, now a second copy of
    the model and optimizer state, are dropped from it."""
    if checkpoint["settings"]["optimizer"] != optimizer:
        raise UserError(f"the checkpoint was trained with optimizer={checkpoint['settings']['optimizer']}; "
                        f"resume with that optimizer")
    from gpt.parallel import load_optimizer_states

    load_optimizer_states(model, optimizers, checkpoint["optimizers"])
    loader.load_state_dict(checkpoint["loader"])
    if checkpoint.get("scaler"):  # {}: a run without a scaler
        scaler.load_state_dict(checkpoint["scaler"])
    del checkpoint["model"], checkpoint["optimizers"]
    return checkpoint["iter_num"], checkpoint["best_val_loss"], checkpoint["elapsed"]


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
    if global_batch_tokens(before) == global_batch_tokens(settings):  # the same batch, split over other processes
        for key in ("batch_size", "total_batch_size", "gradient_accumulation_steps"):  # (gpt/parallel.py)
            changed.pop(key, None)
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


def global_batch_tokens(settings):
    """Tokens per optimizer step over all processes, from settings as a run saves them (split over its processes)."""
    return settings["total_batch_size"] or settings["batch_size"] * settings["block_size"] * settings[
        "gradient_accumulation_steps"]


def keep_records_until(log_path, start_iter):
    """Keep the records up to start_iter (this run makes the later ones again), dropping a torn last line."""
    if not os.path.exists(log_path):
        return
    try:
        records, torn = read_jsonl(log_path)
    except ValueError as e:
        raise UserError(f"{e}; repair or delete that line, then resume again") from None
    if torn is not None:
        print(f"{log_path}: dropped its torn last line ({torn.strip()[:40]!r}), left by a run that "
              "stopped while writing it")
    for lineno, record in records:
        if not isinstance(record, dict) or not isinstance(record.get("iter"), int):
            raise UserError(f"{log_path}, line {lineno}: not a metrics record (no iter); repair or delete "
                            "that line, then resume again")
    with failing_write(log_path, RESUME), atomic_open(log_path, "w") as f:
        f.writelines(json.dumps(record) + "\n" for _, record in records if record["iter"] <= start_iter)

