"""
Train a GPT on prepared token shards, on one CPU or GPU, or many through torchrun:

    python train.py config/small.py                                   # one process
    python train.py config/small.py --learning_rate=3e-4 --max_iters=500
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py   # DDP on one node
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py --fsdp=True   # sharded (parallel.py)
    python train.py config/small.py --init_from=hf:hf-folder          # fine-tune a Llama/Qwen3 (export.py)

Settings are the DEFAULTS below, changed by config files and --key=value overrides (configurator.py).
Every logged figure goes to out_dir/metrics.jsonl; checkpoints go to out_dir/ckpt.pt and resume exactly
with --init_from=resume. Ctrl-C (SIGINT) or SIGTERM saves a checkpoint and exits. One run at a time writes
to an out_dir, and a run from scratch replaces the run already there only with --overwrite.
"""

import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, fields, replace

import torch
import torch.distributed as dist

from gpt.checkpoint import (CheckpointError, load_checkpoint, load_hf, load_weights, resolve_device, resolve_dtype,
                        save_checkpoint)
from configurator import ConfigError, configure
from gpt.shards import DataError, ShardLoader, check_vocab, load_meta
from gpt.files import FolderInUse, atomic_open, lock_folder, read_jsonl, write_failure
from gpt.machine import SharedCpu
from model import GPT, GPTConfig
from gpt.parallel import (checkpoint_blocks, compile_blocks, file_from_rank0, full_model_state, full_optimizer_states,
                      gradient_sync, load_optimizer_states, shard, whole_root, wrap_ddp)
from gpt.tokenizer import Tokenizer, TokenizerError

# The model settings are GPTConfig's fields (defined and checked there), with a smaller model by default;
# vocab_size 0 means the dataset's, rounded up to a multiple of 64.
MODEL_DEFAULTS = {f.name: f.default for f in fields(GPTConfig)} | dict(
    vocab_size=0, block_size=256, n_layer=6, n_head=6, n_kv_head=6, n_embd=384)

DEFAULTS = dict(
    # output and logging
    out_dir="out",
    eval_interval=250,  # evaluate (and checkpoint) every this many iterations
    eval_iters=50,  # batches per split in each evaluation
    eval_tasks="",  # lm-eval tasks run at each evaluation too, e.g. "hellaswag" (comma-separated; needs lm-eval)
    eval_tasks_limit=None,  # at most this many examples per task (None: all)
    eval_tasks_include_path="",  # a folder of lm-eval task YAML files (tasks of your own, offline copies)
    log_interval=10,
    always_save_checkpoint=True,  # else only when val loss improves
    init_from="scratch",  # "scratch", "resume" (from out_dir/ckpt.pt) or "hf:path" (a Llama/Qwen3 folder to fine-tune)
    overwrite=False,  # let a run that does not resume replace the run already in out_dir (else that is refused)
    wandb_log=False,
    wandb_project="gpt",
    wandb_run_name="run",
    # data
    dataset="shakespeare_char",  # a folder under data/
    batch_size=12,  # sequences per micro-step and process
    loss_chunk=0,  # > 0: the output head and loss on this many positions at a time (less memory; model.chunked_loss)
    gradient_accumulation_steps=1,  # micro-steps per optimizer step, over all processes together
    total_batch_size=0,  # > 0: tokens per optimizer step over all processes; the accumulation follows from it
    **MODEL_DEFAULTS,  # every GPTConfig field (see model.py); block_size is also the training context
    # optimizer: AdamW for everything, or Muon for the matrices inside the blocks and AdamW for the rest
    optimizer="adamw",  # "adamw" or "muon"
    learning_rate=1e-3,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,  # 0: no clipping
    # learning rate schedule: linear warmup, then cosine decay or warmup-stable-decay (wsd)
    lr_schedule="cosine",  # "cosine" or "wsd"
    max_iters=5000,
    max_seconds=0.0,  # > 0: also stop after this many seconds (evaluation included, summed over resumes), the
    # learning rate decaying on that clock: a budget of wall time, e.g. for compare.py --seconds (one process)
    warmup_iters=100,
    lr_decay_iters=0,  # 0: max_iters
    min_lr=1e-4,
    cooldown_frac=0.2,  # wsd: the final fraction of lr_decay_iters that decays linearly to min_lr
    # system
    device="auto",  # "auto" (cuda, then mps, then cpu), or e.g. "cpu", "cuda", "cuda:1"
    dtype="auto",  # "auto" (bfloat16 on CUDA, else float32), "float32", "bfloat16" or "float16"
    compile=True,  # torch.compile the model; used on CUDA only
    fsdp=False,  # under torchrun: shard parameters, gradients and optimizer state across processes (parallel.py)
    activation_checkpointing=False,  # recompute each block's activations in the backward pass: less memory
    peak_flops=0.0,  # the hardware's peak FLOP/s for MFU; 0: known GPUs are looked up, else no MFU
    threads=0,  # CPU threads; 0: one per core, less the cores other processes keep busy (machine.py)
    seed=1337,
)
MODEL_KEYS = [f for f in GPTConfig.__dataclass_fields__ if f != "vocab_size"]
# Dense tensor-core peaks in FLOP/s (no sparsity; fp32 accumulation) as (bfloat16, float16), from NVIDIA's
# datasheets, keyed by the exact torch.cuda.get_device_name(); None: no bfloat16 tensor cores (auto picks float16)
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": (989e12, 989e12), "NVIDIA H100 PCIe": (756e12, 756e12), "NVIDIA H100 NVL": (835e12, 835e12),
    "NVIDIA H200": (989e12, 989e12), "NVIDIA H200 NVL": (835e12, 835e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 312e12), "NVIDIA A100-SXM4-40GB": (312e12, 312e12),
    "NVIDIA A100 80GB PCIe": (312e12, 312e12), "NVIDIA A100-PCIE-40GB": (312e12, 312e12),
    "NVIDIA A10": (125e12, 125e12), "NVIDIA L4": (121e12, 121e12), "NVIDIA L40S": (362e12, 362e12),
    "NVIDIA GeForce RTX 3090": (71e12, 71e12), "NVIDIA GeForce RTX 4090": (165e12, 165e12),
    "Tesla T4": (None, 65e12), "Tesla V100-SXM2-16GB": (None, 125e12), "Tesla V100-SXM2-32GB": (None, 125e12),
    "Tesla V100-PCIE-16GB": (None, 112e12), "Tesla V100-PCIE-32GB": (None, 112e12),
}


class TrainError(Exception):
    """A problem the user can fix; the message is one line saying what to do."""


# ----------------------------------------------------------------------------------------------------
# Setup


def setup_distributed(settings):
    """(rank, world_size, device) for this process; torchrun sets RANK, LOCAL_RANK and WORLD_SIZE."""
    device = resolve_device(settings["device"])
    if "RANK" not in os.environ:
        return 0, 1, device
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Checked before the process group starts, by every process alike: one line each, no rendezvous left waiting
    if device.startswith("mps"):  # gloo's collectives carry CPU and CUDA tensors only
        raise TrainError("torchrun's processes talk through gloo, which cannot carry MPS tensors: on a Mac train in "
                         "one process (python train.py ...), or pass --device=cpu to torchrun")
    if device.startswith("cuda"):
        local_rank, count = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
        if processes > count:
            raise TrainError(f"torchrun started {processes} processes on this node, but it has {count} CUDA GPU(s), "
                             f"one per process; pass --nproc_per_node={count}")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return rank, world_size, device


def load_pretrained(folder, meta):
    """The model of a Hugging Face folder to fine-tune (init_from="hf:folder"); its tokenizer must be the data's."""
    model, model_meta = load_hf(folder)
    if model_meta is not None and model_meta != meta:
        raise TrainError(f"the model in {folder} has another tokenizer ({model_meta['tokenizer']}, {model_meta['vocab_size']} "
                         f"tokens) than the dataset ({meta['tokenizer']}, {meta['vocab_size']} tokens); "
                         f"prepare the data with the model's tokenizer")
    return model


def model_config(settings, meta, checkpoint, pretrained=None):
    """The GPTConfig: the checkpoint's when resuming, the pretrained model's (with this run's dropout) when
    fine-tuning, else from the settings and the dataset's vocabulary."""
    if checkpoint is not None:
        return GPTConfig(**checkpoint["model_config"])
    if pretrained is not None:
        return replace(pretrained.config, dropout=settings["dropout"])
    vocab_size = settings["vocab_size"] or 64 * math.ceil(meta["vocab_size"] / 64)  # multiples of 64: faster matmuls
    try:
        return GPTConfig(vocab_size=vocab_size, **{k: settings[k] for k in MODEL_KEYS})
    except ValueError as e:
        raise TrainError(str(e).replace("GPTConfig.", "")) from None


def make_optimizers(model, settings, device_type):
    """AdamW with weight decay on matrices only (not norms or biases); with optimizer="muon", Muon takes the
    matrices inside the blocks, which it orthogonalizes, and AdamW the embedding, head, norms and biases."""
    hidden_matrices, other_matrices, vectors = [], [], []
    for name, param in model.named_parameters():
        if param.dim() < 2:
            vectors.append(param)
        elif settings["optimizer"] == "muon" and name.startswith("layers."):
            hidden_matrices.append(param)
        else:
            other_matrices.append(param)
    lr = settings["learning_rate"]  # base_lr: the schedule's peak (lr_multiplier); a group key a checkpoint keeps
    groups = [dict(params=other_matrices, weight_decay=settings["weight_decay"], base_lr=lr),
              dict(params=vectors, weight_decay=0.0, base_lr=lr)]
    betas = (settings["beta1"], settings["beta2"])
    adamw = torch.optim.AdamW(groups, lr=settings["learning_rate"], betas=betas, fused=device_type == "cuda")
    if settings["optimizer"] == "adamw":
        return [adamw]
    if settings["optimizer"] != "muon":
        raise TrainError(f"optimizer must be adamw or muon, got {settings['optimizer']!r}")
    # match_rms_adamw scales Muon's update to AdamW's size, so one learning_rate serves both
    muon = torch.optim.Muon(hidden_matrices, lr=settings["learning_rate"], weight_decay=settings["weight_decay"],
                            adjust_lr_fn="match_rms_adamw")
    return [adamw, muon]


def micro_steps_per_process(settings, world_size):
    """Forward/backward passes per process and optimizer step. The global batch is total_batch_size tokens when
    that is set (nanochat's way: the same run on any process count that divides it), else batch_size x block_size
    x gradient_accumulation_steps (nanoGPT's way: the steps count the micro-steps of all processes together)."""
    batch, block, total = settings["batch_size"], settings["block_size"], settings["total_batch_size"]
    if not total:
        steps = settings["gradient_accumulation_steps"]
        if steps % world_size:
            fixed = world_size * math.ceil(steps / world_size)
            raise TrainError(f"gradient_accumulation_steps ({steps}) must be a multiple of the number of processes "
                             f"({world_size}): it counts the micro-steps of all processes together (global batch = "
                             f"batch_size x it); pass --gradient_accumulation_steps={fixed}")
        return steps // world_size
    if settings["gradient_accumulation_steps"] != 1:
        raise TrainError(f"total_batch_size ({total}) and gradient_accumulation_steps "
                         f"({settings['gradient_accumulation_steps']}) both set the global batch; pass one of them "
                         "(--total_batch_size=0 turns the first off)")
    per_micro_step = batch * block * world_size  # tokens of one micro-step on every process
    nearest = f"--total_batch_size={per_micro_step * max(1, round(total / per_micro_step))}"
    if total % block:
        raise TrainError(f"total_batch_size ({total}) must be a multiple of block_size ({block}); pass {nearest}")
    sequences = total // block  # per optimizer step, over all processes
    if sequences % (batch * world_size) == 0:
        return sequences // (batch * world_size)
    fits = [b for b in range(batch, 0, -1) if sequences % (b * world_size) == 0]
    counts = [n for n in range(1, sequences // batch + 1) if sequences % (batch * n) == 0]
    what_to_pass = f"--batch_size={fits[0]} (the same global batch)" if fits else nearest
    elsewhere = f", or run on {', '.join(map(str, counts))} process{'es' * (counts != [1])}" if counts else ""
    raise TrainError(f"total_batch_size {total} = {sequences} sequences of {block} tokens does not split into "
                     f"micro-batches of batch_size {batch} on {world_size} processes; on {world_size} pass "
                     f"{what_to_pass}{elsewhere}")


def build_model(config, seed, pretrained, checkpoint, ckpt_path):
    """The model on the CPU: initialized from seed (the same on every process), then given the weights of a
    pretrained model or of the checkpoint to resume, if any (one that model.py was edited since names the
    tensors that do not fit)."""
    torch.manual_seed(seed)
    model = GPT(config)
    if pretrained is not None:
        model.load_state_dict(pretrained.state_dict())
    if checkpoint is not None:
        load_weights(model, checkpoint["model"], ckpt_path)
    return model


def grad_scaler(device_type, ptdtype, checkpoint):
    """fp16 needs loss scaling (other dtypes get a scaler that does nothing). A resumed run continues at the
    scale its skipped steps lowered, not at a fresh 65536; {} is a checkpoint from a run without one."""
    scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)
    if checkpoint is not None and checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])
    return scaler


def compile_backend(settings, device_type):
    """torch.compile's backend for the training step, or None for eager: compiled on CUDA only, where it pays
    within a run (on a CPU inductor's compilation takes minutes)."""
    return "inductor" if settings["compile"] and device_type == "cuda" else None


def compiled_graphs():
    """The graphs torch.compile has compiled in this process so far (Dynamo's own count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def prepare_model(model, settings, device, ptdtype, backend):
    """The model as the training step calls it, in the order that works: activation checkpointing wraps each
    block's forward; under FSDP each block's forward is then compiled and the model sharded in place (the same
    module comes back); otherwise the whole model is compiled and, under torchrun (one process too), wrapped
    in DDP. backend: torch.compile's, or None for eager."""
    if settings["activation_checkpointing"]:
        checkpoint_blocks(model)
    if settings["fsdp"]:
        if backend:
            compile_blocks(model, backend)
        return shard(model, ptdtype)
    if backend:
        model = torch.compile(model, backend=backend)
    if dist.is_initialized():
        model = wrap_ddp(model, device)
    return model


def check_fsdp(settings, distributed, ptdtype):
    if not distributed:
        raise TrainError("fsdp=True shards the model across processes: run it under torchrun, e.g. torchrun "
                         "--standalone --nproc_per_node=2 train.py ... --fsdp=True (or drop --fsdp)")
    if settings["optimizer"] == "muon":
        raise TrainError("optimizer=muon orthogonalizes whole matrices, which fsdp=True splits across processes; "
                         "use optimizer=adamw with fsdp, or muon without it (DDP)")
    if ptdtype == torch.float16:
        # dtype=auto picks float16 only on cards without bfloat16 (before compute capability 8.0)
        instead = "--dtype=float32 (this card has no bfloat16)" if settings["dtype"] == "auto" else \
            "--dtype=bfloat16 or float32"
        raise TrainError(f"fsdp=True does not take float16 (its gradient scaler is not sharded here); pass {instead}")


def resume_checkpoint(path, world_size, device):
    """out_dir/ckpt.pt, read by global rank 0 (the one that writes it) and sent to the others, so that nodes
    without a shared filesystem resume too."""
    if world_size == 1:
        return load_checkpoint(path)
    data = file_from_rank0(path, device)
    if data is None:
        if dist.get_rank() == 0:
            load_checkpoint(path)  # raises rank 0's own reason (no checkpoint there, or unreadable)
        raise CheckpointError(f"rank 0 could not read {path}; its error says why")
    return load_checkpoint(path, data)


def check_resume(checkpoint, settings):
    if checkpoint["settings"]["optimizer"] != settings["optimizer"]:
        raise TrainError(f"the checkpoint was trained with optimizer={checkpoint['settings']['optimizer']}; "
                         f"resume with that optimizer")


# Settings that may differ on a resume without changing the run, left out of its "settings changed" line:
# init_from (resume, this time) and overwrite (about starting afresh) are about how the run starts; out_dir is where
# the checkpoint lies now (a copied or moved run); threads fits the machine it runs on (machine.py).
RESUME_NOISE = ("init_from", "overwrite", "out_dir", "threads")
FROM_CHECKPOINT = set(MODEL_KEYS + ["vocab_size"]) - {"block_size"}  # a resume takes the model's config from it


def resume_report(checkpoint, settings):
    """The lines rank 0 prints on resuming: the iteration, best val loss and save time of the checkpoint; then, if any
    setting differs from the checkpoint's run, one line listing them, with the learning rate's jump where the
    schedule moved it. A setting the checkpoint predates counts as its default (what that code did)."""
    it = checkpoint["iter_num"]
    best = checkpoint["best_val_loss"]
    about = [f"best val loss {best:.4f}" if math.isfinite(best) else "no val loss yet"]
    if checkpoint.get("saved_at") is not None:  # checkpoints before it was saved have none
        about.append(f"saved at {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(checkpoint['saved_at']))}")
    lines = [f"resumed from iteration {it} of {settings['max_iters']} ({', '.join(about)})"]
    before = dict(DEFAULTS, **checkpoint["settings"])
    changed = {key: f"{key} {show(before[key])} -> {show(value)}" for key, value in settings.items()
               if key not in RESUME_NOISE and before[key] != value}
    if changed:
        used = [change for key, change in changed.items() if key not in FROM_CHECKPOINT]
        unused = [change for key, change in changed.items() if key in FROM_CHECKPOINT]
        parts = [", ".join(used)] if used else []
        if unused:
            parts.append(f"with no effect (the model is the checkpoint's): {', '.join(unused)}")
        line = f"settings changed since the checkpoint: {'; '.join(parts)}"
        try:
            lr_before = before["learning_rate"] * lr_multiplier(it, before)
            lr_now = settings["learning_rate"] * lr_multiplier(it, settings)
        except (ZeroDivisionError, TypeError):  # a learning rate of 0, or a schedule setting of the wrong type
            lr_before = lr_now = None
        if lr_before is not None and not math.isclose(lr_before, lr_now, rel_tol=1e-6):
            line += f"; the learning rate at iteration {it} goes from {lr_before:.2e} to {lr_now:.2e}"
        lines.append(line)
    return lines


def show(value):
    """A setting's value as the line of changes shows it: as typed on the command line, empty strings quoted."""
    return repr(value) if value == "" else str(value)


def optimizer_step(model, optimizers, scaler, grad_clip, lr_scale):
    """Clip the gradients (0: no clipping), step every optimizer at lr_scale times its base learning rate and
    clear the gradients; the gradients' norm before clipping."""
    for optimizer in optimizers:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP: the norm of all shards together, as a DTensor
        grad_norm = grad_norm.full_tensor()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * lr_scale
        scaler.step(optimizer)
    scaler.update()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    return grad_norm


def lr_multiplier(it, settings, time_spent=None):
    """The learning rate at iteration it, as a fraction of learning_rate: linear warmup, then cosine or
    warmup-stable-decay down to min_lr at lr_decay_iters, and min_lr after. Under max_seconds, time_spent (the
    fraction of it used) stands in for the iterations after warmup: the decay ends when the time does."""
    warmup, decay_iters = settings["warmup_iters"], settings["lr_decay_iters"] or settings["max_iters"]
    min_ratio = settings["min_lr"] / settings["learning_rate"]
    if it < warmup:
        return (it + 1) / warmup
    if time_spent is not None:
        it = warmup + min(1.0, time_spent) * (decay_iters - warmup)
    if it >= decay_iters:
        return min_ratio
    if settings["lr_schedule"] == "wsd":
        decay_start = decay_iters * (1 - settings["cooldown_frac"])
        if it < decay_start:
            return 1.0
        return min_ratio + (1 - min_ratio) * (decay_iters - it) / (decay_iters - decay_start)
    progress = (it - warmup) / max(1, decay_iters - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------------------------------
# Evaluation, checkpoints and logging


@torch.no_grad()
def estimate_loss(model, settings, data_dir, rank, world_size, device, autocast):
    """Mean loss on eval_iters batches of each split, the same batches every time (a fixed seed), spread
    over the processes."""
    model.eval()
    losses = {}
    for split in ("train", "val"):
        loader = ShardLoader(data_dir, split, settings["batch_size"], settings["block_size"], seed=0,
                             rank=rank, world_size=world_size, device=device)
        total = torch.zeros((), device=device)
        n_batches = max(1, settings["eval_iters"] // world_size)
        for _ in range(n_batches):
            x, y = loader.next_batch()
            with autocast:
                total += model(x, y, loss_chunk=settings["loss_chunk"])[1].float()
        if world_size > 1:
            dist.all_reduce(total)
        losses[split] = total.item() / (n_batches * world_size)
    model.train()
    return losses


class RunDir:
    """The out_dir of a run, held by rank 0 from start to end: a lock, so that one run at a time writes there;
    metrics.jsonl, every logged figure as one JSON line (also sent to wandb if on); and ckpt.pt. A write that
    fails (a full disk, a quota) stops the run with a message naming the checkpoint that is still intact."""

    def __init__(self, settings):
        self.out_dir = settings["out_dir"]
        self.ckpt_path = os.path.join(self.out_dir, "ckpt.pt")
        self.log_path = os.path.join(self.out_dir, "metrics.jsonl")
        self.saved_iter = None  # the iteration of the checkpoint on disk, once this run resumed or saved one
        self.wandb = None
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            self.lock = lock_folder(self.out_dir)  # before anything in out_dir is read or written
        except FolderInUse as e:
            raise TrainError(f"{self.out_dir} is in use by another training run (process {e.pid}); let it finish "
                             "or stop it, or use another --out_dir") from None
        except OSError as e:
            raise TrainError(f"cannot use out_dir {self.out_dir} ({write_failure(e)})") from None
        if settings["init_from"] != "resume" and os.path.exists(self.ckpt_path) and not settings["overwrite"]:
            self.close()
            raise TrainError(f"{self.ckpt_path} holds an earlier run, which a run from {settings['init_from']} would "
                             "replace; continue it with --init_from=resume, train into another --out_dir, or replace "
                             "it with --overwrite")

    def start(self, settings, checkpoint):
        """A resumed run continues the log from its checkpoint; any other starts afresh, removing what an
        earlier run left (a checkpoint only with overwrite=True: the constructor refused it otherwise)."""
        wandb = import_wandb() if settings["wandb_log"] else None  # before anything is removed
        if checkpoint is not None:
            for line in resume_report(checkpoint, settings):
                print(line)
            self.saved_iter = checkpoint["iter_num"]
            self.keep_records_until(checkpoint["iter_num"])
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
        """Records of iterations after the checkpoint were made by the run that was interrupted after it, and
        this run makes them again. A torn last line (a crash or a full disk while it was written) is dropped."""
        if not os.path.exists(self.log_path):
            return
        try:
            records, torn = read_jsonl(self.log_path)
        except ValueError as e:
            raise TrainError(f"{e}; repair or delete that line, then resume again") from None
        if torn is not None:
            print(f"{self.log_path}: dropped its torn last line ({torn.strip()[:40]!r}), left by a run that "
                  "stopped while writing it")
        for lineno, record in records:
            if not isinstance(record, dict) or not isinstance(record.get("iter"), int):
                raise TrainError(f"{self.log_path}, line {lineno}: not a metrics record (no iter); repair or delete "
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
            except CheckpointError as e:
                raise TrainError(f"{e}; {self.intact()}") from None
        self.saved_iter = checkpoint["iter_num"]

    def intact(self):
        if self.saved_iter is None:
            return "this run has saved no checkpoint yet"
        return (f"{self.ckpt_path} still holds the checkpoint of iter {self.saved_iter}: continue from it with "
                "--init_from=resume")

    def write_failed(self, path, error):
        return TrainError(f"could not write {path} ({write_failure(error)}); {self.intact()}")

    def close(self):
        if self.wandb:
            self.wandb.finish()
        self.lock.close()  # releases the lock


def import_wandb():
    try:
        import wandb  # only needed when asked for
    except ImportError:
        raise TrainError("wandb_log=True needs wandb, which is not installed: pip install wandb "
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


def task_runner(settings, meta):
    """None without eval_tasks; else a function from the model to {"task/metric": value} of those lm-eval
    tasks. Task names are checked now, not at the first evaluation. Every process runs the tasks on its own
    unwrapped model (no collective that could hang or time out while rank 0 alone evaluates); rank 0 logs."""
    names = [t.strip() for t in settings["eval_tasks"].split(",") if t.strip()]
    if not names:
        return None
    try:
        from gpt import harness  # lm-eval is optional: only tasks need it
    except ImportError:
        raise TrainError("eval_tasks needs lm-eval, which is not installed; install it with: pip install lm-eval") from None
    tokenizer = Tokenizer(meta)
    try:
        manager = harness.task_manager(names, settings["eval_tasks_include_path"] or None)
        harness.check_tasks(names, manager, settings["eval_tasks_include_path"] or None)
    except harness.HarnessError as e:
        raise TrainError(f"eval_tasks: {e}") from None

    def run(model):
        try:
            results = harness.run_tasks(model, tokenizer, names, limit=settings["eval_tasks_limit"],
                                        batch_size=settings["batch_size"], manager=manager)
        except harness.HarnessError as e:
            raise TrainError(f"eval_tasks: {e}") from None
        finally:
            model.train()  # the harness put it in eval mode
        return harness.task_figures(results) if results else {}  # lm-eval returns None where LOCAL_RANK > 0

    return run


def flops_per_token(model, seq_len):
    """Training FLOPs per token, as in the PaLM paper (appendix B): 6 per weight of every matmul, plus
    12 * n_layer * n_head * head_dim * seq_len for attention (counted unmasked, as is the convention)."""
    cfg = model.config
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 6 * matmul_weights + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len


def mfu(model, tokens_per_second, peak, seq_len):
    """Model FLOPs utilization: training FLOP/s over the hardware's peak (e.g. 989e12 for an H100's dense bf16)."""
    return flops_per_token(model, seq_len) * tokens_per_second / peak


def peak_flops(gpu_name, dtype):
    """The peak FLOP/s of a GPU (its exact name) in a dtype, for MFU; None if the table does not have it."""
    bf16, fp16 = PEAK_FLOPS.get(gpu_name, (None, None))
    return {torch.bfloat16: bf16, torch.float16: fp16}.get(dtype)


# ----------------------------------------------------------------------------------------------------
# The training loop


def main(argv):
    settings = configure(DEFAULTS, argv)
    init_from = settings["init_from"]
    if init_from not in ("scratch", "resume") and not init_from.startswith("hf:"):
        raise TrainError(f"init_from must be scratch, resume or hf:path/to/folder, got {init_from!r}")
    run_dir = RunDir(settings) if int(os.environ.get("RANK", "0")) == 0 else None  # only rank 0 writes
    threads = torch.get_num_threads()  # train() may take fewer (machine.SharedCpu); a caller's process gets it back
    try:
        train(settings, run_dir)
    finally:
        torch.set_num_threads(threads)
        if run_dir:
            run_dir.close()
    # Torn down only once train() has returned and freed the DDP/FSDP model: destroyed first, the group's last
    # reference was DDP's reducer, whose release then joined gloo's worker threads holding the GIL while a worker
    # waited for it (a deadlock, 3 runs in 90 of two processes on two busy cores; none in 180 this way).
    if dist.is_initialized():
        dist.destroy_process_group()


def train(settings, run_dir):
    rank, world_size, device = setup_distributed(settings)
    master = rank == 0  # only it prints, logs and saves
    device_type = device.split(":")[0]
    ptdtype = resolve_dtype(settings["dtype"], device_type)
    autocast = torch.autocast(device_type, dtype=ptdtype) if ptdtype != torch.float32 else contextlib.nullcontext()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    backend = compile_backend(settings, device_type)
    # on a CPU shared with other work, only the cores other processes leave free, checked again at every log
    shared_cpu = SharedCpu(settings["threads"]) if device_type == "cpu" or settings["threads"] else None
    busy_note = shared_cpu and shared_cpu.check()
    if busy_note and master:
        print(busy_note)
    micro_steps = micro_steps_per_process(settings, world_size)
    if settings["max_seconds"] and world_size > 1:  # each process's clock would set its own learning rate
        raise TrainError("max_seconds works on one process only; under torchrun give the budget as max_iters")
    if settings["fsdp"]:
        check_fsdp(settings, "RANK" in os.environ, ptdtype)  # under torchrun; one process there works too
        autocast = contextlib.nullcontext()  # FSDP's MixedPrecisionPolicy casts instead (parallel.shard)

    out_dir, data_dir = settings["out_dir"], os.path.join("data", settings["dataset"])
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    init_from = settings["init_from"]
    checkpoint = resume_checkpoint(ckpt_path, world_size, device) if init_from == "resume" else None
    meta = load_meta(data_dir)  # the dataset's tokenizer, which sample.py will need
    pretrained = load_pretrained(init_from[3:], meta) if init_from.startswith("hf:") else None
    config = model_config(settings, meta, checkpoint, pretrained)
    check_vocab(data_dir, config.vocab_size)
    tasks = task_runner(settings, meta)
    if settings["block_size"] > config.block_size:
        raise TrainError(f"block_size {settings['block_size']} exceeds the model's block_size {config.block_size}")

    if checkpoint is not None:
        check_resume(checkpoint, settings)
    raw_model = build_model(config, settings["seed"], pretrained, checkpoint, ckpt_path).to(device)  # its parameters and parts
    model = prepare_model(raw_model, settings, device, ptdtype, backend)  # what the training step calls
    optimizers = make_optimizers(raw_model, settings, device_type)  # after sharding: FSDP's parameters are new
    loader = ShardLoader(data_dir, "train", settings["batch_size"], settings["block_size"], seed=settings["seed"],
                         rank=rank, world_size=world_size, device=device)
    iter_num, best_val_loss, elapsed = 0, float("inf"), 0.0
    if checkpoint is not None:
        load_optimizer_states(raw_model, optimizers, checkpoint["optimizers"])
        loader.load_state_dict(checkpoint["loader"])
        iter_num, best_val_loss, elapsed = checkpoint["iter_num"], checkpoint["best_val_loss"], checkpoint["elapsed"]
        # the weights and optimizer state are in place: the run keeps none of the checkpoint's tensors (at 1B
        # parameters, gigabytes per process), only its small fields
        checkpoint = {key: value for key, value in checkpoint.items() if key not in ("model", "optimizers")}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["base_lr"] = settings["learning_rate"]
    scaler = grad_scaler(device_type, ptdtype, checkpoint)

    if master:
        run_dir.start(settings, checkpoint)
    stop_signal = catch_stop_signals()  # the loop saves a checkpoint and stops at the next iteration
    peak = settings["peak_flops"] or (device_peak_flops(ptdtype, master) if device_type == "cuda" else None)
    tokens_per_iter = settings["batch_size"] * settings["block_size"] * micro_steps * world_size
    if master:
        print(f"{raw_model.num_params() / 1e6:.2f}M parameters, {tokens_per_iter:,} tokens per iteration, "
              f"{world_size} process(es) on {device}, {ptdtype}")
    progress_bar = progress_bar_from(iter_num, settings["max_iters"]) if master and sys.stdout.isatty() else None

    run_start, elapsed_before = time.perf_counter(), elapsed  # elapsed: wall-clock seconds over all resumes

    def checkpoint_now():  # every rank calls it: under FSDP the state is gathered from all of them to rank 0
        return dict(model=full_model_state(raw_model), optimizers=full_optimizer_states(raw_model, optimizers),
                    model_config=asdict(config), settings=settings, meta=meta, iter_num=iter_num,
                    best_val_loss=best_val_loss, elapsed=elapsed, loader=loader.state_dict(),
                    scaler=scaler.state_dict(), saved_at=time.time())  # wall-clock, for the resume line

    def say(text):
        if progress_bar:
            progress_bar.write(text)
        else:
            print(text, flush=True)  # so that a log file or pipe gets each line as it happens

    train_loss = torch.zeros((), device=device)  # summed on the device between logs: no sync per step
    steps_since_log, timed_steps, time_at_log = 0, 0, time.perf_counter()
    first_step_s = None  # this run's first step, timed alone (it compiles and warms up): logged once, out of ms/iter
    step_graphs = None  # the graphs torch.compile made for that step: none means it ran eagerly after all
    while True:
        elapsed = elapsed_before + time.perf_counter() - run_start
        # every rank agrees on signalled (should_stop), so all of them evaluate and gather checkpoints together
        signalled = iter_num < settings["max_iters"] and should_stop(stop_signal, world_size, iter_num, settings, device)
        out_of_time = 0 < settings["max_seconds"] <= elapsed
        stopping = signalled or out_of_time or iter_num >= settings["max_iters"]
        evaluated_before_checkpoint = checkpoint is not None and iter_num == checkpoint["iter_num"]
        if (iter_num % settings["eval_interval"] == 0 or stopping and not signalled) and not evaluated_before_checkpoint:
            eval_start = synced_time(device_type)
            losses = estimate_loss(model, settings, data_dir, rank, world_size, device, autocast)
            check_finite(losses["val"], iter_num, ckpt_path)
            task_scores = run_tasks(tasks, raw_model, autocast)
            if master:
                say(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}" +
                    "".join(f", {name} {value:.4f}" for name, value in task_scores.items()))
                run_dir.log(dict(iter=iter_num, time=elapsed_before + time.perf_counter() - run_start,
                                 train_loss=losses["train"], val_loss=losses["val"], **task_scores))
            if losses["val"] < best_val_loss or settings["always_save_checkpoint"]:  # losses: the same on every rank
                best_val_loss = min(best_val_loss, losses["val"])
                if iter_num > 0:
                    state = checkpoint_now()
                    if master:
                        run_dir.save(state)
            time_at_log += time.perf_counter() - eval_start  # evaluation and checkpoint writes: not in ms/iter
        if stopping:
            if signalled:
                state = checkpoint_now()
                if master:
                    run_dir.save(state)
                    say(f"stopped by signal at iter {iter_num}; checkpoint saved to {ckpt_path}, "
                        "continue with --init_from=resume")
            break

        # One optimizer step: micro_steps forward/backward passes, gradients all-reduced on the last only.
        # The random state is a function of (seed, rank, iteration), so a resumed run draws the same dropout.
        torch.manual_seed(settings["seed"] + 1_000_003 * rank + iter_num)
        if first_step_s is None:  # the graphs compiled before it: the first step's are counted after it
            graphs_before_step = compiled_graphs()
        for micro_step in range(micro_steps):
            x, y = loader.next_batch()
            last = micro_step == micro_steps - 1
            with gradient_sync(model, enabled=last):
                with autocast:
                    loss = model(x, y, loss_chunk=settings["loss_chunk"])[1]  # logits not kept through the backward
                scaler.scale(loss / micro_steps).backward()
            train_loss += loss.detach().float() / micro_steps
        time_spent = elapsed / settings["max_seconds"] if settings["max_seconds"] else None
        lr_scale = lr_multiplier(iter_num, settings, time_spent)
        grad_norm = optimizer_step(raw_model, optimizers, scaler, settings["grad_clip"], lr_scale)
        iter_num += 1
        steps_since_log += 1
        if first_step_s is None:
            first_step_s = synced_time(device_type) - time_at_log
            time_at_log += first_step_s
            if backend:
                step_graphs = compiled_graphs() - graphs_before_step
            if master and backend:
                say(first_step_line(first_step_s, step_graphs))
        else:
            timed_steps += 1
        if progress_bar:
            progress_bar.update(1)

        if iter_num % settings["log_interval"] == 0 or iter_num == settings["max_iters"]:
            if world_size > 1:
                dist.all_reduce(train_loss)
                train_loss /= world_size
            mean_loss = train_loss.item() / steps_since_log  # .item() waits for the GPU: once per log
            check_finite(mean_loss, iter_num, ckpt_path)
            now = time.perf_counter()
            elapsed = elapsed_before + now - run_start
            record = dict(iter=iter_num, time=elapsed, loss=mean_loss, lr=settings["learning_rate"] * lr_scale,
                          grad_norm=grad_norm.item())
            if timed_steps < steps_since_log:  # this interval held the first step
                record["first_step_s"] = first_step_s
                if backend:
                    record["compiled_graphs"] = step_graphs
            if timed_steps:  # none when this interval held only the first step
                record.update(speed(now - time_at_log, timed_steps, tokens_per_iter))
                if peak:
                    record["mfu"] = mfu(raw_model, record["tokens_per_sec"], peak * world_size, settings["block_size"])
            if device_type == "cuda":
                record["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9  # since the run started
            busy_note = shared_cpu and shared_cpu.check()
            if master:
                if busy_note:
                    say(busy_note)
                run_dir.log(record)
                figures = log_line(record)
                if progress_bar:
                    progress_bar.set_postfix_str(figures)
                else:
                    say(f"iter {iter_num}: {figures}")
            train_loss.zero_()
            steps_since_log, timed_steps, time_at_log = 0, 0, time.perf_counter()

    if progress_bar:
        progress_bar.close()
    if world_size > 1:  # every rank done (rank 0 may still have been saving) before the group is torn down:
        dist.barrier()  # a rank leaving while another still talks to it can abort in gloo's teardown


def catch_stop_signals():
    """A list that SIGINT and SIGTERM append to from now on, instead of ending the process."""
    stop_signal = []

    def request_stop(signum, frame):
        stop_signal.append(signum)
        signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C ends the process at once

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    return stop_signal


def device_peak_flops(ptdtype, master):
    """This GPU's peak FLOP/s in ptdtype for MFU, or None (said once) if train.PEAK_FLOPS does not know it."""
    gpu = torch.cuda.get_device_name()
    peak = peak_flops(gpu, ptdtype)
    if peak is None and master:
        print(f"no MFU: the peak FLOP/s of {gpu} in {str(ptdtype)[6:]} is not in train.PEAK_FLOPS; pass "
              "--peak_flops=<its dense FLOP/s> to see MFU")
    return peak


def synced_time(device_type):
    """time.perf_counter() once the GPU has done the work queued so far (the CPU runs ahead of it)."""
    if device_type == "cuda":
        torch.cuda.synchronize()
    elif device_type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


def progress_bar_from(iter_num, max_iters):
    from tqdm import tqdm

    return tqdm(total=max_iters, initial=iter_num, unit="it", dynamic_ncols=True)


def run_tasks(tasks, raw_model, autocast):
    """The lm-eval scores of this evaluation ({} if none asked); every rank runs them (see task_runner)."""
    with autocast, whole_root(raw_model):
        return tasks(raw_model) if tasks else {}


def speed(seconds, steps, tokens_per_iter):
    """The log record's speed figures for steps taken in seconds."""
    ms_per_iter = 1000 * seconds / steps
    return dict(ms_per_iter=ms_per_iter, tokens_per_sec=tokens_per_iter * 1000 / ms_per_iter)


def first_step_line(seconds, graphs):
    """What the first step of a compiled run says: how long it took, and whether compiling made any graph."""
    if graphs:
        return f"first step: {seconds:.1f} s, torch.compile included ({graphs} graphs); ms/iter leaves it out"
    return (f"first step: {seconds:.1f} s; torch.compile was on but compiled no graph for the training step: it "
            "runs eagerly")


def log_line(record):
    """A log record's figures as the line printed for it."""
    line = f"loss {record['loss']:.4f}, lr {record['lr']:.2e}, grad norm {record['grad_norm']:.3f}"
    if "first_step_s" in record:
        line += f", first step {record['first_step_s']:.1f} s"
    if "ms_per_iter" in record:
        line += f", {record['ms_per_iter']:.1f} ms/iter, {record['tokens_per_sec']:,.0f} tokens/s"
    if "mfu" in record:
        line += f", MFU {100 * record['mfu']:.1f}%"
    if "peak_memory_gb" in record:
        line += f", peak memory {record['peak_memory_gb']:.1f} GB"
    return line


def should_stop(stop_signal, world_size, iter_num, settings, device):
    """Whether a signal asked to stop. Under DDP all processes must stop at the same iteration, so they
    agree through an all-reduce, done only at log iterations to spare a sync per step."""
    if world_size == 1:
        return bool(stop_signal)
    if iter_num % settings["log_interval"] != 0:
        return False
    flag = torch.tensor(float(bool(stop_signal)), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not stop_signal:
        stop_signal.append(signal.SIGTERM)
    return bool(flag.item())


def check_finite(loss, iter_num, ckpt_path):
    if not math.isfinite(loss):
        kept = f"the last good checkpoint, {ckpt_path}, is kept" if os.path.exists(ckpt_path) else "no checkpoint was saved"
        raise TrainError(f"loss is {loss} at iter {iter_num}: training diverged and stops; {kept}. "
                         "Lower learning_rate, raise warmup_iters or set grad_clip")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, TrainError, CheckpointError, TokenizerError) as e:
        sys.exit(f"error: {e}")
