"""
Train a GPT on prepared token shards, on one CPU or GPU, or many through torchrun:

    python train.py config/small.py                                   # one process
    python train.py config/small.py --learning_rate=3e-4 --max_iters=500
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py   # DDP on one node
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py --fsdp=True   # sharded (gpt/parallel.py)
    python train.py config/small.py --init_from=hf:hf-folder          # fine-tune a Llama/Qwen3 (gpt/hf.py)

Settings: DEFAULTS below, then config files and --key=value (--help lists them). Figures go to out_dir/metrics.jsonl,
checkpoints to out_dir/ckpt.pt, which --init_from=resume continues exactly; Ctrl-C or SIGTERM saves one and exits.
"""

import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import asdict, fields

import torch
import torch.distributed as dist

from configurator import configure
from gpt import UserError
from gpt.device import resolve_device, resolve_dtype
from gpt.files import RunDir
from gpt.machine import SharedCpu
from gpt.progress import Log, StepTimer
from gpt.shards import ShardLoader, check_vocab, load_meta
from model import GPT, GPTConfig

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
    loss_chunk=0,  # > 0: the output head and loss on this many positions at a time (less memory; gpt/loss.py)
    gradient_accumulation_steps=1,  # micro-steps per optimizer step, over all processes together
    total_batch_size=0,  # > 0: tokens per optimizer step over all processes; the accumulation follows from it
    **MODEL_DEFAULTS,  # every GPTConfig field (see model.py); block_size is also the training context
    # optimizer: AdamW for everything, or Muon for the matrices inside the blocks and AdamW for the rest
    optimizer="adamw",  # "adamw" or "muon"
    learning_rate=1e-3,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    muon_momentum=0.95,  # optimizer="muon": the momentum of Muon's updates (torch's default)
    grad_clip=1.0,  # 0: no clipping
    # learning rate schedule: linear warmup, then cosine decay or warmup-stable-decay (wsd)
    lr_schedule="cosine",  # "cosine" or "wsd"
    max_iters=5000,
    max_seconds=0.0,  # > 0: also stop after this many seconds (evaluation included, summed over resumes), the learning
                      # rate decaying on that clock: a budget of wall time, e.g. for compare.py --seconds (one process)
    warmup_iters=100,
    lr_decay_iters=0,  # 0: max_iters
    min_lr=1e-4,
    cooldown_frac=0.2,  # wsd: the final fraction of lr_decay_iters that decays linearly to min_lr
    # system
    device="auto",  # "auto" (cuda, then mps, then cpu), or e.g. "cpu", "cuda", "cuda:1"
    dtype="auto",  # "auto" (bfloat16 on CUDA, else float32), "float32", "bfloat16" or "float16"
    compile=True,  # torch.compile the model; used on CUDA only
    fsdp=False,  # under torchrun: shard parameters, gradients and optimizer state across processes (gpt/parallel.py)
    activation_checkpointing=False,  # recompute each block's activations in the backward pass: less memory
    peak_flops=0.0,  # the hardware's peak FLOP/s for MFU; 0: known GPUs are looked up (gpt/mfu.py), else no MFU
    threads=0,  # CPU threads; 0: one per core, less the cores other processes keep busy (gpt/machine.py)
    seed=1337,
)


def check_settings(settings):
    """settings, once every value that would fail deep inside the run (in numpy, torch, a division) is known good."""
    init_from = settings["init_from"]
    if init_from not in ("scratch", "resume") and not init_from.startswith("hf:"):
        from gpt.hints import bad_init_from  # nanoGPT's init_from=gpt2* gets a line of its own
        raise UserError(bad_init_from(init_from))
    for key, least in dict(max_iters=1, batch_size=1, eval_interval=1, eval_iters=1, log_interval=1,
                           gradient_accumulation_steps=1, min_lr=0, weight_decay=0, grad_clip=0, warmup_iters=0,
                           max_seconds=0, total_batch_size=0, loss_chunk=0, threads=0).items():
        if settings[key] < least:
            raise UserError(f"{key} must be at least {least}, got {settings[key]}")
    if settings["learning_rate"] <= 0:
        raise UserError(f"learning_rate must be positive, got {settings['learning_rate']}")
    for key in ("beta1", "beta2", "muon_momentum"):  # AdamW would raise on its betas (a traceback); Muon takes any
        if not 0 <= settings[key] < 1:
            raise UserError(f"{key} must be at least 0 and below 1, got {settings[key]}")
    if not 0 <= settings["cooldown_frac"] <= 1:
        raise UserError(f"cooldown_frac must be in [0, 1] (wsd's share of the decay), got {settings['cooldown_frac']}")
    if settings["lr_schedule"] not in ("cosine", "wsd"):  # else a misspelt wsd would run as cosine
        raise UserError(f"lr_schedule must be cosine or wsd, got {settings['lr_schedule']!r}")
    if settings["max_seconds"] and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process's clock, its own lr
        raise UserError("max_seconds works on one process only; under torchrun give the budget as max_iters")
    return settings


def model_config(settings, meta):
    """A new model's GPTConfig: the settings' model fields, vocab_size 0 the dataset's rounded up to 64s (faster
    matmuls); a field GPTConfig refuses is a UserError."""
    vocab_size = settings["vocab_size"] or 64 * math.ceil(meta["vocab_size"] / 64)
    try:
        return GPTConfig(**{key: settings[key] for key in MODEL_DEFAULTS} | dict(vocab_size=vocab_size))
    except ValueError as e:
        raise UserError(str(e).replace("GPTConfig.", "")) from None


def compile_backend(compile, device_type):  # on CUDA only: on a CPU, inductor compiles for minutes a run
    return "inductor" if compile and device_type == "cuda" else None


def make_optimizers(model, settings, device_type, sharded=False):
    """AdamW with weight decay on matrices only (not norms or biases); with optimizer="muon", Muon takes the weight
    matrices inside the blocks, AdamW the rest (embeddings too: their rows are lookups, not a map to orthogonalize)."""
    optimizer, weight_decay = settings["optimizer"], settings["weight_decay"]
    if optimizer not in ("adamw", "muon"):
        raise UserError(f"optimizer must be adamw or muon, got {optimizer!r}")
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    hidden_matrices, other_matrices, vectors = [], [], []
    for name, param in model.named_parameters():
        muon_takes = optimizer == "muon" and name.startswith("layers.") and id(param) not in embeddings
        (vectors if param.dim() < 2 else hidden_matrices if muon_takes else other_matrices).append(param)
    groups = [dict(params=other_matrices, weight_decay=weight_decay), dict(params=vectors, weight_decay=0.0)]
    adamw = torch.optim.AdamW(groups, betas=(settings["beta1"], settings["beta2"]), fused=device_type == "cuda")
    if optimizer == "adamw":
        return [adamw]
    from gpt.muon import Muon as muon  # torch's Muon, orthogonalizing in float32 on a CPU
    if sharded:
        from gpt.parallel import ShardedMuon as muon  # FSDP's sharded matrices: gathered to be orthogonalized
    # match_rms_adamw scales Muon's update to AdamW's size, so one learning_rate serves both
    return [adamw, muon(hidden_matrices, weight_decay=weight_decay, momentum=settings["muon_momentum"],
                        adjust_lr_fn="match_rms_adamw")]


def eval_loaders(settings, data_dir, rank, world_size, device):
    """Each split's loader for estimate_loss, made as the run starts (a split too short fails before anything is
    written). Its batches are batch_size sequences on every process count: all processes' first n are one process's."""
    return {split: ShardLoader(data_dir, split, settings["batch_size"], settings["block_size"], seed=0, rank=rank,
                               world_size=world_size, device=device) for split in ("train", "val")}


@torch.no_grad()
def estimate_loss(model, loaders, settings, world_size, autocast):
    """Mean loss on eval_iters batches of each split, the same ones every time, spread over the processes."""
    model.eval()
    losses = {}
    for split, loader in loaders.items():
        loader.load_state_dict(dict(epoch=0, shard=0, window=0))  # back to the first batch (seed 0)
        total = torch.zeros((), device=loader.device)
        n_batches = max(1, settings["eval_iters"] // world_size)
        for _ in range(n_batches):
            x, y = loader.next_batch()
            with autocast:
                total += model(x, y, loss_chunk=settings["loss_chunk"])[1].float()
        losses[split] = mean_over_processes(total, world_size) / n_batches
    model.train()
    return losses


def mean_over_processes(value, world_size):
    """A 0-d tensor's mean over all processes, as a float (the one sync with the GPU)."""
    if world_size > 1:
        dist.all_reduce(value)
    return value.item() / world_size


def check_finite(loss, iter_num, ckpt_path):
    if not math.isfinite(loss):
        kept = (f"the last good checkpoint, {ckpt_path}, is kept" if os.path.exists(ckpt_path)
                else "no checkpoint was saved")
        raise UserError(f"loss is {loss} at iter {iter_num}: training diverged and stops; {kept}. "
                        "Lower learning_rate, raise warmup_iters or set grad_clip")


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


def forward_backward(model, loader, micro_steps, scaler, autocast, loss_chunk):
    """The mean loss of micro_steps forward/backward passes; gradients are averaged over processes at the last."""
    loss_sum = 0.0
    for micro_step in range(micro_steps):
        x, y = loader.next_batch()
        sync = contextlib.nullcontext()
        if dist.is_initialized():
            from gpt.parallel import gradient_sync
            sync = gradient_sync(model, enabled=micro_step == micro_steps - 1)
        with sync:
            with autocast:
                loss = model(x, y, loss_chunk=loss_chunk)[1]  # logits not kept through the backward
            scaler.scale(loss / micro_steps).backward()
        loss_sum += loss.detach().float() / micro_steps
    return loss_sum


def optimizer_step(model, optimizers, scaler, grad_clip, lr):
    """Clip the gradients (grad_clip 0: not), step each optimizer at lr, clear the gradients; their norm unclipped."""
    for optimizer in optimizers:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP: the norm of all shards together, as a DTensor
        grad_norm = grad_norm.full_tensor()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
        scaler.step(optimizer)
    scaler.update()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train(settings, run_dir):
    # Setup: the processes and device, the model, its optimizers and data, and the state of a resumed run
    rank, world_size, device = 0, 1, resolve_device(settings["device"])
    if "RANK" in os.environ:  # one of the processes torchrun started (gpt/parallel.py, imported only then)
        from gpt.parallel import start_processes
        rank, world_size, device = start_processes(device)
    log, device_type = Log(run_dir, settings["max_iters"]), device.split(":")[0]
    cpu = SharedCpu(device, settings["threads"])  # on a CPU, the cores other processes leave free: looked at meanwhile
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # fp32 matmuls on tensor cores
    ptdtype = resolve_dtype(settings["dtype"], device_type)
    mixed = ptdtype != torch.float32 and not settings["fsdp"]  # FSDP's MixedPrecisionPolicy casts instead of autocast
    autocast = torch.autocast(device_type, dtype=ptdtype) if mixed else contextlib.nullcontext()
    data_dir, ckpt_path = os.path.join("data", settings["dataset"]), os.path.join(settings["out_dir"], "ckpt.pt")
    eval_splits = eval_loaders(settings, data_dir, rank, world_size, device)  # batch_size as given: before it is split
    micro_steps, note = settings["gradient_accumulation_steps"], None
    if world_size > 1 or settings["total_batch_size"]:  # the global batch split over processes
        from gpt.parallel import global_batch
        settings, micro_steps, note = global_batch(settings, world_size)  # the settings saved as it ran
    checkpoint = None
    if settings["init_from"] == "resume":  # continuing a run: gpt/resume.py, imported only then
        from gpt import resume
        checkpoint = resume.resume_checkpoint(ckpt_path, world_size, device, settings["max_iters"])
    meta = load_meta(data_dir)  # the dataset's tokenizer, which sample.py will need
    # The model's config: the checkpoint's when resuming, a pretrained model's (with this run's dropout) when
    # fine-tuning, else from the settings and the dataset's vocabulary (model_config)
    pretrained = None
    if checkpoint is not None:
        config = GPTConfig(**checkpoint["model_config"])
    elif settings["init_from"].startswith("hf:"):
        from gpt.checkpoint import load_pretrained
        pretrained = load_pretrained(settings["init_from"][3:], meta, settings["dropout"])
        config = pretrained.config
    else:
        config = model_config(settings, meta)
    if settings["block_size"] > config.block_size:
        raise UserError(f"block_size {settings['block_size']} exceeds the model's block_size {config.block_size}")
    torch.manual_seed(settings["seed"])  # the same initialization on every process, before any weights are loaded
    raw_model = GPT(config) if pretrained is None else pretrained  # on the CPU; its parameters and parts
    if checkpoint is not None:
        from gpt.checkpoint import load_weights
        load_weights(raw_model, checkpoint["model"], ckpt_path)  # one that model.py was edited since names the misfits
    check_vocab(data_dir, meta, config.vocab_size)
    tasks = None  # lm-eval's tasks at each evaluation (gpt/harness.py, imported only then: lm-eval is optional)
    if settings["eval_tasks"].strip(" ,"):
        from gpt.harness import task_runner
        tasks = task_runner(settings, meta)
    model, backend = raw_model.to(device), compile_backend(settings["compile"], device_type)  # model: what steps call
    if settings["activation_checkpointing"] or settings["fsdp"] or dist.is_initialized():
        from gpt.parallel import prepare  # compiled, and checkpointed, sharded or wrapped in DDP, in that order
        model = prepare(model, settings, device, ptdtype, backend)
    elif backend:
        model = torch.compile(model, backend=backend)
    optimizers = make_optimizers(raw_model, settings, device_type, settings["fsdp"])  # after FSDP's new parameters
    loader = ShardLoader(data_dir, "train", settings["batch_size"], settings["block_size"], seed=settings["seed"],
                         rank=rank, world_size=world_size, device=device)
    scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)  # fp16 needs loss scaling
    iter_num, best_val_loss, elapsed, resumed_at = 0, float("inf"), 0.0, checkpoint and checkpoint["iter_num"]
    if checkpoint:  # the weights are in the model already; now the rest of the run's state, its tensors then let go
        iter_num, best_val_loss, elapsed = resume.restore(checkpoint, settings["optimizer"], raw_model, optimizers,
                                                          loader, scaler)
        log.say("\n".join(resume.resume_report(checkpoint, settings, DEFAULTS, lr_multiplier)))
    if run_dir:
        run_dir.start(settings, resumed=checkpoint is not None)
        if checkpoint:  # the log goes on from the checkpoint: records a lost run logged after it go
            resume.keep_records_until(run_dir.log_path, resumed_at)
    if note_on_cpu := cpu.check():  # the first look's end: torch's threads set before the first step
        log.say(note_on_cpu)
    tokens_per_iter = settings["batch_size"] * settings["block_size"] * micro_steps * world_size
    log.say(f"{raw_model.num_params() / 1e6:.2f}M parameters, {tokens_per_iter:,} tokens per iteration, "
            f"{world_size} process(es) on {device}, {ptdtype}" + (f"\n{note}" if note else ""))
    peak_tokens_per_sec = None  # tokens/s at the hardware's peak FLOP/s, for MFU, where that peak is known (gpt/mfu.py)
    if settings["peak_flops"] or device_type == "cuda":
        from gpt import mfu
        peak_tokens_per_sec = mfu.peak_tokens_per_sec(raw_model, settings, ptdtype, world_size, log.say)
    timer = StepTimer(device_type, tokens_per_iter, elapsed, peak_tokens_per_sec)
    stop_signal = []  # SIGINT and SIGTERM, from now on: the loop saves a checkpoint and stops at the next iteration

    def request_stop(signum, frame):
        if not stop_signal:  # an evaluation may take a while before the loop sees it: say it was heard
            print("stopping: a checkpoint is saved once the current step or evaluation ends (Ctrl-C again quits at "
                  "once)", file=sys.stderr, flush=True)
        stop_signal.append(signum)
        signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C ends the process at once

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)

    def save():  # every rank gathers the state (under FSDP, from all of them); rank 0 writes it
        if dist.is_initialized():
            from gpt.parallel import full_model_state, full_optimizer_states
            model_state, optimizer_states = full_model_state(raw_model), full_optimizer_states(raw_model, optimizers)
        else:
            model_state, optimizer_states = raw_model.state_dict(), [opt.state_dict() for opt in optimizers]
        if run_dir:
            run_dir.save(dict(model=model_state, optimizers=optimizer_states, model_config=asdict(config),
                              settings=settings, meta=meta, iter_num=iter_num, best_val_loss=best_val_loss,
                              elapsed=timer.elapsed(), loader=loader.state_dict(), scaler=scaler.state_dict(),
                              saved_at=time.time()))  # wall-clock, for the resume line

    # The loop: evaluate and checkpoint, stop, or take one optimizer step and log it
    train_loss, logged_iter = torch.zeros((), device=device), iter_num  # summed on the device: no sync per step
    while True:
        at_end = iter_num >= settings["max_iters"] or 0 < settings["max_seconds"] <= timer.elapsed()
        signalled = bool(stop_signal) and not at_end
        if world_size > 1 and not at_end:  # all processes stop at the same iteration: at a log iteration (a sync),
            from gpt.parallel import agree_to_stop  # if any of them heard a signal
            signalled = iter_num % settings["log_interval"] == 0 and agree_to_stop(stop_signal, device)
        # evaluated every eval_interval and at the end; not again where a resumed run starts (it was, before its save)
        if (iter_num % settings["eval_interval"] == 0 or at_end) and iter_num != resumed_at:
            with timer.paused():  # evaluation and checkpoint writes are not in ms/iter
                losses = estimate_loss(model, eval_splits, settings, world_size, autocast)
                check_finite(losses["val"], iter_num, ckpt_path)
                scores = tasks(raw_model, autocast) if tasks else {}  # lm-eval's, on every rank
                log.record(dict(iter=iter_num, time=timer.elapsed(), train_loss=losses["train"],
                                val_loss=losses["val"], **scores))
                improved, best_val_loss = losses["val"] < best_val_loss, min(best_val_loss, losses["val"])
                if iter_num > 0 and (improved or settings["always_save_checkpoint"]):  # the same on every rank
                    save()
        if at_end or signalled:  # the last line: where the checkpoint is, and what to do with it
            if signalled:
                save()
                log.say(f"stopped by signal at iter {iter_num}; checkpoint saved to {ckpt_path}, continue with "
                        "--init_from=resume")
            elif os.path.exists(ckpt_path):
                log.say(f"done at iter {iter_num}; checkpoint in {ckpt_path}, sample from it with: python sample.py "
                        f"--out_dir={os.path.dirname(ckpt_path)}")
            else:
                log.say(f"done at iter {iter_num}; no checkpoint was saved: val loss never improved, and "
                        "always_save_checkpoint=False")
            break

        # The random state is a function of (seed, rank, iteration), so a resumed run draws the same dropout
        torch.manual_seed(settings["seed"] + 1_000_003 * rank + iter_num)
        time_spent = timer.elapsed() / settings["max_seconds"] if settings["max_seconds"] else None
        lr = settings["learning_rate"] * lr_multiplier(iter_num, settings, time_spent)
        train_loss += forward_backward(model, loader, micro_steps, scaler, autocast, settings["loss_chunk"])
        grad_norm = optimizer_step(raw_model, optimizers, scaler, settings["grad_clip"], lr)
        timer.stepped()
        iter_num += 1
        if iter_num % settings["log_interval"] == 0 or iter_num == settings["max_iters"]:
            loss = mean_over_processes(train_loss, world_size) / (iter_num - logged_iter)  # syncs: once a log
            check_finite(loss, iter_num, ckpt_path)
            record = dict(iter=iter_num, time=timer.elapsed(), loss=loss, lr=lr, grad_norm=grad_norm.item())
            record |= timer.figures()
            if note_on_cpu := cpu.check():  # the threads follow the load of other processes
                log.say(note_on_cpu)
            log.record(record)
            train_loss.zero_()
            logged_iter = iter_num
    log.close()
    if world_size > 1:  # every rank done (rank 0 may still have been saving) before the group is torn down:
        dist.barrier()  # a rank leaving while another still talks to it can abort in gloo's teardown
    return stop_signal[0] if signalled else None


def main(argv):
    settings = check_settings(configure(DEFAULTS, argv))
    # Rank 0 alone writes and prints: it alone holds the run folder (torchrun sets RANK; one process is rank 0)
    run_dir = RunDir(settings) if int(os.environ.get("RANK", "0")) == 0 else None
    # train() may take fewer threads (gpt/machine.py) and handles SIGINT and SIGTERM: a caller's process gets its own
    # back (experiments/kv_heads.py's next run, whose set-up a stale handler would keep from hearing a Ctrl-C)
    threads, handlers = torch.get_num_threads(), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop_signal = train(settings, run_dir)
    finally:
        torch.set_num_threads(threads)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        if run_dir:
            run_dir.close()
    # Torn down only once train() has freed the DDP/FSDP model: destroyed first, the group's last reference was DDP's
    # reducer, whose release joined gloo's threads holding the GIL while one waited for it (deadlocked 3 runs in 90).
    if dist.is_initialized():
        dist.destroy_process_group()
    return stop_signal  # the signal that stopped the run, or None: it ran to the end


if __name__ == "__main__":
    try:
        stopped_by = main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C: no traceback, and the shell's status for it
        sys.exit(130)
    sys.exit(128 + stopped_by if stopped_by else 0)  # the shell's convention: 130 after Ctrl-C, 143 after SIGTERM
