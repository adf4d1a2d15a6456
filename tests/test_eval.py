"""Tests for eval.py: bits per byte by hand (a character model, a BPE model with multi-byte characters), the
sliding window where the text fits one block (test_harness.py checks it token by token past that), the command
line and its one-line errors, and lm-eval tasks run during training."""

import importlib.util
import json
import math
import os
import re
import runpy
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import eval as evaluate
import gpt
import train
from data.shakespeare import prepare as prepare_bpe
from gpt import UserError
from gpt.bpe import GPT2_META
from gpt.tokenizer import Tokenizer, char_meta
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL = os.path.join(ROOT, "eval.py")
TINY = dict(n_layer=2, n_head=2, n_kv_head=1, n_embd=32)
ACCENTED = "naïve café ☕ — ünïcödé, and plain ASCII too."  # 1, 2 and 3-byte UTF-8 characters


def random_model(vocab_size, block_size=64, seed=0, device="cpu"):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, **TINY)).to(device).eval()


def nats_by_hand(model, tokens):
    """-sum log p(tokens[i] | tokens[:i]) over i >= 1, from one forward pass over the whole sequence."""
    device = model.lm_head.weight.device
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]], device=device))[0][0]
    return F.cross_entropy(logits, torch.tensor(tokens[1:], device=device), reduction="sum").item()


def test_bits_per_byte_of_a_character_model_by_hand(device):
    text = "First Citizen: Before we proceed any further, hear me speak."  # ASCII: a character is a byte
    tokenizer = Tokenizer(char_meta(text))
    model = random_model(64, device=device)
    tokens = tokenizer.encode(text)
    figures = evaluate.bits_per_byte(model, tokens, tokenizer.byte_lengths())
    assert figures["tokens"] == figures["bytes"] == len(text) - 1  # the first character is not predicted
    nats = nats_by_hand(model, tokens)
    assert figures["loss"] == pytest.approx(nats / (len(text) - 1), rel=1e-5)
    assert figures["bits_per_byte"] == pytest.approx(nats / math.log(2) / (len(text) - 1), rel=1e-5)


def test_bits_per_byte_of_a_bpe_model_counts_utf8_bytes(tmp_path, device):
    tokenizer = Tokenizer(GPT2_META)
    model = random_model(50304, device=device)
    path = tmp_path / "text.txt"
    path.write_text(ACCENTED, encoding="utf-8")
    tokens = evaluate.text_tokens(str(path), tokenizer)
    assert tokens[0] == GPT2_META["eot_token"] and len(tokens) - 1 < len(ACCENTED.encode())  # tokens span bytes
    figures = evaluate.bits_per_byte(model, tokens, tokenizer.byte_lengths())
    n_bytes = len(ACCENTED.encode("utf-8"))
    assert n_bytes > len(ACCENTED) and figures["bytes"] == n_bytes  # every byte of the text
    assert figures["bits_per_byte"] == pytest.approx(nats_by_hand(model, tokens) / math.log(2) / n_bytes, rel=1e-5)
    two_documents = tokens + tokens  # an end-of-text token inside, as in a val shard: it has no bytes
    assert evaluate.bits_per_byte(model, two_documents, tokenizer.byte_lengths())["bytes"] == 2 * n_bytes


@pytest.mark.parametrize("stride", [1, 7, 32, 63])
def test_sliding_window_equals_full_context_when_the_text_fits_one_block(stride, device):
    tokenizer = Tokenizer(GPT2_META)
    model = random_model(50304, block_size=64, device=device)
    tokens = [tokenizer.eot] + tokenizer.encode(ACCENTED)
    assert len(tokens) <= 65
    figures = evaluate.bits_per_byte(model, tokens, tokenizer.byte_lengths(), stride=stride, batch_size=3)
    assert figures["loss"] * figures["tokens"] == pytest.approx(nats_by_hand(model, tokens), rel=1e-5)


# ----------------------------------------------------------------------------------------------------
# The command line


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """A working directory with data/shakespeare (GPT-2 BPE)."""
    work = tmp_path_factory.mktemp("work")
    prepare_bpe.main(["--out_dir", str(work / "data" / "shakespeare")])
    return work


@pytest.fixture(scope="module")
def bpe_run(bpe_data, device):
    """bpe_data's working directory with a tiny model trained on it for 4 iterations in out/, evaluated (and
    checkpointed) at iteration 4, and an empty.txt. The tests only read it."""
    work = bpe_data
    (work / "empty.txt").write_text("")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        train.main(["--dataset=shakespeare", "--n_layer=1", "--n_head=2", "--n_kv_head=1", "--n_embd=32",
                    "--block_size=32", "--batch_size=4", "--eval_iters=2", "--max_iters=4", "--eval_interval=4",
                    f"--device={device}", "--compile=False", "--out_dir=out"])
    finally:
        os.chdir(cwd)
    return work


def run_eval(cwd, monkeypatch, *args):
    """eval.main(args) in cwd, in this process: these tests are about its figures, not its process (test_bad_input's
    runs are)."""
    monkeypatch.chdir(cwd)
    evaluate.main(list(args))


def test_val_split_figures_go_to_stdout_and_json(bpe_run, tmp_path, monkeypatch, capsys, device):
    run_eval(bpe_run, monkeypatch, "--out_dir=out", "--max_tokens=500", f"--out_json={tmp_path / 'figures.json'}",
             f"--device={device}")
    figures = json.loads((tmp_path / "figures.json").read_text())["text"]
    assert figures["source"] == "data/shakespeare val split" and figures["tokens"] == 500
    assert f"{figures['bits_per_byte']:.4f} bits per byte" in capsys.readouterr().out
    # the same figure by hand: the model of the checkpoint on the first 501 val tokens, in windows of 32 + 1
    from gpt.checkpoint import load_model
    from gpt.shards import find_shards, read_shard

    model, meta, _ = load_model(str(bpe_run / "out"), device)
    tokens = [int(t) for t in read_shard(find_shards(str(bpe_run / "data" / "shakespeare"), "val")[0])[:501]]
    lengths = Tokenizer(meta).byte_lengths()
    assert figures["bytes"] == sum(lengths[t] for t in tokens[1:])
    nats = nats_by_hand(model, tokens[:33])  # the first window: full context for its 32 tokens
    first_32 = evaluate.bits_per_byte(model, tokens[:33], lengths)
    assert first_32["loss"] * 32 == pytest.approx(nats, rel=1e-5)


def test_a_lower_precision_scores_as_training_scores_its_val_loss(bpe_run, tmp_path, monkeypatch):
    """--dtype=bfloat16 (auto's choice on CUDA): float32 weights and residual stream, the matrix products in bfloat16
    under autocast, as train.py's val loss is computed; not the model cast to bfloat16 whole, whose figure was
    comparable with neither. The CPU's autocast stands in for the GPU's."""
    from gpt.checkpoint import load_model
    from gpt.shards import find_shards, read_shard

    run_eval(bpe_run, monkeypatch, "--out_dir=out", "--max_tokens=200", "--dtype=bfloat16", "--device=cpu",
             f"--out_json={tmp_path / 'bf16.json'}")
    figures = json.loads((tmp_path / "bf16.json").read_text())["text"]
    model, meta, _ = load_model(str(bpe_run / "out"), "cpu")
    tokens = [int(t) for t in read_shard(find_shards(str(bpe_run / "data" / "shakespeare"), "val")[0])[:201]]
    lengths = Tokenizer(meta).byte_lengths()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = evaluate.bits_per_byte(model, tokens, lengths)
    float32 = evaluate.bits_per_byte(model, tokens, lengths)
    assert figures["loss"] == pytest.approx(autocast["loss"], rel=1e-6)
    assert figures["loss"] != pytest.approx(float32["loss"], rel=1e-6)  # autocast was on


def test_a_dataset_of_another_tokenizer_is_a_one_line_error(bpe_run, tmp_path, monkeypatch):
    """Before, a BPE model scored character ids as its own tokens (a figure of nothing, exit 0); a character model
    given BPE ids failed with an IndexError."""
    from gpt.prepare import write_meta, write_shard

    (tmp_path / "data" / "chars").mkdir(parents=True)
    write_meta(str(tmp_path / "data" / "chars"), char_meta("abc"))
    write_shard(str(tmp_path / "data" / "chars" / "chars_val_000000.bin"), [0, 1, 2] * 50)
    with pytest.raises(UserError, match=r"^data/chars has another tokenizer \(char, 3 tokens\) than the model \(gpt2, "
                                        r"50257 tokens\); pass the --dataset it was trained on, or --text=FILE$"):
        run_eval(tmp_path, monkeypatch, f"--out_dir={bpe_run / 'out'}", "--dataset=chars", "--device=cpu")


BAD_INPUT = [
    (["--out_dir=nowhere"], "no checkpoint at nowhere"),
    (["--out_dir=out", "--text=missing.txt"], "cannot read --text missing.txt"),
    (["--out_dir=out", "--text=empty.txt"], "--text empty.txt is empty"),
    (["--out_dir=out", "--tasks=hellaswag", "--limit=0"], "limit must be a positive"),
    (["--out_dir=out", "--stride=-1"], "stride must be"),
    (["--out_dir=out", "--out_json=/nonexistent/x.json"], "--out_json /nonexistent/x.json: there is no folder"),
    (["--out_dir=out", "--stride=33"], "stride must be at most the model's block_size (32), got 33"),  # a traceback
    (["--init_from=hf:nowhere"], "nowhere"),
]


@pytest.mark.parametrize("args, needle", BAD_INPUT)
def test_bad_input_is_a_one_line_error(bpe_run, monkeypatch, capsys, args, needle):
    """eval.py run as a script (in this process: its start costs seconds) exits with one line, nothing before it."""
    monkeypatch.chdir(bpe_run)
    monkeypatch.setattr(sys, "argv", [EVAL, *args])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(EVAL, run_name="__main__")
    message = e.value.code  # a string: Python prints it to stderr and exits with status 1
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    assert needle in message and capsys.readouterr().err == "", message


def test_tasks_without_lm_eval_say_how_to_install_it(bpe_run, tmp_path, monkeypatch, device):
    """Also where an earlier test imported gpt/harness.py: a process without lm-eval never did."""
    if importlib.util.find_spec("lm_eval"):  # without it (as on the GPU machine) that import is this very error
        importlib.import_module("gpt.harness")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    monkeypatch.delitem(sys.modules, "gpt.harness", raising=False)  # imported again, as in a fresh process
    monkeypatch.delattr(gpt, "harness", raising=False)
    monkeypatch.chdir(bpe_run)
    with pytest.raises(UserError, match="lm-eval is not installed; install it with: pip install lm-eval"):
        evaluate.main(["--out_dir=out", "--tasks=hellaswag"])
    with pytest.raises(UserError, match="lm-eval is not installed; install it with: pip install lm-eval"):
        train.main(["--dataset=shakespeare", f"--out_dir={tmp_path / 'out2'}", "--eval_tasks=hellaswag",
                    f"--device={device}"])


def test_a_task_folder_that_is_not_there_names_train_pys_setting(bpe_run, tmp_path, monkeypatch, device):
    """The harness's messages name eval.py's --include_path; train.py's setting is eval_tasks_include_path, and a
    user who passed --include_path to train.py got an unknown setting."""
    pytest.importorskip("lm_eval")  # the folder is looked for by gpt/harness.py, which needs it
    monkeypatch.chdir(bpe_run)
    missing = tmp_path / "no_such_folder"
    with pytest.raises(UserError, match=rf"^eval_tasks: --eval_tasks_include_path {re.escape(str(missing))}: no such "
                                        "folder$"):
        train.main(["--dataset=shakespeare", f"--out_dir={tmp_path / 'out'}", "--eval_tasks=tiny_choice",
                    f"--eval_tasks_include_path={missing}", f"--device={device}"])


# ----------------------------------------------------------------------------------------------------
# lm-eval tasks during training


MC_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
ROLLING_TASK = """task: tiny_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


@pytest.fixture
def no_env_report(monkeypatch):
    """lm-eval's simple_evaluate adds a report of the machine to its results (torch's collect_env, which runs `pip
    list` in a subprocess: over a second per call, one per evaluation); no test reads it, so it is left out here."""
    lm_eval_evaluator = pytest.importorskip("lm_eval.evaluator")
    monkeypatch.setattr(lm_eval_evaluator, "add_env_info", lambda results: None)


def write_local_tasks(folder):
    """tiny_choice (multiple choice) and tiny_text (rolling log-likelihood), as YAML and JSONL files in folder."""
    questions = [("The king said", [" yes", " no", " Rome"], 0), ("My lord,", [" I", " thee", " we"], 1),
                 ("To be, or not to", [" be", " go", " sing"], 0), ("Good", [" night", " morrow", " day"], 2)]
    with open(folder / "choice.jsonl", "w") as f:
        f.writelines(json.dumps(dict(question=q, choices=c, label=a)) + "\n" for q, c, a in questions)
    (folder / "choice.yaml").write_text(MC_TASK.format(data=folder / "choice.jsonl"))
    with open(folder / "text.jsonl", "w") as f:
        f.writelines(json.dumps(dict(text=t)) + "\n" for t in ["Now is the winter of our discontent", ACCENTED])
    (folder / "text.yaml").write_text(ROLLING_TASK.format(data=folder / "text.jsonl"))


def test_eval_tasks_during_training_are_logged_and_match_the_checkpoint(bpe_run, tmp_path, device, no_env_report):
    pytest.importorskip("lm_eval")
    from gpt import harness

    write_local_tasks(tmp_path)
    out_dir = tmp_path / "run"
    cwd = os.getcwd()
    os.chdir(bpe_run)
    try:
        train.main(["--dataset=shakespeare", "--n_layer=1", "--n_head=2", "--n_kv_head=1", "--n_embd=32",
                    "--block_size=32", "--batch_size=4", "--eval_iters=2", "--max_iters=4", "--eval_interval=2",
                    f"--device={device}", "--dtype=float32", "--compile=False", f"--out_dir={out_dir}",
                    "--eval_tasks=tiny_choice,tiny_text",
                    f"--eval_tasks_include_path={tmp_path}"])
    finally:
        os.chdir(cwd)
    evals = [json.loads(line) for line in open(out_dir / "metrics.jsonl") if "val_loss" in line]
    assert [r["iter"] for r in evals] == [0, 2, 4]
    assert all("tiny_choice/acc" in r and "tiny_text/bits_per_byte" in r for r in evals)
    assert evals[0]["tiny_text/bits_per_byte"] != evals[-1]["tiny_text/bits_per_byte"]  # the model trained
    # the figures logged at iteration 4 are the checkpoint's (saved at 4), scored again here
    from gpt.checkpoint import load_model

    model, meta, _ = load_model(str(out_dir), device)
    again = harness.run_tasks(model, Tokenizer(meta), ["tiny_choice", "tiny_text"], include_path=str(tmp_path))
    assert evals[-1]["tiny_choice/acc"] == again["results"]["tiny_choice"]["acc,none"]
    assert evals[-1]["tiny_text/bits_per_byte"] == pytest.approx(again["results"]["tiny_text"]["bits_per_byte,none"],
                                                                 rel=1e-6)


TORCHRUN_TEST = "test_eval_tasks_under_torchrun_run_on_every_process_and_rank_0_logs"


# The world's processes: train.py's main for each mode in turn, as `torchrun ... train.py` runs it, each run's process
# group meeting in a store of its own (tests/test_parallel.py's world does the same)
TORCHRUN_WORLD = """import os, sys
sys.path[:0] = [{root!r}, {tests!r}]
import train
from test_parallel import a_store_of_its_own
rank, agent_port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
for mode in ("ddp", "fsdp"):
    a_store_of_its_own(rank, mode, agent_port)
    assert train.main(sys.argv[1:] + [f"--out_dir={{os.path.join({folder!r}, mode)}}", f"--fsdp={{mode == 'fsdp'}}"]) is None
"""


@pytest.fixture(scope="module", autouse=True)
def torchrun_world(request, tmp_path_factory):
    """train.py with eval_tasks under torchrun on two processes, under DDP and then under FSDP (in the same two
    processes: a torchrun each cost three more Python processes importing torch and lm-eval), each for 2 iterations
    evaluated at 0 and 2: (process, folder holding each mode's out_dir). Started at the module's start, where
    TORCHRUN_TEST is to run (None elsewhere), and left to run in the background until that test waits for it: its
    processes' start (seconds each) overlaps the module's other tests, which run on one thread. At a lower priority
    (nice 10), they take the CPU those tests leave free rather than slow them. On the CPU (gloo) whatever TEST_DEVICE:
    two processes would need two GPUs."""
    if importlib.util.find_spec("lm_eval") is None or not any(
            item.module is request.module and item.originalname == TORCHRUN_TEST for item in request.session.items):
        yield None
        return
    work, folder = request.getfixturevalue("bpe_data"), tmp_path_factory.mktemp("torchrun")
    write_local_tasks(folder)
    (folder / "world.py").write_text(TORCHRUN_WORLD.format(root=ROOT, tests=os.path.join(ROOT, "tests"),
                                                           folder=str(folder)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(folder / "world.py"), "--dataset=shakespeare", "--n_layer=1", "--n_head=2", "--n_kv_head=1",
               "--n_embd=32", "--block_size=32", "--batch_size=4", "--eval_iters=2", "--max_iters=2", "--dropout=0.0",
               "--eval_interval=2", "--gradient_accumulation_steps=2", "--device=cpu",
               "--eval_tasks=tiny_choice,tiny_text", f"--eval_tasks_include_path={folder}"]
    with open(folder / "world.log", "w") as log:  # a file, not a pipe no one reads until the test
        proc = subprocess.Popen(command, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: os.nice(10), env=dict(os.environ, OMP_NUM_THREADS="1"))
    yield proc, folder
    if proc.poll() is None:  # the test failed before it waited, or did not run: torchrun and its workers
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_eval_tasks_under_torchrun_run_on_every_process_and_rank_0_logs(torchrun_world):
    """Under DDP and under FSDP (where the engine's scorers need the root's sharded parameters gathered): both log
    every evaluation, with the same figures (the same model trained the same way). Two evaluations (iterations 0 and
    2) are enough: one has training after it, the other follows training."""
    pytest.importorskip("lm_eval")
    proc, folder = torchrun_world
    proc.wait(timeout=300)
    assert proc.returncode == 0, (folder / "world.log").read_text()
    evals = {}
    for mode in ("ddp", "fsdp"):
        evals[mode] = [json.loads(line) for line in open(folder / mode / "metrics.jsonl") if "val_loss" in line]
        assert [r["iter"] for r in evals[mode]] == [0, 2]
        assert all("tiny_text/bits_per_byte" in r for r in evals[mode])
    for ddp, fsdp in zip(evals["ddp"], evals["fsdp"]):
        assert fsdp["tiny_text/bits_per_byte"] == pytest.approx(ddp["tiny_text/bits_per_byte"], rel=1e-4)
