"""torch.compile covers the training step in every mode train.py has: one process, DDP (in pieces at its gradient
buckets), FSDP, activation checkpointing, FSDP + activation checkpointing (on CPU with a one-process gloo group;
train.py compiles on CUDA only, so these tests give it torch's aot_eager backend, which traces as inductor's does
without generating code).
Each run's first-step line says how many graphs were compiled, and says so only where some were."""

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
# the least that compiles a training step, its graphs the fewest ops: one block, one step (and its evaluations)
RUN = ["--n_layer=1", "--max_iters=1", "--eval_interval=1", "--compile=True", "--dropout=0.0"]


@pytest.fixture
def compiling_on_cpu(monkeypatch):
    """train.py compiling on the CPU too, in a fresh Dynamo: graphs an earlier test compiled would be reused."""
    monkeypatch.setattr(train, "compile_backend", lambda compile, device_type: "aot_eager" if compile else None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def one_process_group(monkeypatch):
    """What torchrun sets for one process: train.py then runs DDP or FSDP on a gloo group of one."""
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("mode", MODES)
def test_every_training_mode_compiles_its_step(compiling_on_cpu, monkeypatch, workdir, tmp_path, capsys, mode):  # noqa: F811
    if mode not in ("one_process", "activation_checkpointing", "chunked_loss"):
        one_process_group(monkeypatch)
    train_main(workdir, tmp_path, *RUN, *MODES[mode])
    first_step = [r for r in records(tmp_path) if "first_step_s" in r]
    assert first_step and first_step[0]["compiled_graphs"] > 0, first_step
    assert f"torch.compile included ({first_step[0]['compiled_graphs']} graphs)" in capsys.readouterr().out


def test_a_step_that_compiles_nothing_says_so(compiling_on_cpu, monkeypatch, workdir, tmp_path, capsys):  # noqa: F811
    """A step torch.compile made no graph for (here compile_blocks compiles nothing; block.compile() once did, when
    activation checkpointing replaced the block's forward instead of wrapping the block in a module): the log says
    the step runs eagerly instead of claiming compilation."""
    def compile_nothing(model, backend):
        pass

    monkeypatch.setattr(parallel, "compile_blocks", compile_nothing)
    one_process_group(monkeypatch)
    train_main(workdir, tmp_path, *RUN, *MODES["fsdp_activation_checkpointing"])
    assert [r["compiled_graphs"] for r in records(tmp_path) if "first_step_s" in r] == [0]
    out = capsys.readouterr().out
    assert "compiled no graph for the training step: it runs eagerly" in out and "compile included" not in out


def test_without_compile_nothing_is_said_about_it(compiling_on_cpu, workdir, tmp_path, capsys):  # noqa: F811
    train_main(workdir, tmp_path, *RUN[:-2], "--compile=False")
    assert all("compiled_graphs" not in r for r in records(tmp_path))
    assert "torch.compile" not in capsys.readouterr().out



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
        step = parallel.prepare(model, False, False, "float32", "cpu", torch.float32, backend=counting)
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
