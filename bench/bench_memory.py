"""Memory of a training step per process: single process, DDP x2 and FSDP x2, each with and without activation
checkpointing (parallel.py), on a GPT of a few hundred MB (default: 12 layers, 768 wide, vocab 50304: 114M
parameters, 457 MB in fp32).

    python bench/bench_memory.py                              # all six cases: ~2 minutes on a 2-core CPU
    python bench/bench_memory.py --cases fsdp,fsdp+ac --batch_size 4
    python bench/bench_memory.py --device cuda --cases single,single+ac   # x2 cases need 2 GPUs
    python bench/bench_memory.py --cases single --dtype bfloat16 --block_size 1024 --loss_chunk 8192 --batch_size 4

Each case runs in fresh processes (torchrun --nproc_per_node=2 for the x2 cases, gloo on CPU) that build the
model and wrap it as train.py does (checkpoint_blocks, then shard or wrap_ddp; AdamW from train.make_optimizers),
then train --steps steps on random tokens; the last is measured alone, once AdamW's state exists. Per process
(rank 0; the driver checks the other agrees): bytes of parameters (the tied embedding/head once), gradients and
optimizer state, local shards under FSDP; "activations", what the last forward pass leaves in use for the
backward (activation checkpointing's target; under FSDP also the root's gathered embedding/head); and the peaks
of the last step, of its forward+backward alone and of the whole process. On CPU memory is the RSS and the peak
VmHWM (/proc/self/status, reset by clear_refs; tracemalloc does not see torch's allocations), on CUDA
memory_allocated and max_memory_allocated; peaks are given above the baseline, the memory in use before the
model was built (after imports and the process group). A peak holds what the three tensor columns do not:
activations, DDP's gradient buckets (a second copy of the gradients), FSDP's gathered blocks and unsharded
gradients, the optimizer's temporaries. At the default 512 tokens per step the peak comes at the end of the
backward pass, all gradients made and the activations freed, so activation checkpointing lowers the activations
but hardly the peak; it lowers the peak once activations outgrow the gradients (--batch_size 8).

On CPU the workers run with MALLOC_MMAP_THRESHOLD_=131072: every tensor over 128 KiB is then its own mmap, given
back to the OS when freed, so RSS follows the live tensors as max_memory_allocated does on CUDA. glibc's default
raises that threshold as large blocks are freed (up to 32 MB) and keeps what is freed below it in its heap, in
RSS: FSDP's many short-lived buffers (gathered blocks, unsharded gradients) then lift its peak from ~0.6x DDP's
to ~0.8x here. --glibc_heap measures that default (what train.py gets). The x2 cases run one thread per process (torchrun's
OMP_NUM_THREADS=1), so they are slower, not larger.

--dtype bfloat16 is train.py's mixed precision (its default on CUDA): parameters, gradients and AdamW's state stay
fp32, and the forward runs under torch.autocast(device, bfloat16) (single, DDP), or, under FSDP, with bf16 as the
MixedPrecisionPolicy's param_dtype and no autocast. Autocast's bf16 copies of the weights, saved for the backward,
count as activations. On CPU the figures estimate a GPU's, they do not measure it: autocast's op lists differ by
device (though both leave rms_norm to its input's dtype: seen with torch 2.11 on an H100), and the tensors saved for
the backward come out the same; CPU's SDPA picks a flash kernel too (O(T) memory, GQA without repeating
k and v), as CUDA's does; and AdamW on CPU is foreach (temporaries the size of the parameters), fused on CUDA.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script: make the repo's modules importable
import torch
import torch.distributed as dist

from bench_sample import machine
from gpt.cpuinfo import cpu_name
from gpt.parallel import checkpoint_blocks, shard, wrap_ddp
from model import GPT, GPTConfig
from train import make_optimizers

MB = 1e6
MMAP_THRESHOLD = 128 * 1024  # glibc's initial M_MMAP_THRESHOLD; set explicitly, it stays fixed
# name: (mode, processes, activation checkpointing)
CASES = {"single": ("single", 1, False), "single+ac": ("single", 1, True), "ddp": ("ddp", 2, False),
         "ddp+ac": ("ddp", 2, True), "fsdp": ("fsdp", 2, False), "fsdp+ac": ("fsdp", 2, True)}
LABELS = {"single": "single", "ddp": "DDP x2", "fsdp": "FSDP x2"}
ADAMW = dict(optimizer="adamw", weight_decay=0.1, learning_rate=6e-4, beta1=0.9, beta2=0.95)


def proc_status_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def memory(cuda):
    """(memory in use, peak since the last reset_peak): CUDA's allocated bytes, or on CPU the RSS and VmHWM."""
    if cuda:
        return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    return proc_status_kb("VmRSS"), proc_status_kb("VmHWM")


def reset_peak(cuda):
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: VmHWM := the current RSS


def local_bytes(tensor):
    if hasattr(tensor, "to_local"):  # FSDP's DTensor: count only this process's shard
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def worker(args):
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = args.device
    if world_size > 1:
        if device == "cuda":
            device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    cuda = device.startswith("cuda")
    dtype = getattr(torch, args.dtype)
    # train.py's mixed precision: autocast, except under FSDP, whose MixedPrecisionPolicy casts instead
    autocast = torch.autocast(device.split(":")[0], dtype=dtype) \
        if dtype != torch.float32 and args.mode != "fsdp" else contextlib.nullcontext()
    before, _ = memory(cuda)

    torch.manual_seed(0)  # the same init on every process, as train.py
    config = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_kv_head=args.n_kv_head, n_embd=args.n_embd)
    model = GPT(config).to(device)
    if args.ac:
        checkpoint_blocks(model)
    if args.mode == "fsdp":
        shard(model, dtype)  # fp32 by default: the cases then differ only in how the state is spread
    optimizers = make_optimizers(model, ADAMW, "cuda" if cuda else "cpu")  # after sharding, as train.py
    raw_model = model
    if args.mode == "ddp":
        model = wrap_ddp(model, device)

    generator = torch.Generator().manual_seed(1 + rank)  # each process its own batch, as in training

    def forward():
        tokens = torch.randint(config.vocab_size, (args.batch_size, args.block_size + 1), generator=generator)
        with autocast:  # the backward outside it, as train.py
            return model(tokens[:, :-1].to(device), tokens[:, 1:].to(device), loss_chunk=args.loss_chunk)[1]

    for _ in range(args.steps - 1):  # AdamW's state, DDP's rebuilt buckets, one-time costs: all there after these
        forward().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    # The last step, measured alone; its gradients stay, to be counted.
    _, process_peak = memory(cuda)
    reset_peak(cuda)
    # What is in use as the model's forward starts: after DDP's pre-forward, which in the second step rebuilds
    # its gradient buckets (the old freed, the new holding no pages until the backward), but before FSDP's
    # (prepend), so that the root's gathered parameters, kept for the backward, count as activations.
    # The logits are dropped at once (forward returns the loss): the backward does not need them.
    in_use = []
    hook = raw_model.register_forward_pre_hook(lambda module, inputs: in_use.append(memory(cuda)[0]), prepend=True)
    loss = forward()
    activations = memory(cuda)[0] - in_use[0]
    hook.remove()
    loss.backward()
    _, fwd_bwd_peak = memory(cuda)
    for optimizer in optimizers:
        optimizer.step()
    _, step_peak = memory(cuda)

    # model.parameters() yields the tied embedding/head weight once
    params = sum(local_bytes(p) for p in raw_model.parameters())
    grads = sum(local_bytes(p.grad) for p in raw_model.parameters() if p.grad is not None)
    optimizer_state = sum(local_bytes(value) for optimizer in optimizers for state in optimizer.state.values()
                          for value in state.values() if torch.is_tensor(value))
    report = dict(rank=rank, world_size=world_size, params=params, grads=grads, optimizer=optimizer_state,
                  n_params=sum(p.numel() for p in raw_model.parameters()), loss=loss.item(), before=before,
                  activations=activations, step_peak=step_peak, fwd_bwd_peak=fwd_bwd_peak,
                  process_peak=max(process_peak, step_peak))
    # a file per rank: two ranks' lines on one stdout can interleave
    with open(os.path.join(args.report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def worker_env(args):
    env = dict(os.environ)
    if not args.glibc_heap:  # a fixed threshold: see the docstring
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    return env


def run_case(name, args, model_argv):
    """Run one case in fresh processes; returns (rank 0's report, all reports, seconds) or raises with its stderr."""
    mode, processes, ac = CASES[name]
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    with tempfile.TemporaryDirectory() as report_dir:
        argv = [*launcher, os.path.abspath(__file__), "--worker", f"--report_dir={report_dir}", f"--mode={mode}",
                *(["--ac"] if ac else []), *model_argv]
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, env=worker_env(args), capture_output=True, text=True)
        seconds = time.perf_counter() - start
        reports = []
        for file in sorted(os.listdir(report_dir)):
            with open(os.path.join(report_dir, file)) as f:
                reports.append(json.load(f))
    if proc.returncode or len(reports) != processes:
        lines = proc.stderr.splitlines()  # from the first traceback: a worker's, not torchrun's summary after it
        first = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), max(0, len(lines) - 40))
        raise RuntimeError(f"exit status {proc.returncode}, {len(reports)} of {processes} reports\n"
                           + "\n".join(lines[first:first + 40]))
    return reports[0], reports, seconds


def check_ranks_agree(name, reports):
    """FSDP splits every tensor in two along dim 0, DDP copies it: the ranks' figures should match within a few %."""
    for key in ("params", "grads", "optimizer", "step_peak"):
        low, high = min(r[key] for r in reports), max(r[key] for r in reports)
        if high > 1.05 * low:
            print(f"  note: {name}: ranks differ in {key}: {', '.join(f'{r[key] / MB:.0f}' for r in reports)} MB")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--n_kv_head", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=50304)
    # 2 x 256 tokens per process per step: a few seconds a step on 2 cores; activations are then a few hundred MB
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2, help="training steps, the last measured (>= 2)")
    parser.add_argument("--loss_chunk", type=int, default=0, help="train.py's loss_chunk: the head's positions "
                        "at a time (0: all at once)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="bfloat16: train.py's mixed precision (autocast; fp32 parameters, gradients, AdamW state)")
    parser.add_argument("--glibc_heap", action="store_true",
                        help="leave glibc's malloc as it is (freed tensors may stay in its heap, counted in RSS)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one case's process (internal)
    parser.add_argument("--mode", choices=("single", "ddp", "fsdp"), help=argparse.SUPPRESS)
    parser.add_argument("--ac", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report_dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        if dist.is_initialized():  # after worker() freed the model: see train.main
            dist.destroy_process_group()
        return
    if args.steps < 2:
        sys.exit("error: --steps must be >= 2: the measured step is the one after AdamW's state is made")
    names = args.cases.split(",")
    if unknown := [name for name in names if name not in CASES]:
        sys.exit(f"error: unknown cases {unknown}; choose from {', '.join(CASES)}")

    model_argv = [f"--{key}={getattr(args, key)}" for key in
                  ("device", "n_layer", "n_embd", "n_head", "n_kv_head", "vocab_size", "batch_size", "block_size",
                   "steps", "loss_chunk", "dtype")]
    print(machine())
    malloc = worker_env(args).get("MALLOC_MMAP_THRESHOLD_") or "unset (glibc default)"
    precision = "fp32" if args.dtype == "float32" else "bf16 mixed precision (fp32 parameters and AdamW state)"
    print(f"model: {args.n_layer} layers, {args.n_embd} wide, vocab {args.vocab_size}, {precision}; "
          f"{args.batch_size} x {args.block_size} tokens per process per step, {args.steps} AdamW steps"
          + (f", loss_chunk {args.loss_chunk}" if args.loss_chunk else ""))
    print("peak: " + ("CUDA max_memory_allocated" if args.device == "cuda" else
                      f"peak RSS (VmHWM), workers' MALLOC_MMAP_THRESHOLD_={malloc}"), flush=True)
    results, failures, start = {}, {}, time.perf_counter()
    for name in names:
        try:
            results[name], reports, seconds = run_case(name, args, model_argv)
        except RuntimeError as e:
            failures[name] = str(e)
            print(f"  {name}: FAILED ({str(e).splitlines()[0]})", flush=True)
            continue
        check_ranks_agree(name, reports)
        print(f"  {name}: {seconds:.0f} s, loss {results[name]['loss']:.3f}", flush=True)
    if results:
        print_results(results)
    print(f"\ntotal {time.perf_counter() - start:.0f} s on {cpu_name()}")
    for name, message in failures.items():
        print(f"\n{name} FAILED: {message}")
    if failures:
        sys.exit(1)


def print_results(results):
    n_params = next(iter(results.values()))["n_params"]
    print(f"\n{n_params / 1e6:.1f}M parameters = {n_params * 4 / MB:.0f} MB in fp32; MB = 1e6 bytes, per process "
          f"(rank 0)\nbaseline: memory before the model was built; activations: what the last forward pass left in "
          f"use for the backward;\npeaks, above the baseline: of the last step, of its forward+backward, of the whole "
          f"process")
    keys = ("params", "grads", "optimizer", "sum", "before", "activations", "step_peak", "fwd_bwd_peak", "process_peak")
    titles = ("params", "grads", "optim", "sum", "baseline", "activations", "step", "fwd+bwd", "process")
    head = f"{'case':<14} {'procs':>5} " + " ".join(f"{title:>{max(7, len(title))}}" for title in titles)
    print(f"\n{' ' * (len(head) - 23)}{' peak above baseline ':-^23}\n{head}\n{'-' * len(head)}")  # over the last 3
    for name, r in results.items():
        r["sum"] = r["params"] + r["grads"] + r["optimizer"]
        for key in ("step_peak", "fwd_bwd_peak", "process_peak"):
            r[key] -= r["before"]
        mode, processes, ac = CASES[name]
        print(f"{LABELS[mode] + (' + AC' if ac else ''):<14} {processes:>5} " + " ".join(
            f"{r[key] / MB:>{max(7, len(title))}.0f}" for key, title in zip(keys, titles)))
    print()
    for suffix in ("", "+ac"):
        if f"fsdp{suffix}" in results and f"ddp{suffix}" in results:
            fsdp, ddp = results[f"fsdp{suffix}"], results[f"ddp{suffix}"]
            print(f"FSDP/DDP{' (both with AC)' if suffix else ''}: params+grads+optimizer "
                  f"{fsdp['sum'] / ddp['sum']:.2f}x, step peak {fsdp['step_peak'] / ddp['step_peak']:.2f}x")
    for mode in ("single", "ddp", "fsdp"):
        if mode in results and f"{mode}+ac" in results:
            plain, ac = results[mode], results[f"{mode}+ac"]
            print(f"AC/no AC, {LABELS[mode]}: " + ", ".join(
                f"{what} {ac[key] / plain[key]:.2f}x ({(plain[key] - ac[key]) / MB:.0f} MB less)"
                for what, key in (("activations", "activations"), ("step peak", "step_peak"))))


if __name__ == "__main__":
    main()
