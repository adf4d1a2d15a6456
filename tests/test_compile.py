"""torch.compile covers the training step in every mode train.py has: one process, DDP (in pieces at its gradient
buckets), FSDP, activation checkpointing, FSDP + activation checkpointing (on CPU with a one-process gloo group;
train.py compiles on CUDA only, so these tests give it torch's aot_eager backend, which traces as inductor's does
without generating code).
The graphs are Dynamo's own count, taken around train.py's training step (bench/gpu_check.py counts them on a GPU
from torch's trace, checked here too)."""

import glob
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import train
from gpt import parallel
from test_parallel import free_port
from test_train import records, train_main, workdir  # noqa: F401 (workdir is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

MODES = {"one_process": [], "ddp": [], "fsdp": ["--fsdp=True"], "activation_checkpointing":
         ["--activation_checkpointing=True"], "fsdp_activation_checkpointing": ["--fsdp=True",
                                                                                "--activation_checkpointing=True"],
         "chunked_loss": ["--loss_chunk=37"], "ddp_chunked_loss": ["--loss_chunk=37"]}
GPU_CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu_check.py")
# the least that compiles a training step, its graphs the fewest ops: one block, one step (and its evaluations)
RUN = ["--n_layer=1", "--max_iters=1", "--eval_interval=1", "--compile=True", "--dropout=0.0"]


@pytest.fixture
def compiling_on_cpu(monkeypatch):
    """train.py compiling on the CPU too, in a fresh Dynamo: graphs an earlier test compiled would be reused."""
    monkeypatch.setattr(train, "compile_backend", lambda compile, device_type: "aot_eager" if compile else None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def step_graphs(monkeypatch):
    """The graphs Dynamo compiles inside each of train.py's training steps (forward and backward), a list that
    fills as the run steps: evaluations, which compile graphs of their own, are left out."""
    counted, forward_backward = [], train.forward_backward

    def counting(*args, **kwargs):
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        loss = forward_backward(*args, **kwargs)
        counted.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
        return loss

    monkeypatch.setattr(train, "forward_backward", counting)
    return counted


def one_process_group(monkeypatch):
    """What torchrun sets for one process: train.py then runs DDP or FSDP on a gloo group of one."""
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("mode", MODES)
def test_every_training_mode_compiles_its_step(compiling_on_cpu, step_graphs, monkeypatch, workdir, tmp_path,  # noqa: F811
                                               mode):
    if mode not in ("one_process", "activation_checkpointing", "chunked_loss"):
        one_process_group(monkeypatch)
    train_main(workdir, tmp_path, *RUN, *MODES[mode])
    assert len(step_graphs) == 1 and step_graphs[0] > 0, step_graphs
    assert [r for r in records(tmp_path) if "first_step_s" in r]


def test_a_step_that_compiles_nothing_counts_no_graph(compiling_on_cpu, step_graphs, monkeypatch, workdir,  # noqa: F811
                                                      tmp_path):
    """A step torch.compile made no graph for (here compile_blocks compiles nothing; block.compile() once did, when
    activation checkpointing replaced the block's forward instead of wrapping the block in a module) counts none:
    the count above is the step's, not one that any run shows."""
    def compile_nothing(model, backend):
        pass

    monkeypatch.setattr(parallel, "compile_blocks", compile_nothing)
    one_process_group(monkeypatch)
    train_main(workdir, tmp_path, *RUN, *MODES["fsdp_activation_checkpointing"])
    assert step_graphs == [0]


def test_without_compile_nothing_is_compiled_or_said_about_it(compiling_on_cpu, step_graphs, workdir,  # noqa: F811
                                                              tmp_path, capsys):
    train_main(workdir, tmp_path, *RUN[:-2], "--compile=False")
    assert step_graphs == [0]
    assert "torch.compile" not in capsys.readouterr().out


def test_gpu_check_counts_the_graphs_in_torchs_trace(tmp_path):
    """bench/gpu_check.py's compiled_graphs reads TORCH_TRACE's log as Dynamo counts: a function with a graph break
    compiles into two graphs."""
    code = ("import torch\n"
            "def f(x):\n    y = x.sin()\n    print(flush=True)\n    return y.cos()\n"
            "torch.compile(f, backend='eager')(torch.ones(3))\n"
            "print(torch._dynamo.utils.counters['stats']['unique_graphs'])\n")
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TORCH_TRACE=str(tmp_path)),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["2"], result.stderr
    assert glob.glob(str(tmp_path / "*.log"))
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.compiled_graphs(str(tmp_path)) == 2



def pieces_compiled_under_ddp(bucket_cap_mb):
    """How many graphs the compiler gets for one DDP training step of a ~6 MB model (gpt/parallel.prepare, as
    train.py calls it under torchrun), DDP's gradient buckets bucket_cap_mb each, on a gloo group of one."""
    import torch.distributed as dist
    from torch._dynamo.backends.debugging import aot_eager
    from model import GPT, GPTConfig

    pieces = []

    def counting(graph_module, example_inputs):  # a backend: each graph it is handed, compiled by aot_eager
        pieces.append(graph_module)
        return aot_eager(graph_module, example_inputs)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=4, n_embd=256))
    wrap_ddp = parallel.wrap_ddp
    try:
        parallel.wrap_ddp = lambda model, device: parallel.DDP(model, bucket_cap_mb=bucket_cap_mb)
        settings = dict(activation_checkpointing=False, fsdp=False, dtype="float32")
        step = parallel.prepare(model, settings, "cpu", torch.float32, backend=counting)
        x = torch.randint(0, 64, (2, 32))
        step(x, x)[1].backward()
    finally:
        parallel.wrap_ddp = wrap_ddp
        torch._dynamo.reset()
    return len(pieces)


def test_a_ddp_step_is_compiled_in_pieces_at_its_gradient_buckets():
    """Under DDP, dynamo's DDP optimizer compiles the step in pieces cut at DDP's gradient buckets, so that each
    bucket's all-reduce starts while the rest of the backward runs: smaller buckets, more pieces (DDP's first bucket
    is 1 MB, the others bucket_cap_mb). Measured on torch 2.13: the same pieces whether DDP wraps the compiled model
    (gpt/parallel.py's order) or is compiled itself, since DDP's forward shows itself to the compiler either way."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        one_bucket_past_the_first, one_mb_buckets = pieces_compiled_under_ddp(1000), pieces_compiled_under_ddp(1)
    finally:
        dist.destroy_process_group()
    assert one_bucket_past_the_first == 2 and one_mb_buckets > 2, (one_bucket_past_the_first, one_mb_buckets)
