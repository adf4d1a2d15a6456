"""Tests for parallel.py and train.py's fsdp and activation_checkpointing settings, with 2 gloo processes on CPU:
FSDP x2, DDP x2 and one process with the same global batch train the same model; ckpt.pt keeps one format, so a run
resumes under FSDP, DDP or one process whatever wrote it; FSDP holds about half the bytes per process; activation
checkpointing leaves the loss and gradients as they were; the settings that cannot run are one-line errors."""

import contextlib
import copy
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import train
from gpt import UserError
from gpt.parallel import (by_index, by_name, check_fsdp, checkpoint_blocks, compile_blocks, full_model_state,
                          full_optimizer_states, load_optimizer_states, shard)
from model import GPT, GPTConfig
from test_train import workdir  # noqa: F401
from test_train import TINY, TRAIN, TWO_PROCESSES, assert_one_line_error, in_background, in_dir, load_ckpt, records

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 layers (so that there are two sharded blocks), no dropout (processes draw different masks), global batch 2 x 4
RUN = TINY + TWO_PROCESSES + ["--n_layer=2", "--dropout=0.0", "--gradient_accumulation_steps=2", "--eval_interval=3"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def torchrun(workdir, out_dir, log_path, *args):
    """A 2-process train.py run in the background (a context manager yielding the process)."""
    return in_background([*TORCHRUN, TRAIN, *RUN, f"--out_dir={out_dir}", *args], workdir, log_path)


def finish(proc, log_path):
    proc.wait(timeout=300)
    with open(log_path) as f:
        output = f.read()
    assert proc.returncode == 0, output
    return output


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


@pytest.fixture(scope="module")
def runs(workdir, tmp_path_factory):
    """out_dirs of: 6 iterations in one process, with DDP x2 and with FSDP x2; 3 iterations in one process and with
    FSDP x2; and those resumed to 6: the FSDP one under FSDP, DDP and in one process, the single one under FSDP."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {name: str(root / name) for name in ("single", "ddp", "fsdp", "single_3", "fsdp_3", "fsdp_3_fsdp",
                                                "fsdp_3_single", "fsdp_3_ddp", "single_3_fsdp", "fsdp_3_fsdp_ac")}
    logs = {name: str(root / f"{name}.txt") for name in dirs}
    with torchrun(workdir, dirs["fsdp"], logs["fsdp"], "--max_iters=6", "--fsdp=True") as fsdp, \
            torchrun(workdir, dirs["fsdp_3"], logs["fsdp_3"], "--max_iters=3", "--fsdp=True") as fsdp_3:
        with in_dir(workdir):  # the one-process runs meanwhile, in this process
            train.main(RUN + [f"--out_dir={dirs['single']}", "--max_iters=6"])
            train.main(RUN + [f"--out_dir={dirs['single_3']}", "--max_iters=3"])
        finish(fsdp_3, logs["fsdp_3"])
        assert "2 process(es) on cpu" in finish(fsdp, logs["fsdp"])
    for source, target in (("fsdp_3", "fsdp_3_fsdp"), ("fsdp_3", "fsdp_3_single"), ("fsdp_3", "fsdp_3_ddp"),
                           ("single_3", "single_3_fsdp"), ("fsdp_3", "fsdp_3_fsdp_ac")):
        subprocess.run(["cp", "-r", dirs[source], dirs[target]], check=True)
    resume = ["--max_iters=6", "--init_from=resume"]
    # DDP's global batch given as one micro-step of 8 sequences, which its 2 processes split into 4 each
    # (gpt.parallel.split_over_processes), the others' as 2 micro-steps of 4: the same 2 x 4 x 32 tokens
    ddp_batch = ["--gradient_accumulation_steps=1", "--batch_size=8"]
    with torchrun(workdir, dirs["ddp"], logs["ddp"], "--max_iters=6", *ddp_batch) as ddp, \
            torchrun(workdir, dirs["fsdp_3_fsdp"], logs["fsdp_3_fsdp"], *resume, "--fsdp=True") as fsdp_resumed:
        with in_dir(workdir):
            train.main(RUN + [f"--out_dir={dirs['fsdp_3_single']}", *resume])
        assert "the global batch of 8 sequences of 32 tokens is 4 on each of 2 processes" in finish(ddp, logs["ddp"])
        finish(fsdp_resumed, logs["fsdp_3_fsdp"])
    with torchrun(workdir, dirs["single_3_fsdp"], logs["single_3_fsdp"], *resume, "--fsdp=True") as proc, \
            torchrun(workdir, dirs["fsdp_3_ddp"], logs["fsdp_3_ddp"], *resume) as ddp_resumed:
        finish(proc, logs["single_3_fsdp"])
        finish(ddp_resumed, logs["fsdp_3_ddp"])
    with torchrun(workdir, dirs["fsdp_3_fsdp_ac"], logs["fsdp_3_fsdp_ac"], *resume, "--fsdp=True",
                  "--activation_checkpointing=True") as proc:
        finish(proc, logs["fsdp_3_fsdp_ac"])
    return dirs


def test_fsdp_ddp_and_one_process_train_the_same_model(runs):
    """The same global batch (2 processes x 1 micro-step, or 1 x 2; DDP's split from one micro-step), the same losses
    and final weights within 1e-5 (fp32; the sums run in another order). Measured: 7.3e-6 at most in the weights
    after 6 AdamW steps."""
    assert_same_run(runs["fsdp"], runs["single"], 1e-5)
    assert_same_run(runs["ddp"], runs["single"], 1e-5)


def test_muon_under_fsdp_trains_and_resumes_as_one_process_does(workdir, tmp_path):
    """optimizer=muon with fsdp=True (gpt.parallel.ShardedMuon: each matrix orthogonalized whole by one rank): 3
    iterations, resumed to 6 under FSDP, give one process's 6 iterations with gpt.muon.Muon: the same losses within
    1e-5, so its state saves and loads as Muon's. Gradient norms and weights within 1e-3 only: where Newton-Schulz
    runs in bfloat16 (torch's choice), gradients summed in another order can round an update element to the next
    bfloat16 (measured: 5.7e-6 in the losses, 1.0e-4 in a gradient norm, 1.9e-4 in the weights; DDP with
    torch.optim.Muon differs from one process as much)."""
    muon, dirs = ["--optimizer=muon"], {name: str(tmp_path / name) for name in ("single", "fsdp")}
    with torchrun(workdir, dirs["fsdp"], str(tmp_path / "fsdp.txt"), "--max_iters=3", "--fsdp=True", *muon) as proc:
        with in_dir(workdir):
            train.main(RUN + [f"--out_dir={dirs['single']}", "--max_iters=6", *muon])
        finish(proc, str(tmp_path / "fsdp.txt"))
    with torchrun(workdir, dirs["fsdp"], str(tmp_path / "resumed.txt"), "--max_iters=6", "--fsdp=True",
                  "--init_from=resume", *muon) as proc:
        finish(proc, str(tmp_path / "resumed.txt"))
    got, expected = records(dirs["fsdp"]), records(dirs["single"])
    assert [r["iter"] for r in got] == [r["iter"] for r in expected]
    for g, e in zip(got, expected):
        for key, tolerance in (("loss", 1e-5), ("train_loss", 1e-5), ("val_loss", 1e-5), ("grad_norm", 1e-3)):
            if key in e:
                assert abs(g[key] - e[key]) < tolerance, (key, g, e)
    got_model, expected_model = load_ckpt(dirs["fsdp"])["model"], load_ckpt(dirs["single"])["model"]
    for name, weight in expected_model.items():
        torch.testing.assert_close(got_model[name], weight, atol=1e-3, rtol=0, msg=name)


SHARDED_MUON = """
import copy, sys, torch, torch.distributed as dist, torch.optim._muon as torch_muon
sys.path.insert(0, ROOT)
from torch.distributed.fsdp import fully_shard
from gpt import muon
from gpt.parallel import ShardedMuon
dist.init_process_group("gloo")
calls = []
for module, name in ((torch_muon, "_zeropower_via_newtonschulz"), (muon, "orthogonalize")):  # torch's and ours
    setattr(module, name, lambda *args, f=getattr(module, name): calls.append(args[0].shape) or f(*args))
muon.orthogonalize_dtype = lambda device: "bfloat16"  # as torch's Muon, not a CPU's float32
torch.manual_seed(0)
shapes = [(8, 6), (6, 5), (5, 4)]  # rows 8, 6 and 5: 5 splits unevenly (3 and 2)
sharded = torch.nn.Sequential(*[torch.nn.Linear(n_in, n_out, bias=False) for n_out, n_in in shapes[::-1]])
whole = copy.deepcopy(sharded)
fully_shard(sharded)
x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
optimizers = [ShardedMuon(sharded.parameters(), lr=0.1, adjust_lr_fn="match_rms_adamw"),
              torch.optim.Muon(whole.parameters(), lr=0.1, adjust_lr_fn="match_rms_adamw")]
for step in range(2):
    for model, optimizer in zip((sharded, whole), optimizers):
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
differences = [(p.full_tensor() - q).abs().max().item() for p, q in zip(sharded.parameters(), whole.parameters())]
lines = [None, None]  # gathered to rank 0, which prints both: two processes' prints would interleave
dist.all_gather_object(lines, f"rank {dist.get_rank()} orthogonalized {len(calls)} max difference {max(differences)}")
if dist.get_rank() == 0:
    print("\\n".join(lines), flush=True)
dist.destroy_process_group()
"""


def test_sharded_muon_orthogonalizes_each_matrix_once_on_its_owner_and_steps_as_muon(tmp_path):
    """gpt.parallel.ShardedMuon on 2 processes: each step, rank 0 orthogonalizes 2 of the 3 matrices and rank 1 the
    other (torch.optim.Muon on the whole model, run beside it in each process, adds 3 a step), and the parameters
    equal that whole model's exactly after 2 steps (the same bfloat16 arithmetic on the same whole matrices)."""
    script = tmp_path / "sharded_muon.py"
    script.write_text(f"ROOT = {ROOT!r}\n" + SHARDED_MUON)
    result = subprocess.run([*TORCHRUN, str(script)], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 orthogonalized 10 max difference 0.0",  # (2 owned + 3 whole) x 2 steps
                     "rank 1 orthogonalized 8 max difference 0.0"], result.stdout + result.stderr  # (1 + 3) x 2


def test_an_fsdp_checkpoint_is_todays_ckpt_pt(runs):
    """Gathered to rank 0: every tensor whole, keys and optimizer state in the format one process writes."""
    fsdp, single = load_ckpt(runs["fsdp"]), load_ckpt(runs["single"])
    assert {k: v.shape for k, v in fsdp["model"].items()} == {k: v.shape for k, v in single["model"].items()}
    for got, expected in zip(fsdp["optimizers"], single["optimizers"]):
        assert got["param_groups"] == expected["param_groups"]
        assert set(got["state"]) == set(expected["state"])  # numbered, not named
        for i, state in expected["state"].items():
            torch.testing.assert_close(got["state"][i]["exp_avg_sq"], state["exp_avg_sq"], atol=1e-7, rtol=1e-3)


def test_fsdp_resumes_exactly(runs):
    """3 + 3 iterations under FSDP equal 6 straight; the reductions run in the same order, so within 1e-6."""
    assert_same_run(runs["fsdp_3_fsdp"], runs["fsdp"], 1e-6)


def test_fsdp_with_activation_checkpointing_resumes_and_trains_the_same_model(runs):
    """FSDP x2's 3 iterations resumed under FSDP x2 with activation checkpointing (each block in torch's
    CheckpointWrapper): the optimizer state loads by the parameters' state-dict names (without the wrapper's
    prefix), the recomputed blocks give the same losses, and its ckpt.pt has the same keys and weights as the
    uninterrupted run without checkpointing, within 1e-6."""
    assert_same_run(runs["fsdp_3_fsdp_ac"], runs["fsdp"], 1e-6)


def test_a_run_resumes_on_another_number_of_processes(runs):
    """FSDP x2 -> one process and one process -> FSDP x2 continue as the uninterrupted run within 1e-5: the data
    loader's position is converted to the new number of processes (the same global batches follow)."""
    assert_same_run(runs["fsdp_3_single"], runs["single"], 1e-5)
    assert_same_run(runs["single_3_fsdp"], runs["single"], 1e-5)


def test_ddp_resumes_an_fsdp_checkpoint(runs):
    """FSDP x2 for 3 iterations, then DDP x2 to 6: the uninterrupted run within 1e-5 (the other way, FSDP from a
    checkpoint DDP or one process wrote, is the one-process -> FSDP case above: ckpt.pt has one format)."""
    assert_same_run(runs["fsdp_3_ddp"], runs["single"], 1e-5)


ON_ITS_OWN_NODE = """import os, runpy, sys
os.chdir(f"node{{os.environ['RANK']}}")  # each rank in a folder of its own: nodes that share no filesystem
sys.path.insert(0, {root!r})
sys.argv = [{train!r}] + sys.argv[1:]
runpy.run_path({train!r}, run_name="__main__")
"""


def test_a_run_resumes_on_nodes_that_share_no_filesystem(runs, workdir, tmp_path):  # noqa: F811
    """Each rank runs in a folder of its own, with the data in both and ckpt.pt only where rank 0 wrote it. Rank 0
    reads it and sends it to the other: DDP x2 resumes FSDP's 3 iterations and continues as the uninterrupted run,
    and nothing is written on the other node."""
    for node in ("node0", "node1"):
        shutil.copytree(workdir / "data", tmp_path / node / "data")
    shutil.copytree(runs["fsdp_3"], tmp_path / "node0" / "run")
    script = tmp_path / "on_its_own_node.py"
    script.write_text(ON_ITS_OWN_NODE.format(root=ROOT, train=TRAIN))
    log = tmp_path / "log.txt"
    with in_background([*TORCHRUN, str(script), *RUN, "--out_dir=run", "--max_iters=6", "--init_from=resume"],
                       tmp_path, log) as proc:
        finish(proc, log)
    assert not (tmp_path / "node1" / "run").exists()
    assert_same_run(tmp_path / "node0" / "run", runs["single"], 1e-5)


SEND_A_FILE = r"""import os, sys, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from gpt import parallel
parallel.BROADCAST_CHUNK = 1000
sizes, broadcast = [], dist.broadcast
dist.broadcast = lambda tensor, src: sizes.append(tensor.numel()) or broadcast(tensor, src)
dist.init_process_group("gloo")
rank = dist.get_rank()
data = parallel.file_from_rank0(sys.argv[2] if rank == 0 else "no such file", "cpu")
missing = parallel.file_from_rank0(os.path.join(sys.argv[3], "missing"), "cpu")
with open(os.path.join(sys.argv[3], f"rank{rank}"), "wb") as f:
    f.write(bytes(data))
with open(os.path.join(sys.argv[3], f"rank{rank}.txt"), "w") as f:  # not stdout: the ranks' lines interleave
    f.write(f"{sizes} {missing}")
dist.destroy_process_group()
"""


def test_a_file_goes_to_every_rank_in_chunks(tmp_path):
    """Resuming on nodes without a shared filesystem, rank 0 sends ckpt.pt: in BROADCAST_CHUNK pieces (a GPU
    holds one piece, not the whole file), every rank ending with rank 0's bytes; a file rank 0 cannot read is None
    on every rank."""
    file = tmp_path / "file.bin"
    file.write_bytes(os.urandom(2500))
    (tmp_path / "send.py").write_text(SEND_A_FILE)
    result = subprocess.run([*TORCHRUN, str(tmp_path / "send.py"), ROOT, str(file), str(tmp_path)],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_bytes() == file.read_bytes()
        assert (tmp_path / f"rank{rank}.txt").read_text() == "[1, 1000, 1000, 500, 1] None"


def test_fsdp_in_bfloat16_computes_in_bfloat16_and_keeps_fp32_weights(runs, workdir, tmp_path):
    """The MixedPrecisionPolicy path CUDA takes (bf16 compute, fp32 gradient reduction), run with gloo: its losses
    follow one process under bf16 autocast within bf16's rounding, differ from the fp32 run by more than fp32's
    (so the blocks really computed in bf16), and ckpt.pt holds fp32 weights and AdamW state as ever."""
    bf16 = ["--max_iters=6", "--dtype=bfloat16"]
    fsdp_dir, single_dir = str(tmp_path / "fsdp"), str(tmp_path / "single")
    with torchrun(workdir, fsdp_dir, str(tmp_path / "fsdp.txt"), *bf16, "--fsdp=True") as proc:
        with in_dir(workdir):
            train.main(RUN + [f"--out_dir={single_dir}", *bf16])
        finish(proc, str(tmp_path / "fsdp.txt"))
    fsdp, autocast, fp32 = records(fsdp_dir), records(single_dir), records(runs["single"])
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
    optimizers = train.make_optimizers(model, "adamw", 0.1, (0.9, 0.95), "cpu")
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
        optimizers = train.make_optimizers(model, "adamw", 0.1, (0.9, 0.95), "cuda" if fused else "cpu")
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
        optimizers = train.make_optimizers(model, "adamw", 0.1, (0.9, 0.95), "cuda")
        load_optimizer_states(model, optimizers, states)
        for group in optimizers[0].param_groups:
            assert group["fused"] is True
            for param in group["params"]:
                assert {name: t.device.type for name, t in optimizers[0].state[param].items()} == \
                    dict(step="cuda", exp_avg="cuda", exp_avg_sq="cuda")


FSDP_RESUMES_A_CPU_RUN = r"""import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import train
from model import GPT
from gpt.parallel import load_optimizer_states, shard
from test_parallel import UNTIED, cpu_run_optimizer_states
_, states, _ = cpu_run_optimizer_states()  # the same on both ranks
dist.init_process_group("gloo")
model = shard(GPT(UNTIED), torch.float32)
optimizers = train.make_optimizers(model, "adamw", 0.1, (0.9, 0.95), "cuda")
load_optimizer_states(model, optimizers, states)
with open(f"{sys.argv[2]}/rank{dist.get_rank()}", "w") as f:  # not stdout: the ranks' lines interleave
    f.write(f"{[group['fused'] for group in optimizers[0].param_groups]} "
            f"{all(len(optimizers[0].state[p]) == 3 for p in model.parameters())}")
dist.destroy_process_group()
"""


def test_fsdp_resumes_a_cpu_checkpoint_with_this_runs_optimizer_flags(tmp_path):
    """The same under FSDP (set_optimizer_state_dict), 2 gloo processes: the groups keep the flags make_optimizers
    set, and every parameter's moments are loaded."""
    (tmp_path / "resume.py").write_text(FSDP_RESUMES_A_CPU_RUN)
    result = subprocess.run([*TORCHRUN, str(tmp_path / "resume.py"), ROOT, str(tmp_path)], capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == "[True, True] True"


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


FSDP_AC_LOADS_AN_OPTIMIZER_STATE = r"""import copy, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from model import GPT, GPTConfig
from gpt.parallel import checkpoint_blocks, full_optimizer_states, load_optimizer_states, shard
config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_kv_head=1, n_embd=16)
torch.manual_seed(0)  # the same saved run on both ranks: one AdamW step of a plain GPT
saved = GPT(config)
optimizer = torch.optim.AdamW(saved.parameters())
idx = torch.randint(0, 64, (2, 8))
saved(idx, idx)[1].backward()
optimizer.step()
states = [optimizer.state_dict()]
dist.init_process_group("gloo")
model = GPT(config)
model.load_state_dict(saved.state_dict())
checkpoint_blocks(model)
shard(model, torch.float32)
optimizers = [torch.optim.AdamW(model.parameters())]
load_optimizer_states(model, optimizers, copy.deepcopy(states))
loaded = full_optimizer_states(model, optimizers)[0]  # gathered back to rank 0
if dist.get_rank() == 0:
    same = set(loaded["state"]) == set(states[0]["state"]) and all(
        torch.equal(loaded["state"][i][key], state[key]) for i, state in states[0]["state"].items()
        for key in ("exp_avg", "exp_avg_sq"))
    with open(sys.argv[2], "w") as f:
        f.write(f"{same}")
dist.destroy_process_group()
"""


def test_fsdp_with_activation_checkpointing_loads_a_plain_runs_optimizer_state(tmp_path):
    """2 gloo processes: the optimizer state goes in by the parameters' names as the state dict has them, while
    named_parameters() of a checkpointed model holds the wrapper's prefix (layers.0._checkpoint_wrapped_module...),
    which torch.distributed.checkpoint leaves out. Every parameter gets its saved moments back, each rank its shard.
    (Processes of its own: in this one, after test_fsdp_under_gloo_shards_on_the_cpu_where_torch_has_cuda,
    shard() got a mesh naming a group of that test's destroyed process group, and loading failed to resolve it.)"""
    (tmp_path / "load.py").write_text(FSDP_AC_LOADS_AN_OPTIMIZER_STATE)
    result = subprocess.run([*TORCHRUN, str(tmp_path / "load.py"), ROOT, str(tmp_path / "result")],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "result").read_text() == "True"


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


BYTES_PER_PROCESS = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from model import GPT, GPTConfig
from gpt.parallel import shard, wrap_ddp
dist.init_process_group("gloo")
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=64))
model = shard(model, torch.float32) if sys.argv[1] == "fsdp" else wrap_ddp(model, "cpu")
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))[1].backward()
optimizer.step()
local = lambda t: t.to_local() if hasattr(t, "to_local") else t
tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
os.write(1, f"{{sum(local(t).numel() * local(t).element_size() for t in tensors)}}\n".encode())  # one write
del model, optimizer, tensors  # before the group: see train.main
dist.destroy_process_group()
"""


def test_fsdp_holds_about_half_of_ddps_bytes_per_process(tmp_path):
    """Parameters, gradients and AdamW state on each of 2 processes: all of them under DDP, half under FSDP."""
    script = tmp_path / "bytes.py"
    script.write_text(BYTES_PER_PROCESS.format(root=ROOT))
    per_process = {}
    for mode in ("ddp", "fsdp"):
        result = subprocess.run([*TORCHRUN, str(script), mode], capture_output=True, text=True, timeout=300,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert result.returncode == 0, result.stderr
        per_process[mode] = [int(line) for line in result.stdout.split()]
    print(f"bytes per process: DDP {per_process['ddp']}, FSDP {per_process['fsdp']}")
    assert len(per_process["ddp"]) == len(per_process["fsdp"]) == 2
    for ddp, fsdp in zip(per_process["ddp"], per_process["fsdp"]):
        assert 0.45 < fsdp / ddp < 0.55, (fsdp, ddp)


# ----------------------------------------------------------------------------------------------------
# Settings that cannot run


def test_fsdp_without_torchrun_is_a_one_line_error(workdir, tmp_path):
    result = subprocess.run([sys.executable, TRAIN, *RUN, f"--out_dir={tmp_path}", "--fsdp=True"], cwd=workdir,
                            capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
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
    # torchrun stops the other processes at its first look after one fails (every 0.1 s by default): a process still
    # importing torch under load was stopped before its line (a suite run saw one line of two); every 10 s instead
    monitor = "--monitor-interval=10"
    result = subprocess.run([*TORCHRUN[:-1], monitor, f"--nproc_per_node={processes}", TRAIN, *args], cwd=workdir,
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode != 0
    # the processes share one stderr, where under load one's line can run into another's before its newline
    return re.findall(r"error: .*?(?=error: |$)", result.stderr, flags=re.M), result.stderr


def test_more_processes_than_gpus_is_one_line_on_every_rank(fake_cuda, workdir, tmp_path):  # noqa: F811
    """README's torchrun --nproc_per_node=8 on a machine with fewer GPUs (2, faked): each process says so in one line
    before the process group starts (no "invalid device ordinal" traceback, no rank left waiting for the others)."""
    fake_cuda()
    errors, output = torchrun_errors(workdir, tmp_path, 3, "cuda")
    assert errors == ["error: torchrun started 3 processes on this node, but it has 2 CUDA GPU(s), one per process; "
                      "pass --nproc_per_node=2"] * 3, output
    assert "invalid device ordinal" not in output and "NCCL" not in output


def test_torchrun_on_mps_is_one_line_on_every_rank(workdir, tmp_path):  # noqa: F811
    """gloo carries CPU and CUDA tensors only (torch's backend_capability): DDP and FSDP cannot run on a Mac's GPU."""
    errors, output = torchrun_errors(workdir, tmp_path, 2, "mps")
    assert len(errors) == 2 and all("gloo, which cannot carry MPS tensors" in e and "--device=cpu" in e
                                    for e in errors), output


def test_an_accumulation_that_does_not_divide_among_processes_says_what_to_pass(workdir, tmp_path):
    """3 micro-steps of 4 sequences: 6 a process, more than one micro-step holds, in steps that 2 do not divide."""
    result = subprocess.run([*TORCHRUN, TRAIN, *TINY, *TWO_PROCESSES, f"--out_dir={tmp_path}",
                             "--gradient_accumulation_steps=3"],
                            cwd=workdir, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "--gradient_accumulation_steps=4" in errors[0], result.stderr
    assert not os.path.exists(os.path.join(tmp_path, "ckpt.pt"))
