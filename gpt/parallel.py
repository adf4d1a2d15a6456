"""
How train.py spreads a model over processes, and what that changes for its checkpoints:

- DDP (the default under torchrun): every process holds the whole model, its gradients and AdamW's state
  (16 bytes per parameter in fp32), and gradients are averaged across processes after each step's last
  micro-step.
- FSDP (fsdp=True; PyTorch's FSDP2, `fully_shard`): each block, then the rest of the model, is sharded across the
  processes, so each holds 1/N of the parameters, gradients and optimizer state; a block's parameters are
  gathered just before it runs and freed after. On CUDA the gathered parameters are bf16 (fp16) and gradients
  are reduced in fp32 (a MixedPrecisionPolicy, instead of autocast).
- activation_checkpointing=True: each block keeps only its input in the forward pass and recomputes the rest in
  the backward pass (torch.utils.checkpoint, non-reentrant): a third more compute for far less activation memory.

ckpt.pt keeps one format whatever the run: the full model and optimizer state dicts, gathered to rank 0 on the
CPU under FSDP (full_model_state, full_optimizer_states), so sample.py, export.py and eval.py read any run, and
any run resumes under DDP, FSDP or one process, on any number of processes.
"""

import contextlib
import math
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt import UserError
from gpt.muon import Muon

FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)  # the whole state, on rank 0's CPU


def prepare(model, settings, device, ptdtype, backend):
    """The model as train.py's step calls it, in the order that works: activation checkpointing for each block; under
    FSDP (refused on one process and in float16, where settings' dtype says what to pass) each block is then compiled
    and the model sharded in place (the same module comes back); otherwise the whole model is compiled and, under
    torchrun (one process too), wrapped in DDP. backend: torch.compile's, or None (eager)."""
    if settings["fsdp"]:
        check_fsdp(settings["dtype"], "RANK" in os.environ, ptdtype)
    if settings["activation_checkpointing"]:
        checkpoint_blocks(model)
    if settings["fsdp"]:
        if backend:
            compile_blocks(model, backend)
        return shard(model, ptdtype)
    if backend:
        model = torch.compile(model, backend=backend)
    return wrap_ddp(model, device) if dist.is_initialized() else model


def checkpoint_blocks(model):
    """Activation checkpointing: each block of model.layers is replaced by torch's CheckpointWrapper around it
    (print(model) shows it), whose forward runs the block under torch.utils.checkpoint (non-reentrant). The
    wrapper's state_dict hooks leave its prefix out of the keys, so the state dict is a plain GPT's."""
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)


def compile_blocks(model, backend="inductor"):
    """torch.compile each block on its own (FSDP's way), with the module's own API: block.compile() compiles its
    call, activation checkpointing's wrapper included, so Dynamo traces the checkpoint as one region."""
    for block in model.layers:
        block.compile(backend=backend)


def shard(model, param_dtype):
    """FSDP2: each block, then the root (embedding, final norm and the tied head), sharded in place across the
    processes. param_dtype: the dtype blocks compute in (float32, or bfloat16/float16 on CUDA); gradients are
    always reduced in float32. The mesh is on the model's device type (cpu under gloo, cuda under NCCL):
    fully_shard's default follows the build's accelerator, which puts a gloo run's parameters on a CUDA device
    wherever torch was built with CUDA."""
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


class ShardedMuon(Muon):
    """gpt.muon.Muon for FSDP's row-sharded matrices (DTensors), with Muon's state and numbers. Newton-Schulz needs
    a whole matrix: each rank orthogonalizes whole the matrices it owns (the i-th: rank i % world size), all ranks at
    once (nanochat and modded-nanogpt share Muon's work so), between two all-to-alls a step: every rank's rows of each
    matrix to its owner, then each owner's results' rows back to the ranks holding them. A rank holds whole only the
    matrices it owns. torch.optim.Muon runs on DTensors too, but splits every Newton-Schulz product into collectives,
    many times slower a step (bench/RESULTS.md)."""

    def orthogonalized(self, updates, group):
        from torch.distributed.tensor import DTensor

        updates, world, rank = list(updates), dist.get_world_size(), dist.get_rank()
        if not updates:
            return []
        rows = [fsdp_rows(u.size(0), world) for u in updates]  # rows[i][r]: how many rows of matrix i rank r holds
        size = [[n * u.size(1) for n in rows_i] for rows_i, u in zip(rows, updates)]  # size[i][r]: their elements
        owned = [list(range(len(updates)))[r::world] for r in range(world)]  # owned[r]: the matrices rank r owns
        shards = [u.to_local().flatten() for u in updates]
        assert [len(shard) for shard in shards] == [s[rank] for s in size], "FSDP's rows are not torch.chunk's"
        # 1. every rank's rows of each matrix to its owner, which puts its matrices together and orthogonalizes them
        pieces = exchange([[shards[i] for i in owned[r]] for r in range(world)],
                          [[size[i][r] for i in owned[rank]] for r in range(world)], shards[0])  # [r][j]: rank r's
        whole = [torch.cat([p[j] for p in pieces]).view(updates[i].shape) for j, i in enumerate(owned[rank])]
        results = [result.to(updates[i].dtype)  # Muon's way on this device: on CUDA, batched by shape
                   for result, i in zip(super().orthogonalized(whole, group), owned[rank])]
        # 2. each result's rows back to the rank holding them
        starts = [[sum(n[:r]) for r in range(world)] for n in rows]  # starts[i][r]: rank r's first row of matrix i
        back = exchange([[w[starts[i][r]:starts[i][r] + rows[i][r]].flatten() for w, i in zip(results, owned[rank])]
                         for r in range(world)], [[size[i][rank] for i in owned[r]] for r in range(world)], shards[0])
        mine = {i: part for r in range(world) for i, part in zip(owned[r], back[r])}  # this rank's rows of each
        return [DTensor.from_local(mine[i].view(-1, u.size(1)), u.device_mesh, u.placements, shape=u.shape,
                                   stride=u.stride()) for i, u in enumerate(updates)]


def fsdp_rows(n_rows, world):
    """How many rows of an (n_rows, ...) matrix each of world ranks holds under FSDP2: torch.chunk's split (chunks of
    ceil(n_rows / world) rows, the last ones shorter or empty)."""
    chunk = -(-n_rows // world)
    return [max(0, min(chunk, n_rows - rank * chunk)) for rank in range(world)]


def exchange(send, sizes, like):
    """One all_to_all: send[r] lists the flat tensors for rank r, sizes[r] the lengths of those rank r sends here;
    returns them, [r][j] (like's dtype and device)."""
    flat = [t for tensors in send for t in tensors]
    received = like.new_empty(sum(map(sum, sizes)))
    dist.all_to_all_single(received, torch.cat(flat) if flat else like.new_empty(0),
                           output_split_sizes=list(map(sum, sizes)),
                           input_split_sizes=[sum(t.numel() for t in tensors) for tensors in send])
    return [list(part.split(s)) for part, s in zip(received.split(list(map(sum, sizes))), sizes)]


def wrap_ddp(model, device):
    return DDP(model, device_ids=[int(device.split(":")[1])] if device.startswith("cuda") else None)


def checkpoint_from_rank0(path, device):
    """The checkpoint at path as global rank 0 reads it (the rank that writes it), on every rank: a resume on nodes
    without a shared filesystem. Rank 0's own error where it cannot."""
    from gpt.checkpoint import load_checkpoint

    data = file_from_rank0(path, device)
    if data is None:
        if dist.get_rank() == 0:
            load_checkpoint(path)  # raises rank 0's own reason (no checkpoint there, or unreadable)
        raise UserError(f"rank 0 could not read {path}; its error says why")
    return load_checkpoint(path, data)


BROADCAST_CHUNK = 64 * 2**20  # bytes of a file sent at a time: a GPU holds this much of it, not all of it


def file_from_rank0(path, device):
    """The bytes of the file at path as global rank 0 sees it, on every rank (each must call it): nodes need not
    share a filesystem. None on every rank where rank 0 cannot read it. device: where the process group's
    collectives run (a CUDA device under NCCL); the file goes through it BROADCAST_CHUNK bytes at a time."""
    data, size = None, -1
    if dist.get_rank() == 0:
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)  # writable, so torch.frombuffer shares it
                f.readinto(data)
            size = len(data)
        except OSError:
            pass
    size = torch.tensor(size, device=device)
    dist.broadcast(size, src=0)
    if size.item() < 0:
        return None
    data = data if data is not None else bytearray(size.item())
    for start in range(0, len(data), BROADCAST_CHUNK):
        part = torch.frombuffer(data, dtype=torch.uint8, offset=start, count=min(BROADCAST_CHUNK, len(data) - start))
        sent = part.to(device)  # a copy on a GPU; on the CPU, part itself
        dist.broadcast(sent, src=0)
        part.copy_(sent)  # what rank 0 sent, into data (where it already is on the CPU)
    return data


@contextlib.contextmanager
def gradient_sync(model, enabled):
    """Gradients are averaged across processes only where enabled (the last micro-step of a step)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    with model.no_sync() if isinstance(model, DDP) and not enabled else contextlib.nullcontext():
        yield


def agree_to_stop(stop_signal, device):
    """Whether any process heard a stop signal (an all-reduce); one that did not hears SIGTERM from the others."""
    flag = torch.tensor(float(bool(stop_signal)), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not stop_signal:
        stop_signal.append(signal.SIGTERM)
    return bool(flag.item())


@contextlib.contextmanager
def whole_root(model):
    """Under FSDP, the root's parameters (embedding, final norm, head) gathered while in the block: code that calls
    the model's parts instead of its forward (the engine's scorers call hidden_states and logits) needs them.
    (FSDP happens to leave the root gathered after a forward pass, and estimate_loss runs one first; that is its
    internal choice, not promised.) Every rank must enter it; the root is sharded again on the way out."""
    if isinstance(model, FSDPModule):
        model.unshard()
    try:
        yield
    finally:
        if isinstance(model, FSDPModule):
            model.reshard()


def full_model_state(model):
    """The model's state dict, whole: gathered to rank 0's CPU under FSDP (an empty dict on the other ranks, and
    every rank must call it), the plain state dict otherwise."""
    if isinstance(model, FSDPModule):
        return get_model_state_dict(model, options=FULL_ON_CPU)
    return model.state_dict()


def full_optimizer_states(model, optimizers):
    """Each optimizer's state dict in torch's own format (parameters numbered in the order of its param_groups),
    gathered to rank 0 under FSDP like full_model_state."""
    if not isinstance(model, FSDPModule):
        return [optimizer.state_dict() for optimizer in optimizers]
    states = [get_optimizer_state_dict(model, optimizer, options=FULL_ON_CPU) for optimizer in optimizers]
    return [state and by_index(state) for state in states]


# How an optimizer's step runs belongs to the device this run is on, not to the run that saved the checkpoint.
# load_state_dict takes each saved param group whole, these flags included (and puts a fused step's count on the
# device only where the saved group says fused), while the optimizer decided in its constructor that a gradient
# scaler hands its fused step found_inf: a CPU checkpoint resumed on CUDA ran unfused, and with float16's scaler
# crashed at its first step ("Expected grad_scale and found_inf to be None").
STEP_FLAGS = ("fused", "foreach", "capturable")


def load_optimizer_states(model, optimizers, states):
    """Load full optimizer state dicts (torch's format, as full_optimizer_states returns) into the optimizers,
    each process keeping its shard of them under FSDP; each param group keeps this run's STEP_FLAGS."""
    for optimizer, state in zip(optimizers, states):
        state = dict(state, param_groups=[
            dict(saved, **{key: group[key] for key in STEP_FLAGS if key in group})
            for saved, group in zip(state["param_groups"], optimizer.param_groups)])
        if not isinstance(model, FSDPModule):
            optimizer.load_state_dict(state)
            continue
        names = state_dict_names(model)
        ordered = [names[param] for group in optimizer.param_groups for param in group["params"]]
        set_optimizer_state_dict(model, optimizer, by_name(state, ordered),
                                 options=StateDictOptions(full_state_dict=True))


def state_dict_names(model):
    """Each parameter's name as the model's state dict (and torch.distributed.checkpoint) has it: named_parameters()
    with activation checkpointing's wrappers left out (layers.0._checkpoint_wrapped_module.mlp... is layers.0.mlp...;
    the wrapper's own state_dict hooks drop the prefix the same way)."""
    return {param: name.replace(_CHECKPOINT_PREFIX, "") for name, param in model.named_parameters()}


# torch.distributed.checkpoint keys the optimizer's state by parameter name, ckpt.pt (torch's own format) by the
# parameter's number in the order of the param_groups: the two conversions, the one place that knows both


def by_index(state):
    """A name-keyed optimizer state dict in torch's own format."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(names)}
    return {"state": {number[name]: value for name, value in state["state"].items()},
            "param_groups": [dict(group, params=[number[name] for name in group["params"]])
                             for group in state["param_groups"]]}


def by_name(state, names):
    """torch's own optimizer state dict keyed by parameter name instead; names: the name of each parameter, in
    the order of the param_groups."""
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [dict(group, params=[names[i] for i in group["params"]])
                             for group in state["param_groups"]]}


def start_processes(device):
    """(rank, world_size, device) of a process that torchrun started (RANK, LOCAL_RANK, WORLD_SIZE), its process
    group started. Checked first by every process alike: one line each, no rendezvous left waiting."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.startswith("mps"):  # gloo's collectives carry CPU and CUDA tensors only
        raise UserError("torchrun's processes talk through gloo, which cannot carry MPS tensors: on a Mac train in "
                        "one process (python train.py ...), or pass --device=cpu to torchrun")
    if device.startswith("cuda"):
        local_rank, count = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
        if processes > count:
            raise UserError(f"torchrun started {processes} processes on this node, but it has {count} CUDA GPU(s), "
                            f"one per process; pass --nproc_per_node={count}")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    if not device.startswith("cuda"):  # gloo connects the ranks here (NCCL at its first collective): none goes on
        dist.barrier()  # until all have, or one raising a setting's error next cut off another still connecting
    return rank, world_size, device


def check_fsdp(dtype, distributed, ptdtype):
    """fsdp=True's refusals: one process, float16 (its scaler is not sharded)."""
    if not distributed:
        raise UserError("fsdp=True shards the model across processes: run it under torchrun, e.g. torchrun "
                        "--standalone --nproc_per_node=2 train.py ... --fsdp=True (or drop --fsdp)")
    if ptdtype == torch.float16:  # dtype=auto picks float16 only on cards without bfloat16 (before sm80)
        instead = "--dtype=float32 (this card has no bfloat16)" if dtype == "auto" else "--dtype=bfloat16 or float32"
        raise UserError(f"fsdp=True does not take float16 (its gradient scaler is not sharded here); pass {instead}")


def split_over_processes(settings, world_size):
    """(settings, a note or None): where each process's share of the global batch is less than batch_size, each runs
    its share in one micro-step, the global batch kept as total_batch_size (config/small.py's 10 sequences a step run
    as 5 on each of 2 processes): a config runs as it is on any process count that divides its global batch."""
    batch, block, total = settings["batch_size"], settings["block_size"], settings["total_batch_size"]
    if total % block or (total and settings["gradient_accumulation_steps"] != 1):
        return settings, None  # micro_steps_per_process says what is wrong
    sequences = total // block if total else batch * settings["gradient_accumulation_steps"]  # per step, all processes
    share, left = divmod(sequences, world_size)
    if left or not 0 < share < batch:
        return settings, None
    note = (f"the global batch of {sequences} sequences of {block} tokens is {share} on each of {world_size} "
            f"processes: batch_size {share} here")
    return dict(settings, batch_size=share, total_batch_size=sequences * block, gradient_accumulation_steps=1), note


def global_batch(settings, world_size):
    """(settings, micro-steps per process, a note or None): the global batch split over the processes."""
    settings, note = split_over_processes(settings, world_size)
    return settings, micro_steps_per_process(settings, world_size), note


def micro_steps_per_process(settings, world_size):
    """Forward/backward passes per process and optimizer step. The global batch is total_batch_size tokens when
    that is set (nanochat's way: the same run on any process count that divides it), else batch_size x block_size
    x gradient_accumulation_steps (nanoGPT's way: the steps count the micro-steps of all processes together)."""
    batch, block, total = settings["batch_size"], settings["block_size"], settings["total_batch_size"]
    steps = settings["gradient_accumulation_steps"]
    if not total:
        if steps % world_size:
            raise UserError(f"gradient_accumulation_steps ({steps}) must be a multiple of the number of processes "
                            f"({world_size}): it counts the micro-steps of all processes together (global batch = "
                            f"batch_size x it); pass --gradient_accumulation_steps={world_size * math.ceil(steps / world_size)}")
        return steps // world_size
    if steps != 1:
        raise UserError(f"total_batch_size ({total}) and gradient_accumulation_steps ({steps}) both set the global "
                        "batch; pass one of them (--total_batch_size=0 turns the first off)")
    per_micro_step = batch * block * world_size  # tokens of one micro-step on every process
    nearest = f"--total_batch_size={per_micro_step * max(1, round(total / per_micro_step))}"
    if total % block:
        raise UserError(f"total_batch_size ({total}) must be a multiple of block_size ({block}); pass {nearest}")
    sequences = total // block  # per optimizer step, over all processes
    if sequences % (batch * world_size) == 0:
        return sequences // (batch * world_size)
    fits = [b for b in range(batch, 0, -1) if sequences % (b * world_size) == 0]
    counts = [n for n in range(1, sequences // batch + 1) if sequences % (batch * n) == 0]
    what_to_pass = f"--batch_size={fits[0]} (the same global batch)" if fits else nearest
    elsewhere = f", or run on {', '.join(map(str, counts))} process{'es' * (counts != [1])}" if counts else ""
    raise UserError(f"total_batch_size {total} = {sequences} sequences of {block} tokens does not split into "
                    f"micro-batches of batch_size {batch} on {world_size} processes; on {world_size} pass "
                    f"{what_to_pass}{elsewhere}")
