"""Tests for parallel.py and train.py's fsdp and activation_checkpointing settings, with 2 gloo processes on CPU:
FSDP x2, DDP x2 and one process with the same global batch train the same model; ckpt.pt keeps one format, so a run
resumes under FSDP, DDP or one process whatever wrote it; FSDP holds about half the bytes per process; activation
checkpointing leaves the loss and gradients as they were; the settings that cannot run are one-line errors.

The 2-process runs and checks share one torchrun world (the `world` fixture, started once in the background): each
torchrun costs a launcher and 2 processes that import torch, seconds each, where a run of these tiny models takes a
fraction of a second. The world runs its jobs in the order of the tests that read them, and a test waits only for
its own. The two tests about what every process of `torchrun ... train.py` prints as it refuses to start launch that
command itself."""

import contextlib
import copy
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import train
from gpt import UserError
from gpt.parallel import (by_index, by_name, check_fsdp, checkpoint_blocks, compile_blocks, full_model_state,
                          full_optimizer_states, load_optimizer_states, shard, start_processes, wrap_ddp)
from conftest import faked_mps
from model import GPT, GPTConfig
from test_train import workdir  # noqa: F401
from test_train import (TINY, TRAIN, TWO_PROCESSES, assert_one_line_error, in_background, in_dir, load_ckpt, records,
                        run_script)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 layers (so that there are two sharded blocks), no dropout (processes draw different masks), global batch 2 x 4;
# evaluations of 4 batches of 4 sequences (on 2 processes 2 each)
RUN = TINY + TWO_PROCESSES + ["--n_layer=2", "--dropout=0.0", "--gradient_accumulation_steps=2", "--eval_interval=3",
                              "--eval_iters=4"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
RESUME = ["--max_iters=6", "--init_from=resume"]
MUON = ["--optimizer=muon"]
ADAMW = dict(train.DEFAULTS, optimizer="adamw", weight_decay=0.1)  # make_optimizers' settings
BF16 = ["--max_iters=6", "--dtype=bfloat16"]
# DDP's global batch given as one micro-step of 8 sequences, which its 2 processes split into 4 each
# (gpt.parallel.split_over_processes), the others' as 2 micro-steps of 4: the same 2 x 4 x 32 tokens; its evaluations
# 2 batches of 8 sequences (batch_size as given), the others' 16 sequences too
DDP_BATCH = ["--gradient_accumulation_steps=1", "--batch_size=8", "--eval_iters=2"]


def assert_same_run(got_dir, expected_dir, tolerance):
    """The same losses at every logged iteration and the same final weights, within tolerance."""
    got, expected = records(got_dir), records(expected_dir)
    assert [r["iter"] for r in got] == [r["iter"] for r in expected]
    for g, e in zip(got, expected):
        for key in ("loss", "train_loss", "val_loss", "grad_norm"):
            if key in e:
                assert abs(g[key] - e[key]) < tolerance, (key, g, e)
    got_model, expected_model = load_ckpt(got_dir)["model"], load_ckpt(expected_dir)["model"]
    assert set(got_model) == set(expected_model)
    for name, weight in expected_model.items():
        torch.testing.assert_close(got_model[name], weight, atol=tolerance, rtol=0, msg=name)


# ----------------------------------------------------------------------------------------------------
# The world: one torchrun of 2 processes that runs every 2-process run and check of this module in turn


@contextlib.contextmanager
def torchrun_group():
    """The gloo process group of a torchrun world's process (RANK, WORLD_SIZE and the store in its environment),
    for one job: a job starts and ends its own, as train.main does."""
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def train_job(workdir, out_dir, *args, copy_from=None, cwd=None):
    """A job of the world: train.main(RUN + args) in workdir (or cwd), as `torchrun ... train.py` runs it, after rank
    0 copied copy_from to out_dir (the other rank waits for it at the process group's start, in train.main). Its
    result: what the rank printed."""
    def job(rank):
        if copy_from and rank == 0:
            shutil.copytree(copy_from, os.path.join(cwd or workdir, out_dir))
        printed = io.StringIO()
        try:
            with in_dir(cwd or workdir), contextlib.redirect_stdout(printed):
                stopped_by = train.main(RUN + [f"--out_dir={out_dir}", *args])
        finally:
            sys.stdout.write(printed.getvalue())  # in the world's output too, beside a failure's traceback
        assert stopped_by is None, stopped_by  # it ran to the end: the command's exit status 0
        return printed.getvalue()
    return job


def world_jobs(root, workdir):
    """name -> job(rank) of the world, in the order of the tests that read them. Each returns its result (a string)
    on each rank. root: the fixture's folder, holding each run's out_dir under the run's name."""
    def out(name):
        return os.path.join(root, name)

    return {
        # quick ones first (their tests come first): the first test waits for the world's start, not a training run
        "send_a_file": lambda rank: send_a_file(rank, os.path.join(root, "file.bin"), os.path.join(root, "sent")),
        "group_started": lambda rank: group_started_on_every_rank(rank, os.path.join(root, "rank1_started")),
        "mps": lambda rank: on_mps_under_torchrun(workdir, out("mps")),
        "accumulation": lambda rank: accumulation_that_does_not_divide(workdir, out("accumulation")),
        "fsdp": train_job(workdir, out("fsdp"), "--max_iters=6", "--fsdp=True"),
        "ddp": train_job(workdir, out("ddp"), "--max_iters=6", *DDP_BATCH),
        "ddp_micro_steps": train_job(workdir, out("ddp_micro_steps"), "--max_iters=6"),
        "muon_fsdp_3": train_job(workdir, out("muon_fsdp"), "--max_iters=3", "--fsdp=True", *MUON),
        "muon_fsdp": train_job(workdir, out("muon_fsdp"), *RESUME, "--fsdp=True", *MUON),
        "sharded_muon": sharded_muon_steps,
        "fsdp_3": train_job(workdir, out("fsdp_3"), "--max_iters=3", "--fsdp=True"),  # the resumes' start
        "fsdp_3_fsdp": train_job(workdir, out("fsdp_3_fsdp"), *RESUME, "--fsdp=True", copy_from=out("fsdp_3")),
        "fsdp_3_fsdp_ac": train_job(workdir, out("fsdp_3_fsdp_ac"), *RESUME, "--fsdp=True",
                                    "--activation_checkpointing=True", copy_from=out("fsdp_3")),
        "single_3_fsdp": train_job(workdir, out("single_3_fsdp"), *RESUME, "--fsdp=True", copy_from=out("single_3")),
        "fsdp_3_ddp": train_job(workdir, out("fsdp_3_ddp"), *RESUME, copy_from=out("fsdp_3")),
        # each rank in a folder of its own, holding the data (copied there by the fixture): nodes that share no
        # filesystem; ckpt.pt only on rank 0's
        "nodes": lambda rank: train_job(workdir, "run", *RESUME, copy_from=out("fsdp_3"),
                                        cwd=os.path.join(root, "nodes", f"node{rank}"))(rank),
        "fsdp_bf16": train_job(workdir, out("fsdp_bf16"), *BF16, "--fsdp=True"),
        "fsdp_resumes_a_cpu_run": fsdp_resumes_a_cpu_run,
        "fsdp_ac_loads_an_optimizer_state": fsdp_ac_loads_an_optimizer_state,
        "bytes_ddp": lambda rank: bytes_per_process("ddp"),
        "bytes_fsdp": lambda rank: bytes_per_process("fsdp"),
    }


def a_store_of_its_own(rank, name, agent_port):
    """The process group of job name to meet in a store of its own, on a port rank 0 picks and gives the other rank
    through torchrun's store (at agent_port), as a torchrun of its own would. In torchrun's store, which all the
    world's groups would share, the second group's start hung (in ProcessGroupGloo's connection of the ranks), the
    first one's keys still there."""
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], agent_port, is_master=False)
    if rank == 0:
        agent.set(f"port of {name}", str(free_port()))
    os.environ.update(MASTER_PORT=agent.get(f"port of {name}").decode(), TORCHELASTIC_USE_AGENT_STORE="False")


def run_world(root, workdir):
    """The world's processes: each job in turn, its result written to root/done/<name>.rank<r> when it returns (a
    job that raises ends the process, and torchrun the world, the traceback in its output)."""
    rank, agent_port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    for name, job in world_jobs(root, workdir).items():
        a_store_of_its_own(rank, name, agent_port)
        result = job(rank)
        path = os.path.join(root, "done", f"{name}.rank{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(result)
        os.replace(path + ".tmp", path)  # whole or absent: the test polls for it


WORLD = """import sys
sys.path[:0] = [{root!r}, {tests!r}]
import test_parallel
test_parallel.run_world(*sys.argv[1:])
"""


class World:
    """The world running in the background: out_dir(name) and result(name) wait for that job only."""

    def __init__(self, proc, root, log_path):
        self.proc, self.root, self.log_path = proc, root, log_path

    def result(self, name):
        """The job's result on each rank, [rank 0's, rank 1's], once both have finished it."""
        paths = [os.path.join(self.root, "done", f"{name}.rank{rank}") for rank in (0, 1)]
        deadline = time.monotonic() + 300
        while not all(map(os.path.exists, paths)):
            if self.proc.poll() is not None and not all(map(os.path.exists, paths)):
                with open(self.log_path) as f:
                    pytest.fail(f"the world ended (status {self.proc.returncode}) before job {name}:\n{f.read()}")
            if time.monotonic() > deadline:  # hung: stopped, so that the tests after this one fail at once
                self.proc.terminate()
                self.proc.wait(timeout=60)
                pytest.fail(f"job {name} not done in 300 s")
            time.sleep(0.05)
        results = []
        for path in paths:
            with open(path) as f:
                results.append(f.read())
        return results

    def out_dir(self, name):
        """The out_dir of a run: of the world's job name once it has finished, or of a one-process run (done in
        the fixture)."""
        if name in ("single", "single_3"):
            return os.path.join(self.root, name)
        self.result(name)
        return os.path.join(self.root, name)


def one_process_run(workdir, out_dir, *args):
    """A one-process run of RUN + args, in this process (while the world runs in its own)."""
    with in_dir(workdir):
        train.main(RUN + [f"--out_dir={out_dir}", *args])
    return str(out_dir)


@pytest.fixture(scope="module")
def world(workdir, tmp_path_factory):
    """The world (World), started here, and meanwhile in this process the one-process runs several tests compare
    with: 6 iterations ("single") and 3 ("single_3", done first: the world resumes it under FSDP). Tests read its
    runs, never write to them: one that continues a run copies it first."""
    root = tmp_path_factory.mktemp("world")
    (root / "done").mkdir()
    for node in ("node0", "node1"):  # the data on each node (world_jobs' "nodes")
        shutil.copytree(workdir / "data", root / "nodes" / node / "data")
    (root / "file.bin").write_bytes(os.urandom(2500))  # for send_a_file
    one_process_run(workdir, root / "single_3", "--max_iters=3")
    script = root / "world.py"
    script.write_text(WORLD.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
    log_path = str(root / "world.txt")
    with in_background([*TORCHRUN, str(script), str(root), str(workdir)], root, log_path) as proc:
        one_process_run(workdir, root / "single", "--max_iters=6")
        yield World(proc, str(root), log_path)
        if proc.poll() is None:  # jobs no test waited for (a selection of tests): torchrun stops its processes
            proc.terminate()  # on SIGTERM (killing the launcher would leave them running)
            proc.wait(timeout=60)


# ----------------------------------------------------------------------------------------------------
# The world's quick jobs, first: a process group's start, a file sent, settings refused on every rank


def send_a_file(rank, path, out):
    """The world's job for the test below: the file at path sent from rank 0 (to out/rank<r>) in chunks of 1000
    bytes, and then a missing file; the sizes each broadcast carried and what the missing file gave."""
    from gpt import parallel

    sizes, broadcast = [], dist.broadcast
    with pytest.MonkeyPatch.context() as patch, torchrun_group():
        patch.setattr(parallel, "BROADCAST_CHUNK", 1000)
        patch.setattr(dist, "broadcast", lambda tensor, src: sizes.append(tensor.numel()) or broadcast(tensor, src))
        data = parallel.file_from_rank0(path if rank == 0 else "no such file", "cpu")
        missing = parallel.file_from_rank0(os.path.join(out, "missing"), "cpu")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}"), "wb") as f:
        f.write(bytes(data))
    return f"{sizes} {missing}"


def test_a_file_goes_to_every_rank_in_chunks(world):
    """Resuming on nodes without a shared filesystem, rank 0 sends ckpt.pt: in BROADCAST_CHUNK pieces (a GPU
    holds one piece, not the whole file), every rank ending with rank 0's bytes; a file rank 0 cannot read is None
    on every rank."""
    assert world.result("send_a_file") == ["[1, 1000, 1000, 500, 1] None"] * 2
    with open(os.path.join(world.root, "file.bin"), "rb") as f:
        sent = f.read()
    for rank in (0, 1):
        with open(os.path.join(world.root, "sent", f"rank{rank}"), "rb") as f:
            assert f.read() == sent


def group_started_on_every_rank(rank, flag):
    """The world's job for the test below: start_processes on each rank, rank 1's init_process_group returning late
    (0.5 s, having then written flag), as on a loaded machine: whether flag was there when each returned."""
    init = dist.init_process_group

    def slow_init(*args, **kwargs):
        init(*args, **kwargs)
        time.sleep(0.5)
        open(flag, "w").close()

    dist.init_process_group = slow_init if rank == 1 else init
    try:
        start_processes("cpu")
    finally:
        dist.init_process_group = init
    started = os.path.exists(flag)
    dist.barrier()  # both past start_processes before the group ends, whatever it gave
    dist.destroy_process_group()
    return str(started)


def test_no_rank_goes_on_until_every_ranks_process_group_has_started(world):
    """On gloo, a rank whose group had started went on while another's still connected: a setting refused next on
    every rank (the accumulation below) ended the first one's process, and with it the connection the other was
    making, whose line was then gloo's "connectFullMesh failed ... Connection closed by peer" (seen once in a suite
    run). start_processes returns on no rank before every rank's init_process_group has (rank 1's late here)."""
    assert world.result("group_started") == ["True", "True"]


def on_mps_under_torchrun(workdir, out_dir):
    """The world's job for the test below: `torchrun ... train.py --device=mps`, as run_script runs it in this
    process: its exit status and stderr."""
    args = [a for a in TINY if not a.startswith("--device")] + ["--device=mps", f"--out_dir={out_dir}"]
    with faked_mps():  # as on a Mac: else resolve_device says there is no MPS device first
        result = run_script(TRAIN, args, workdir)
    return f"{result.returncode}\n{result.stderr}"


def test_torchrun_on_mps_is_one_line_on_every_rank(world):
    """gloo carries CPU and CUDA tensors only (torch's backend_capability): DDP and FSDP cannot run on a Mac's GPU.
    Each process says so in one line before its process group starts (train.py as torchrun starts it, in the world's
    processes: run_script; a real torchrun whose processes each stop with their line is
    test_more_processes_than_gpus_is_one_line_on_every_rank)."""
    for result in world.result("mps"):
        status, stderr = result.split("\n", 1)
        assert status == "1" and stderr.count("\n") == 1, stderr
        assert stderr.startswith("error: ") and "gloo, which cannot carry MPS tensors" in stderr, stderr
        assert "--device=cpu" in stderr, stderr


def accumulation_that_does_not_divide(workdir, out_dir):
    """The world's job for the test below: `torchrun ... train.py` with 3 micro-steps, as run_script runs it in this
    process: its exit status and stderr, in lines."""
    result = run_script(TRAIN, [*TINY, *TWO_PROCESSES, f"--out_dir={out_dir}", "--gradient_accumulation_steps=3"],
                        workdir)
    if dist.is_initialized():  # refused after the process group started, which the process's exit would end
        dist.destroy_process_group()
    return f"{result.returncode}\n{result.stderr}"


def test_an_accumulation_that_does_not_divide_among_processes_says_what_to_pass(world):
    """3 micro-steps of 4 sequences: 6 a process, more than one micro-step holds, in steps that 2 do not divide. Each
    process exits with the line (train.py as torchrun starts it, in the world's processes: run_script)."""
    for result in world.result("accumulation"):
        status, stderr = result.split("\n", 1)
        assert status != "0"
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert errors and "--gradient_accumulation_steps=4" in errors[0], stderr
    assert not os.path.exists(os.path.join(world.root, "accumulation", "ckpt.pt"))


def test_fsdp_ddp_and_one_process_train_the_same_model(world):
    """The same global batch (2 processes x 1 micro-step, or 1 x 2; DDP's split from one micro-step), the same losses
    and final weights within 1e-5 (fp32; the sums run in another order). Measured: 7.3e-6 at most in the weights
    after 6 AdamW steps."""
    assert "2 process(es) on cpu" in world.result("fsdp")[0]
    assert "the global batch of 8 sequences of 32 tokens is 4 on each of 2 processes" in world.result("ddp")[0]
    assert_same_run(world.out_dir("fsdp"), world.out_dir("single"), 1e-5)
    assert_same_run(world.out_dir("ddp"), world.out_dir("single"), 1e-5)


def test_two_process_ddp_matches_one_process(world):
    """RUN's 2 micro-steps of 4 sequences on 2 processes under DDP (1 micro-step each) and on one process (2): the same
    records, evaluations included, each with the same keys, the same losses and gradient norms within 1e-4, and the same
    learning rates."""
    assert "2 process(es) on cpu" in world.result("ddp_micro_steps")[0]
    expected, got = records(world.out_dir("single")), records(world.out_dir("ddp_micro_steps"))
    assert [r["iter"] for r in got] == [r["iter"] for r in expected] == [0, 1, 2, 3, 3, 4, 5, 6, 6]
    for e, g in zip(expected, got):
        assert set(e) == set(g)
        for key in ("loss", "val_loss", "train_loss", "grad_norm"):
            if key in e:
                assert abs(e[key] - g[key]) < 1e-4, (key, e, g)
        if "lr" in e:
            assert e["lr"] == g["lr"]


def test_the_same_command_on_one_process_is_the_same_run_evaluations_included(world, workdir, tmp_path):
    """DDP's command (8 sequences a step, 4 on each process) on one process: the same losses, validation included, and
    weights. Evaluations read eval_iters batches of batch_size as given on any process count; the split batch once
    made each process's evaluation half as long, so that 2 processes read half of one process's batches."""
    single = one_process_run(workdir, tmp_path / "single", "--max_iters=6", *DDP_BATCH)
    assert_same_run(world.out_dir("ddp"), single, 1e-5)


def test_muon_under_fsdp_trains_and_resumes_as_one_process_does(world, workdir, tmp_path):
    """optimizer=muon with fsdp=True (gpt.parallel.ShardedMuon: each matrix orthogonalized whole by its rank): 3
    iterations, resumed to 6 under FSDP, give one process's 6 iterations with gpt.muon.Muon: the same losses within
    1e-5, so its state saves and loads as Muon's. Gradient norms and weights within 1e-3 only: where Newton-Schulz
    runs in bfloat16 (torch's choice), gradients summed in another order can round an update element to the next
    bfloat16 (measured: 5.7e-6 in the losses, 1.0e-4 in a gradient norm, 1.9e-4 in the weights; DDP with
    torch.optim.Muon differs from one process as much)."""
    single = one_process_run(workdir, tmp_path / "single", "--max_iters=6", *MUON)
    fsdp = world.out_dir("muon_fsdp")  # its 3 iterations, then their resume to 6
    got, expected = records(fsdp), records(single)
    assert [r["iter"] for r in got] == [r["iter"] for r in expected]
    for g, e in zip(got, expected):
        for key, tolerance in (("loss", 1e-5), ("train_loss", 1e-5), ("val_loss", 1e-5), ("grad_norm", 1e-3)):
            if key in e:
                assert abs(g[key] - e[key]) < tolerance, (key, g, e)
    got_model, expected_model = load_ckpt(fsdp)["model"], load_ckpt(single)["model"]
    for name, weight in expected_model.items():
        torch.testing.assert_close(got_model[name], weight, atol=1e-3, rtol=0, msg=name)


class CollectivesCounted(TorchDispatchMode):
    """The collectives dispatched inside it, by op name (c10d's and functional collectives', as DTensor uses)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in str(func.overloadpacket):
            self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def sharded_muon_steps(rank):
    """The world's job for the test below: this rank's count of orthogonalizations and the largest difference from
    torch's Muon, in a line."""
    import torch.optim._muon as torch_muon
    from torch.distributed.fsdp import fully_shard

    from gpt import muon
    from gpt.parallel import ShardedMuon

    calls = []
    with pytest.MonkeyPatch.context() as patch, torchrun_group():
        for module, name in ((torch_muon, "_zeropower_via_newtonschulz"), (muon, "orthogonalize")):  # torch's, ours
            patch.setattr(module, name, lambda *args, f=getattr(module, name): calls.append(args[0].shape) or f(*args))
        patch.setattr(muon, "orthogonalize_dtype", lambda device: "bfloat16")  # as torch's Muon, not a CPU's float32
        torch.manual_seed(0)
        shapes = [(8, 6), (6, 5), (5, 4)]  # rows 8, 6 and 5: 5 splits unevenly (3 and 2)
        sharded = torch.nn.Sequential(*[torch.nn.Linear(n_in, n_out, bias=False) for n_out, n_in in shapes[::-1]])
        whole = copy.deepcopy(sharded)
        fully_shard(sharded)
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
        optimizers = [ShardedMuon(sharded.parameters(), lr=0.1, adjust_lr_fn="match_rms_adamw"),
                      torch.optim.Muon(whole.parameters(), lr=0.1, adjust_lr_fn="match_rms_adamw")]
        collectives = CollectivesCounted()
        for step in range(2):
            for model, optimizer in zip((sharded, whole), optimizers):
                model(x).square().sum().backward()
                with collectives if optimizer is optimizers[0] else contextlib.nullcontext():
                    optimizer.step()
                optimizer.zero_grad()
        differences = [(p.full_tensor() - q).abs().max().item() for p, q in zip(sharded.parameters(),
                                                                              whole.parameters())]
        del sharded, optimizers  # before the group: see train.main
    return (f"rank {rank} orthogonalized {len(calls)} max difference {max(differences)} collectives "
            f"{', '.join(collectives.names)}")


def test_sharded_muon_orthogonalizes_each_matrix_once_on_its_owner_and_steps_as_muon(world):
    """gpt.parallel.ShardedMuon on 2 processes: each step, rank 0 orthogonalizes 2 of the 3 matrices and rank 1 the
    other (torch.optim.Muon on the whole model, run beside it in each process, adds 3 a step: 10 and 8 in 2 steps),
    both at once between two all-to-alls a step (each matrix's rows to its owner, its result's rows back), and the
    parameters equal that whole model's exactly after 2 steps (the same bfloat16 arithmetic on the same matrices)."""
    exchanges = ", ".join(["c10d.alltoall_base_"] * 4)  # two a step, whatever the number of matrices
    assert world.result("sharded_muon") == [f"rank 0 orthogonalized 10 max difference 0.0 collectives {exchanges}",
                                            f"rank 1 orthogonalized 8 max difference 0.0 collectives {exchanges}"]


def test_an_fsdp_checkpoint_is_todays_ckpt_pt(world):
    """Gathered to rank 0: every tensor whole, keys and optimizer state in the format one process writes."""
    fsdp, single = load_ckpt(world.out_dir("fsdp")), load_ckpt(world.out_dir("single"))
    assert {k: v.shape for k, v in fsdp["model"].items()} == {k: v.shape for k, v in single["model"].items()}
    for got, expected in zip(fsdp["optimizers"], single["optimizers"]):
        assert got["param_groups"] == expected["param_groups"]
        assert set(got["state"]) == set(expected["state"])  # numbered, not named
        for i, state in expected["state"].items():
            torch.testing.assert_close(got["state"][i]["exp_avg_sq"], state["exp_avg_sq"], atol=1e-7, rtol=1e-3)


def test_fsdp_resumes_exactly(world):
    """3 + 3 iterations under FSDP equal 6 straight; the reductions run in the same order, so within 1e-6."""
    assert_same_run(world.out_dir("fsdp_3_fsdp"), world.out_dir("fsdp"), 1e-6)


def test_fsdp_with_activation_checkpointing_resumes_and_trains_the_same_model(world):
    """FSDP x2's 3 iterations resumed under FSDP x2 with activation checkpointing (each block in torch's
    CheckpointWrapper): the optimizer state loads by the parameters' state-dict names (without the wrapper's
    prefix), the recomputed blocks give the same losses, and its ckpt.pt has the same keys and weights as the
    uninterrupted run without checkpointing, within 1e-6."""
    assert_same_run(world.out_dir("fsdp_3_fsdp_ac"), world.out_dir("fsdp"), 1e-6)


def test_a_run_resumes_on_another_number_of_processes(world, workdir, tmp_path):
    """FSDP x2 -> one process and one process -> FSDP x2 continue as the uninterrupted run within 1e-5: the data
    loader's position is converted to the new number of processes (the same global batches follow)."""
    shutil.copytree(world.out_dir("fsdp_3"), tmp_path / "fsdp_3_single")
    one_process_run(workdir, tmp_path / "fsdp_3_single", *RESUME)
    assert_same_run(tmp_path / "fsdp_3_single", world.out_dir("single"), 1e-5)
    assert_same_run(world.out_dir("single_3_fsdp"), world.out_dir("single"), 1e-5)


def test_ddp_resumes_an_fsdp_checkpoint(world):
    """FSDP x2 for 3 iterations, then DDP x2 to 6: the uninterrupted run within 1e-5 (the other way, FSDP from a
    checkpoint DDP or one process wrote, is the one-process -> FSDP case above: ckpt.pt has one format)."""
    assert_same_run(world.out_dir("fsdp_3_ddp"), world.out_dir("single"), 1e-5)


def test_a_run_resumes_on_nodes_that_share_no_filesystem(world):
    """Each rank runs in a folder of its own, with the data in both and ckpt.pt only where rank 0 wrote it. Rank 0
    reads it and sends it to the other: DDP x2 resumes FSDP's 3 iterations and continues as the uninterrupted run,
    and nothing is written on the other node."""
    world.result("nodes")
    nodes = os.path.join(world.root, "nodes")
    assert not os.path.exists(os.path.join(nodes, "node1", "run"))
    assert_same_run(os.path.join(nodes, "node0", "run"), world.out_dir("single"), 1e-5)


def test_fsdp_in_bfloat16_computes_in_bfloat16_and_keeps_fp32_weights(world, workdir, tmp_path):
    """The MixedPrecisionPolicy path CUDA takes (bf16 compute, fp32 gradient reduction), run with gloo: its losses
    follow one process under bf16 autocast within bf16's rounding, differ from the fp32 run by more than fp32's
    (so the blocks really computed in bf16), and ckpt.pt holds fp32 weights and AdamW state as ever."""
    single_dir = one_process_run(workdir, tmp_path / "single", *BF16)
    fsdp_dir = world.out_dir("fsdp_bf16")
    fsdp, autocast, fp32 = records(fsdp_dir), records(single_dir), records(world.out_dir("single"))
    assert [r["iter"] for r in fsdp] == [r["iter"] for r in autocast] == [r["iter"] for r in fp32]
    losses = [(f["loss"], a["loss"], p["loss"]) for f, a, p in zip(fsdp, autocast, fp32) if "loss" in f]
    assert all(abs(f - a) < 5e-3 for f, a, _ in losses), losses  # measured: 7e-4 at most
    assert max(abs(f - p) for f, _, p in losses) > 1e-4, losses  # measured: 6.7e-4; fp32 compute is within 1e-5
    checkpoint = load_ckpt(fsdp_dir)
    assert all(t.dtype == torch.float32 for t in checkpoint["model"].values())
    assert all(s["exp_avg"].dtype == torch.float32 for s in checkpoint["optimizers"][0]["state"].values())


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_under_gloo_shards_on_the_cpu_where_torch_has_cuda(fake_cuda):
    """fully_shard's default mesh follows the build's accelerator: on a CUDA machine a gloo run (these tests, the
    GPU check's) would put its parameters on a GPU. shard() gives the mesh of the model's device."""
    fake_cuda()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = shard(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_kv_head=1, n_embd=16)),
                      torch.float32)
        assert {(p.device_mesh.device_type, p.device.type) for p in model.parameters()} == {("cpu", "cpu")}
        idx = torch.randint(0, 64, (2, 8))
        model(idx, idx)[1].backward()  # gathers and reduces on the CPU
    finally:
        dist.destroy_process_group()


UNTIED = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, tie_embeddings=False)


def cpu_run_optimizer_states(config=UNTIED):
    """The model and optimizer states of one step of a run on the CPU (unfused AdamW, as make_optimizers picks there)."""
    torch.manual_seed(0)
    model = GPT(config)
    optimizers = train.make_optimizers(model, ADAMW, "cpu")
    idx = torch.randint(0, config.vocab_size, (2, config.block_size))
    model(idx, idx)[1].backward()
    train.optimizer_step(model, optimizers, torch.amp.GradScaler("cpu", enabled=False), 1.0, 1e-3)
    assert optimizers[0].param_groups[0]["fused"] is False
    return model, full_optimizer_states(model, optimizers), idx


def test_a_cpu_checkpoint_resumes_with_fused_adamw_and_float16_loss_scaling():
    """A CPU (or Mac) run resumed on CUDA: make_optimizers builds fused AdamW, and the checkpoint's param groups say
    unfused. They must not replace this run's choice: AdamW decided in its constructor that the gradient scaler hands
    its step found_inf (fused only), so an unfused step under float16's scaler raised "Expected grad_scale and
    found_inf to be None". CPU tensors stand in for CUDA's (fused AdamW and a GradScaler run on the CPU in torch 2.13)."""
    saved, states, idx = cpu_run_optimizer_states()
    steps = {}
    for fused in (False, True):  # this run's AdamW: as on a CPU, and as on CUDA
        model = GPT(UNTIED)
        model.load_state_dict(saved.state_dict())
        optimizers = train.make_optimizers(model, ADAMW, "cuda" if fused else "cpu")
        load_optimizer_states(model, optimizers, copy.deepcopy(states))  # AdamW steps the loaded tensors in place
        assert [group["fused"] for group in optimizers[0].param_groups] == [fused] * 2
        scaler = torch.amp.GradScaler("cpu", enabled=True)  # float16's loss scaling
        scaler.scale(model(idx, idx)[1]).backward()
        train.optimizer_step(model, optimizers, scaler, 1.0, 1e-3)
        steps[fused] = [p.detach().clone() for p in model.parameters()]
    for unfused, fused in zip(steps[False], steps[True]):  # the same step: the saved moments were used by both
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6)


def test_a_resumed_fused_adamw_keeps_its_step_count_on_the_gpu():
    """Fused AdamW on CUDA needs each parameter's step count on the GPU; load_state_dict puts it there only for a
    param group the checkpoint says is fused. CUDA tensors of torch's FakeTensorMode (no GPU, no memory) show where
    it lands."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    _, states, _ = cpu_run_optimizer_states()
    with torch.device("meta"):
        model = GPT(UNTIED)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda")
        optimizers = train.make_optimizers(model, ADAMW, "cuda")
        load_optimizer_states(model, optimizers, states)
        for group in optimizers[0].param_groups:
            assert group["fused"] is True
            for param in group["params"]:
                assert {name: t.device.type for name, t in optimizers[0].state[param].items()} == \
                    dict(step="cuda", exp_avg="cuda", exp_avg_sq="cuda")


def fsdp_resumes_a_cpu_run(rank):
    """The world's job for the test below: the groups' fused flags after the load, and whether every parameter got
    its 3 tensors of AdamW state."""
    _, states, _ = cpu_run_optimizer_states()  # the same on both ranks
    with torchrun_group():
        model = shard(GPT(UNTIED), torch.float32)
        optimizers = train.make_optimizers(model, ADAMW, "cuda")
        load_optimizer_states(model, optimizers, states)
        result = (f"{[group['fused'] for group in optimizers[0].param_groups]} "
                  f"{all(len(optimizers[0].state[p]) == 3 for p in model.parameters())}")
        del model, optimizers  # before the group: see train.main
    return result


def test_fsdp_resumes_a_cpu_checkpoint_with_this_runs_optimizer_flags(world):
    """The same under FSDP (set_optimizer_state_dict), 2 gloo processes: the groups keep the flags make_optimizers
    set, and every parameter's moments are loaded."""
    assert world.result("fsdp_resumes_a_cpu_run") == ["[True, True] True"] * 2


def test_optimizer_state_names_and_numbers_convert_both_ways():
    state = {"state": {0: {"step": torch.tensor(1.0)}, 2: {"step": torch.tensor(2.0)}},
             "param_groups": [{"lr": 1.0, "params": [0, 1]}, {"lr": 2.0, "params": [2]}]}
    named = by_name(state, ["a.weight", "b.weight", "c.bias"])
    assert set(named["state"]) == {"a.weight", "c.bias"} and named["param_groups"][1]["params"] == ["c.bias"]
    assert by_index(named) == state


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    """With dropout: the recomputed forward must draw the same masks (torch.utils.checkpoint keeps the RNG state)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, dropout=0.1)
    plain, checkpointed = GPT(config), GPT(config)
    checkpointed.load_state_dict(plain.state_dict())
    checkpoint_blocks(checkpointed)
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    losses = []
    for model in (plain, checkpointed):
        torch.manual_seed(1)
        losses.append(model(x, y)[1])
        losses[-1].backward()
    assert abs(losses[0].item() - losses[1].item()) < 1e-6
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=0, msg=name)


def test_activation_checkpointing_recomputes_each_block_in_the_backward_pass():
    """It really checkpoints: each block runs twice per training step (once more in backward)."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=32))
    calls = []
    for block in model.layers:
        block.register_forward_pre_hook(lambda module, args: calls.append(module.self_attn.layer_idx))
    checkpoint_blocks(model)
    model(torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16)))[1].backward()
    assert sorted(calls) == [0, 0, 1, 1]


@contextlib.contextmanager
def process_group_of_one():
    """A gloo group of this process alone: FSDP (shard) runs in it, in this process."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


TINY_CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_kv_head=1, n_embd=16)


def test_activation_checkpointing_keeps_a_plain_gpts_state_dict():
    """checkpoint_blocks puts each block inside torch's CheckpointWrapper (print(model) shows it), whose hooks leave
    its prefix out of the state dict: a checkpointed run's ckpt.pt (full_model_state, in one process or gathered
    under FSDP) has a plain GPT's keys, so sample.py and export.py load it, and it loads back into a checkpointed
    model (a resume)."""
    plain, checkpointed = GPT(TINY_CONFIG), GPT(TINY_CONFIG)
    checkpoint_blocks(checkpointed)
    assert "CheckpointWrapper(" in repr(checkpointed) and "Block(" in repr(checkpointed)
    keys = list(plain.state_dict())
    assert list(full_model_state(checkpointed)) == keys
    plain.load_state_dict(full_model_state(checkpointed))  # strict: every key, none left over
    checkpointed.load_state_dict(plain.state_dict())
    with process_group_of_one():
        sharded = shard(checkpointed, torch.float32)
        assert list(full_model_state(sharded)) == keys
        plain.load_state_dict(full_model_state(sharded))


def fsdp_ac_loads_an_optimizer_state(rank):
    """The world's job for the test below: on rank 0, whether the optimizer state gathered back after the load is
    the saved one."""
    torch.manual_seed(0)  # the same saved run on both ranks: one AdamW step of a plain GPT
    saved = GPT(TINY_CONFIG)
    optimizer = torch.optim.AdamW(saved.parameters())
    idx = torch.randint(0, 64, (2, 8))
    saved(idx, idx)[1].backward()
    optimizer.step()
    states = [optimizer.state_dict()]
    with torchrun_group():
        model = GPT(TINY_CONFIG)
        model.load_state_dict(saved.state_dict())
        checkpoint_blocks(model)
        shard(model, torch.float32)
        optimizers = [torch.optim.AdamW(model.parameters())]
        load_optimizer_states(model, optimizers, copy.deepcopy(states))
        loaded = full_optimizer_states(model, optimizers)[0]  # gathered back to rank 0
        del model, optimizers  # before the group: see train.main
    if rank != 0:
        return ""
    same = set(loaded["state"]) == set(states[0]["state"]) and all(
        torch.equal(loaded["state"][i][key], state[key]) for i, state in states[0]["state"].items()
        for key in ("exp_avg", "exp_avg_sq"))
    return f"{same}"


def test_fsdp_with_activation_checkpointing_loads_a_plain_runs_optimizer_state(world):
    """2 gloo processes: the optimizer state goes in by the parameters' names as the state dict has them, while
    named_parameters() of a checkpointed model holds the wrapper's prefix (layers.0._checkpoint_wrapped_module...),
    which torch.distributed.checkpoint leaves out. Every parameter gets its saved moments back, each rank its shard.
    (In the world's processes, not this one: here, after test_fsdp_under_gloo_shards_on_the_cpu_where_torch_has_cuda,
    shard() got a mesh naming a group of that test's destroyed process group, and loading failed to resolve it.)"""
    assert world.result("fsdp_ac_loads_an_optimizer_state")[0] == "True"


def forward_replaced(model):
    """The modules whose forward something set from outside (an instance attribute, which print(model) and
    model.py do not show)."""
    return [name or "model" for name, module in model.named_modules() if "forward" in vars(module)]


@pytest.mark.parametrize("fsdp", [False, True])
def test_nothing_replaces_a_modules_forward(fsdp):
    """Activation checkpointing and compilation change the model where a reader looks: checkpoint_blocks swaps in
    a module (CheckpointWrapper), compile_blocks uses each block's own compile(); no module's forward is replaced.
    The step still runs, compiled, and each block's graph holds the checkpointed region (Dynamo traced the
    checkpoint: its recomputation is the compiler's, not an eager call around compiled code)."""
    graphs = []

    def backend(graph, inputs):  # what torch.compile hands a backend: a graph it traced, to run as it is
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    try:
        model = GPT(TINY_CONFIG)
        checkpoint_blocks(model)
        compile_blocks(model, backend=backend)
        with process_group_of_one() if fsdp else contextlib.nullcontext():
            if fsdp:
                shard(model, torch.float32)
            assert forward_replaced(model) == []
            idx = torch.randint(0, 64, (2, 8))
            model(idx, idx)[1].backward()
            assert forward_replaced(model) == []
    finally:
        torch._dynamo.reset()
    checkpointed = torch.ops.higher_order.tag_activation_checkpoint
    assert graphs and all(checkpointed in [node.target for node in graph.graph.nodes] for graph in graphs), graphs


def bytes_per_process(mode):
    """The world's job for the test below: the bytes of this process's parameters, gradients and AdamW state after a
    step of a model under mode, ddp or fsdp."""
    with torchrun_group():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=64))
        model = shard(model, torch.float32) if mode == "fsdp" else wrap_ddp(model, "cpu")
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))[1].backward()
        optimizer.step()
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
        tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        total = sum(local(t).numel() * local(t).element_size() for t in tensors)
        del model, optimizer, tensors  # before the group: see train.main
    return f"{total}"


def test_fsdp_holds_about_half_of_ddps_bytes_per_process(world):
    """Parameters, gradients and AdamW state on each of 2 processes: all of them under DDP, half under FSDP."""
    per_process = {mode: [int(n) for n in world.result(f"bytes_{mode}")] for mode in ("ddp", "fsdp")}
    print(f"bytes per process: DDP {per_process['ddp']}, FSDP {per_process['fsdp']}")
    assert len(per_process["ddp"]) == len(per_process["fsdp"]) == 2
    for ddp, fsdp in zip(per_process["ddp"], per_process["fsdp"]):
        assert 0.45 < fsdp / ddp < 0.55, (fsdp, ddp)


# ----------------------------------------------------------------------------------------------------
# Settings that cannot run


def test_fsdp_without_torchrun_is_a_one_line_error(workdir, tmp_path):
    """`python train.py ... --fsdp=True` (run in this process: run_script)."""
    result = run_script(TRAIN, [*RUN, f"--out_dir={tmp_path}", "--fsdp=True"], workdir)
    assert_one_line_error(result, "torchrun", "--nproc_per_node")
    assert not os.path.exists(os.path.join(tmp_path, "ckpt.pt"))


def test_float16_with_fsdp_is_refused_naming_a_dtype_the_card_runs():
    with pytest.raises(UserError, match="pass --dtype=bfloat16 or float32"):  # float16 asked for
        check_fsdp("float16", True, torch.float16)
    with pytest.raises(UserError, match=r"pass --dtype=float32 \(this card has no bfloat16\)"):  # a T4, auto
        check_fsdp("auto", True, torch.float16)
    check_fsdp("auto", True, torch.float32)  # nothing to refuse


def torchrun_errors(workdir, out_dir, processes, device):
    """The "error: " lines of a torchrun train.py run that must fail before its process group starts."""
    args = [a for a in TINY if not a.startswith("--device")] + [f"--device={device}", f"--out_dir={out_dir}"]
    # torchrun stops the other processes at its first look after one fails (every 0.1 s): a process still importing
    # torch under load was stopped before its line (a suite run saw one line of two). Started by sh with SIGTERM
    # ignored (exec keeps that, and Python leaves it so), each ends on its own instead, its line said, and torchrun
    # then ends the run; one left waiting for the others would be killed 30 s on (torchrun's SIGKILL), its line missing
    ignoring_sigterm = ["--no-python", "sh", "-c", 'trap "" TERM; exec "$0" "$@"', sys.executable]
    result = subprocess.run([*TORCHRUN[:-1], f"--nproc_per_node={processes}", *ignoring_sigterm, TRAIN, *args],
                            cwd=workdir, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode != 0
    # the processes share one stderr, where under load one's line can run into another's before its newline
    return re.findall(r"error: .*?(?=error: |$)", result.stderr, flags=re.M), result.stderr


def test_more_processes_than_gpus_is_one_line_on_every_rank(fake_cuda, workdir, tmp_path, monkeypatch):  # noqa: F811
    """README's torchrun --nproc_per_node=8 on a machine with fewer GPUs (1, faked: the fewest processes that show it):
    each process says so in one line before the process group starts (no "invalid device ordinal" traceback, no rank
    left waiting for the others)."""
    fake_cuda()
    monkeypatch.setenv("FAKE_CUDA_GPUS", "1")  # torchrun's processes see one card
    errors, output = torchrun_errors(workdir, tmp_path, 2, "cuda")
    assert errors == ["error: torchrun started 2 processes on this node, but it has 1 CUDA GPU(s), one per process; "
                      "pass --nproc_per_node=1"] * 2, output
    assert "invalid device ordinal" not in output and "NCCL" not in output
