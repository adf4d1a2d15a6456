"""torch.compile covers the training step in every mode train.py has: one process, DDP, FSDP, activation
checkpointing, FSDP + activation checkpointing (on CPU with a one-process gloo group; train.py compiles on CUDA
only, so these tests give it torch's aot_eager backend, which traces as inductor's does without generating code).
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
                                                                                "--activation_checkpointing=True"]}
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
    if mode != "one_process" and mode != "activation_checkpointing":
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

