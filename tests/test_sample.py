"""Tests for sample.py: end to end runs, the KV cache against recomputation, speculative decoding (greedy
token for token, and sampling in distribution), the errors a user sees, BPE streaming, stops and prompts.

One test takes the user's whole path (prepare, train.py, sample.py as a script). The other checkpoints are
made here, not by train.py, in well under a second: tiny character-level GPTs with
random weights (sharp enough that greedy output varies with the whole context; briefly trained models only
repeat "the the"), and a BPE (gpt2 tokenizer) model whose weights are set by hand so that its greedy output
is a known string.
Runs go through sample.main() in-process where a separate process is not the point, since every process
start costs seconds of `import torch`.
"""

import io
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import sample
from data.shakespeare_char import prepare as prepare_char
from gpt import UserError
from gpt.bpe import named_encoding
from model import GPT, GPTConfig
from conftest import finished, sigint_as_in_a_terminal

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "sample.py")
BLOCK = 64  # block_size of the character models
PROMPT = "ROMEO:\nWhat"
SPEED = re.compile(r"^(\d+) tokens in [\d.]+ s \([\d.]+ tokens/s(?:; ([\d.]+) after the first (\d+))?\)")
ACCEPTANCE = re.compile(r"draft acceptance rate ([\d.]+)% \((\d+)/(\d+)\)")


# ----------------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(path, model, meta):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "meta": meta}, path)


def random_char_model(seed, std, like=None, block_size=BLOCK):
    """A random character GPT (vocabulary padded to 128 past the tokenizer's 65, as train.py pads), with
    untied weights of standard deviation std: sharp distributions that depend on the whole context, so that
    greedy output varies instead of repeating one character. With like: that model's weights plus noise."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=128, block_size=block_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                              tie_embeddings=False))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2:
                    param.normal_(0, std)
                    if like is not None:
                        param.add_(like.get_parameter(name))
    return model.eval()


@pytest.fixture(autouse=True)
def sample_on_the_test_device(device, monkeypatch):
    """sample.main() runs in this process on TEST_DEVICE, in float32 (as the references here; "auto" would pick
    bfloat16 on CUDA); the scripts run in separate processes get the same as arguments (on_device)."""
    monkeypatch.setitem(sample.DEFAULTS, "device", device)
    monkeypatch.setitem(sample.DEFAULTS, "dtype", "float32")


@pytest.fixture(scope="session")
def on_device(device):
    """sample.py's arguments for TEST_DEVICE in float32, for the runs in separate processes."""
    return [f"--device={device}", "--dtype=float32"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, device):
    """Paths of: a target character model and a draft (the target's weights plus noise: they agree often but
    not always) with the same meta; a draft with another vocabulary (the same characters in another order);
    a truncated ckpt.pt; a draft with a smaller block_size."""
    root = tmp_path_factory.mktemp("ckpts")
    with open(os.path.join(ROOT, "data", "shakespeare", "input.txt"), encoding="utf-8") as f:
        chars = sorted(set(f.read()))
    assert len(chars) == 65
    meta = {"tokenizer": "char", "vocab_size": len(chars), "eot_token": None, "chars": chars}
    target = random_char_model(0, 0.4)
    draft = random_char_model(1, 0.04, like=target)
    paths = {name: str(root / name / "ckpt.pt") for name in ("target", "draft", "other_vocab", "truncated")}
    save_checkpoint(paths["target"], target, meta)
    save_checkpoint(paths["draft"], draft, meta)
    save_checkpoint(paths["other_vocab"], draft, dict(meta, chars=chars[::-1]))
    with open(paths["target"], "rb") as f:
        data = f.read()
    os.makedirs(os.path.dirname(paths["truncated"]))
    with open(paths["truncated"], "wb") as f:
        f.write(data[:len(data) // 2])
    small = random_char_model(2, 0.4, block_size=16)  # its own weights: none are assumed position-independent
    paths["small_block_draft"] = str(root / "small_block_draft" / "ckpt.pt")
    save_checkpoint(paths["small_block_draft"], small, meta)
    paths["dir"] = str(root / "target")  # out_dir may be the folder as well as the file
    paths["meta"], paths["model"] = meta, target.to(device)  # reference_greedy runs it where sample.py runs
    return paths


def run(capsys, *argv):
    """stdout and stderr of sample.main(argv)."""
    capsys.readouterr()
    sample.main(list(argv))
    return capsys.readouterr()


def greedy(capsys, ckpts, prompt, n, *extra):
    return run(capsys, f"--out_dir={ckpts['target']}", f"--prompt={prompt}", "--temperature=0",
               f"--max_new_tokens={n}", *extra)


def reference_greedy(model, meta, prompt, n):
    """Greedy decoding by recomputing the whole context every step, with the window policy the docstring of
    sample.py describes: once the context would pass block_size, it restarts from its last block_size // 2."""
    chars = meta["chars"]
    tokens, start = [chars.index(c) for c in prompt], 0
    with torch.no_grad():
        for _ in range(n):
            if len(tokens) - start > model.config.block_size:
                start = len(tokens) - model.config.block_size // 2
            logits, _ = model(torch.tensor([tokens[start:]], device=model.lm_head.weight.device))
            tokens.append(int(logits[0, -1, :meta["vocab_size"]].argmax()))
    return "".join(chars[t] for t in tokens)


# ----------------------------------------------------------------------------------------------------
# sample.py runs in separate processes


class Processes:
    """sample.py runs in separate processes, started together and early (each start costs seconds of CPU
    that another core can spend while the in-process tests run); result(name) waits for one."""

    def __init__(self, runs, cwd):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
        self.procs = {name: subprocess.Popen([sys.executable, SAMPLE, *args], cwd=cwd, text=True, encoding="utf-8",
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
                      for name, args in runs.items()}

    def result(self, name):
        return finished(self.procs[name])

    def kill(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module", autouse=True)
def processes(ckpts, tmp_path_factory, on_device):
    processes = Processes({
        # inductor's first compile takes seconds of CPU with a cold cache: started first, run beside the module
        "compiled": [f"--out_dir={ckpts['target']}", f"--prompt={PROMPT}", "--temperature=0",
                     f"--max_new_tokens={2 * BLOCK + 5}", "--compile=True", *on_device],
        "ok": [f"--out_dir={ckpts['target']}", f"--prompt={PROMPT}", "--seed=7", "--max_new_tokens=40",
               "--temperature=0.9", *on_device],
        "unknown_char": [f"--out_dir={ckpts['dir']}", "--prompt=caf\u00e9 ~", *on_device],
    }, cwd=tmp_path_factory.mktemp("cwd"))
    yield processes
    processes.kill()


def test_folder_and_file_paths_of_a_checkpoint_give_the_same_sample(ckpts, capsys):
    args = [f"--prompt={PROMPT}", "--max_new_tokens=20", "--seed=3"]
    assert run(capsys, f"--out_dir={ckpts['dir']}", *args).out == run(capsys, f"--out_dir={ckpts['target']}", *args).out


# ----------------------------------------------------------------------------------------------------
# The KV cache against recomputing the whole context


@pytest.mark.parametrize("num_samples", [1, 3])
def test_cached_greedy_equals_no_kv_cache_and_a_naive_loop(ckpts, capsys, num_samples):
    n = BLOCK - len(PROMPT)  # prompt + new tokens fill block_size exactly: no window slide yet
    cached = greedy(capsys, ckpts, PROMPT, n, f"--num_samples={num_samples}").out
    uncached = greedy(capsys, ckpts, PROMPT, n, f"--num_samples={num_samples}", "--no_kv_cache").out
    assert cached == uncached
    expected = reference_greedy(ckpts["model"], ckpts["meta"], PROMPT, n)
    assert len(set(expected[len(PROMPT):])) > 3
    assert cached == sample.SEPARATOR.join([expected] * num_samples) + "\n"  # every sample: the prompt's cache


def test_greedy_past_block_size_slides_the_window(ckpts, capsys):
    n = 2 * BLOCK + 5  # the window slides three times
    out = greedy(capsys, ckpts, PROMPT, n).out
    assert len(out) == len(PROMPT) + n + 1
    assert out == reference_greedy(ckpts["model"], ckpts["meta"], PROMPT, n) + "\n"
    # recomputed whole, the same window: it slid by one token a step (the last block_size kept), other text
    assert greedy(capsys, ckpts, PROMPT, n, "--no_kv_cache").out == out


def test_sampling_past_block_size_completes_every_sample(ckpts, capsys):
    n = 2 * BLOCK + 5
    result = run(capsys, f"--out_dir={ckpts['target']}", f"--prompt={PROMPT}", f"--max_new_tokens={n}",
                 "--num_samples=3", "--temperature=1.0")
    texts = result.out[:-1].split(sample.SEPARATOR)
    assert len(texts) == 3
    assert all(t.startswith(PROMPT) and len(t) == len(PROMPT) + n for t in texts)
    assert len(set(texts)) == 3  # the samples are drawn independently
    assert SPEED.match(result.err.strip().splitlines()[-1]).group(1) == str(3 * n)


def test_a_prompt_one_short_of_block_size_decodes(ckpts, capsys):
    prompt = (PROMPT * 10)[:BLOCK - 1]
    out = greedy(capsys, ckpts, prompt, 10).out
    assert out == reference_greedy(ckpts["model"], ckpts["meta"], prompt, 10) + "\n"


def force_compiled_kernel(monkeypatch):
    """kernels.fastest_kernel answers the reduction (the compiled-only kernel; what a Zen 4 EPYC measures fastest at
    one row) for compiled steps, and measures eager ones as sample.py does: measuring compiled would compile every
    candidate with real inductor (a second or more each, at each row count), which the tests below are not about.
    sample.py measuring them compiled is test_compiled_greedy_with_inductor_in_a_separate_process's."""
    from gpt import kernels
    measured = kernels.fastest_kernel
    monkeypatch.setattr(kernels, "fastest_kernel", lambda layers, rows, compiled: "reduction" if compiled else
                        measured(layers, rows, compiled))


@pytest.mark.parametrize("num_samples", [1, 2])
def test_compiled_greedy_equals_eager_and_compiles_once(ckpts, capsys, monkeypatch, num_samples):
    """--compile=True decodes the same text from a step traced once, though the window slides twice (the cache
    refilled in place) and the position moves every step. Traced here with a counting backend that hands the graph to
    aot_eager (dynamo and AOT autograd, what inductor is given, in a fraction of its compile time), the compiled
    kernel forced (force_compiled_kernel); the inductor run is
    test_compiled_greedy_with_inductor_in_a_separate_process."""
    force_compiled_kernel(monkeypatch)
    graphs = []

    def counting_backend(graph_module, example_inputs, **kwargs):  # kwargs: static_step.CUDA_COMPILE_OPTIONS on CUDA
        graphs.append(graph_module)
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

    torch_compile, cache_addresses = torch.compile, set()

    def compile_recording_addresses(fn, **kwargs):
        if fn.__name__ != "decode_step":  # kernels.measure's timing of compiled matrix products
            return torch_compile(fn, **kwargs)
        compiled = torch_compile(fn, **{**kwargs, "backend": counting_backend})

        def step(model, tokens, cache, input_pos):
            cache_addresses.add((cache.k.data_ptr(), cache.v.data_ptr()))
            return compiled(model, tokens, cache, input_pos)
        return step

    monkeypatch.setattr(torch, "compile", compile_recording_addresses)
    torch._dynamo.reset()
    n = 2 * BLOCK + 5
    extra = [f"--num_samples={num_samples}"]
    eager = greedy(capsys, ckpts, PROMPT, n, *extra).out
    assert graphs == []  # compile is off by default
    assert greedy(capsys, ckpts, PROMPT, n, *extra, "--compile=True").out == eager
    assert len(graphs) == 1
    assert len(cache_addresses) == 1  # one cache for the whole run, slides included: CUDA graphs replay on it
    torch._dynamo.reset()


def test_on_a_cpu_the_kernels_chosen_are_said_in_one_line_before_the_speed(ckpts, capsys, monkeypatch, device):
    """Where a CPU decode step is compiled or its weights are int8, each step's matrix kernel is chosen for the CPU
    (kernels.py): stderr names it, and the file that keeps the choice, in one line (followed, where the mode multiplies
    slower than float32 on this CPU, by the line that says so). A float model decoding eager runs torch's own: nothing
    chosen, nothing said, nothing written to the cache folder; off a CPU, never."""
    from gpt import kernels
    monkeypatch.setattr(kernels, "choices", {})  # this run's choices only, not those of earlier runs in this process
    kept = os.path.join(kernels.cache_dir(), "kernels.json")
    before = os.path.getmtime(kept) if os.path.exists(kept) else None
    err = greedy(capsys, ckpts, PROMPT, 10).err.strip().splitlines()
    assert SPEED.match(err[-1]) and not any("decode kernels" in line for line in err) and not kernels.choices, err
    assert (os.path.getmtime(kept) if os.path.exists(kept) else None) == before
    err = greedy(capsys, ckpts, PROMPT, 10, "--quantize=int8", "--compile=False").err.strip().splitlines()
    notes = [line for line in err if "decode kernels" in line]
    assert SPEED.match(err[-1]) and len(notes) == (device == "cpu"), err
    if device == "cpu":
        slower = [line for line in err if line.startswith("note: on this CPU, ")]  # kernels.slower_mode_note's
        assert err[-2 - len(slower):-1] == notes + slower, err  # together, after the text, before the speed
        assert notes[0].startswith("note: decode kernels chosen for this CPU: "), err
        assert kernels.choices and all(name in notes[0] for name in kernels.choices.values())
        assert notes[0].endswith(f"(kept in {kept})")


def test_top_k_1_a_tiny_top_p_and_a_tiny_temperature_are_greedy(ckpts, capsys):
    n = 30
    expected = greedy(capsys, ckpts, PROMPT, n).out
    args = [f"--out_dir={ckpts['target']}", f"--prompt={PROMPT}", f"--max_new_tokens={n}"]
    assert run(capsys, *args, "--temperature=1.0").out != expected  # sampling would differ
    for extra in (["--top_k=1"], ["--top_p=1e-6"], ["--top_k=3", "--top_p=1e-6"]):
        assert run(capsys, *args, "--temperature=1.5", *extra).out == expected, extra
    assert run(capsys, *args, "--temperature=1e-4").out == expected


# ----------------------------------------------------------------------------------------------------
# Speculative decoding, end to end


@pytest.mark.parametrize("draft_k", [1, 3, 7])
def test_speculative_greedy_equals_plain_greedy_token_for_token(ckpts, capsys, draft_k):
    n = 2 * BLOCK + 9  # past block_size: both slide their windows
    plain = greedy(capsys, ckpts, PROMPT, n).out
    spec = greedy(capsys, ckpts, PROMPT, n, f"--draft={ckpts['draft']}", f"--draft_k={draft_k}")
    assert spec.out == plain
    rate, accepted, proposed = ACCEPTANCE.search(spec.err).groups()
    accepted, proposed = int(accepted), int(proposed)
    assert 0 < accepted < proposed  # the draft is right sometimes, not always: both paths ran
    assert float(rate) == pytest.approx(100 * accepted / proposed, abs=0.051)


def test_speculative_greedy_within_block_size_equals_plain_greedy(ckpts, capsys):
    n = BLOCK - len(PROMPT)
    plain = greedy(capsys, ckpts, PROMPT, n).out
    assert greedy(capsys, ckpts, PROMPT, n, f"--draft={ckpts['draft']}", "--draft_k=4").out == plain


def test_the_target_as_its_own_draft_is_always_accepted(ckpts, capsys):
    spec = greedy(capsys, ckpts, PROMPT, 40, f"--draft={ckpts['target']}", "--draft_k=5")
    assert spec.out == greedy(capsys, ckpts, PROMPT, 40).out
    rate, accepted, proposed = ACCEPTANCE.search(spec.err).groups()
    assert accepted == proposed and int(proposed) > 0 and float(rate) == 100.0


def test_speculative_sampling_is_reproducible_and_complete(ckpts, capsys):
    args = [f"--out_dir={ckpts['target']}", f"--prompt={PROMPT}", f"--draft={ckpts['draft']}", "--max_new_tokens=50",
            "--temperature=1.0", "--num_samples=2"]
    first = run(capsys, *args, "--seed=5").out
    texts = first[:-1].split(sample.SEPARATOR)
    assert len(texts) == 2 and all(t.startswith(PROMPT) and len(t) == len(PROMPT) + 50 for t in texts)
    assert run(capsys, *args, "--seed=5").out == first
    assert run(capsys, *args, "--seed=6").out != first


# ----------------------------------------------------------------------------------------------------
# Prompt lookup (--draft=lookup), end to end


@pytest.mark.parametrize("draft_k", [1, 4])
def test_lookup_greedy_equals_plain_greedy_token_for_token(ckpts, capsys, draft_k):
    n = 2 * BLOCK + 9  # past block_size: the window slides where plain decoding slides it
    plain = greedy(capsys, ckpts, PROMPT, n).out
    lookup = greedy(capsys, ckpts, PROMPT, n, "--draft=lookup", f"--draft_k={draft_k}")
    assert lookup.out == plain
    rate, accepted, proposed = ACCEPTANCE.search(lookup.err).groups()
    assert 0 < int(accepted) < int(proposed)  # proposals were checked, some kept and some not: both paths ran


def test_lookup_sampling_draws_what_plain_sampling_draws(ckpts, capsys):
    """One sample_next_token per kept token, in order, from the same logits (up to rounding): with one sample, the
    same seed gives plain decoding's text."""
    args = [f"--out_dir={ckpts['target']}", f"--prompt={PROMPT}", "--max_new_tokens=100", "--temperature=1.0",
            "--seed=5"]
    plain = run(capsys, *args).out
    assert run(capsys, *args, "--draft=lookup").out == plain
    assert run(capsys, *args[:-1], "--seed=6", "--draft=lookup").out != plain


def test_compiled_lookup_equals_eager_and_compiles_two_shapes_once(ckpts, capsys, monkeypatch):
    """Compiled, a step feeds either the last token alone or it and draft_k proposed (padded): two graphs for the
    whole run, the window's slides included (aot_eager, the compiled kernel forced: as the test above)."""
    force_compiled_kernel(monkeypatch)
    graphs = []

    def counting_backend(graph_module, example_inputs, **kwargs):
        graphs.append(graph_module)
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

    torch_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: torch_compile(
        fn, **({**kwargs, "backend": counting_backend} if fn.__name__ == "decode_step" else kwargs)))
    torch._dynamo.reset()
    n = 2 * BLOCK + 9
    eager = greedy(capsys, ckpts, PROMPT, n, "--draft=lookup").out
    assert greedy(capsys, ckpts, PROMPT, n, "--draft=lookup", "--compile=True").out == eager
    assert len(graphs) == 2
    torch._dynamo.reset()


def test_a_draft_of_a_smaller_block_size_gives_plain_greedy_text(ckpts, capsys):
    """The draft reads at most 16 tokens, the target 64 (BLOCK): its window slides on its own, inside the target's,
    which slides where plain decoding's does. Before, both slid at 16, so greedy text differed past it; and a
    prompt longer than the draft's window was refused."""
    draft = f"--draft={ckpts['small_block_draft']}"
    for prompt in (PROMPT[:12], (PROMPT * 10)[:30]):  # shorter than the draft's window, and longer
        plain = greedy(capsys, ckpts, prompt, 2 * BLOCK + 5).out
        assert greedy(capsys, ckpts, prompt, 2 * BLOCK + 5, draft, "--draft_k=3").out == plain


# ----------------------------------------------------------------------------------------------------
# Errors a user sees: one line, what to do, no traceback


def script_error(monkeypatch, *argv):
    """The message sample.py run as a script exits with, for argv (it must exit, with a message)."""
    monkeypatch.setattr(sys, "argv", [SAMPLE, *argv])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(SAMPLE, run_name="__main__")
    message = e.value.code
    assert isinstance(message, str), message  # a string exit code: printed to stderr, exit status 1
    assert message.startswith("error: ") and "\n" not in message, message
    return message


NOT_UTF8 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "not_utf8.txt")  # bytes 0xff 0xfe
BAD_INPUTS = {  # name: (arguments, words the message must contain)
    "max_new_tokens_0": (["--max_new_tokens=0"], ["max_new_tokens"]),
    "max_new_tokens_negative": (["--max_new_tokens=-3"], ["max_new_tokens", "-3"]),
    "num_samples_0": (["--num_samples=0"], ["num_samples"]),
    "top_k_0": (["--top_k=0"], ["top_k"]),
    "top_k_text": (["--top_k=many"], ["top_k", "many"]),
    "top_p_0": (["--top_p=0"], ["top_p"]),
    "top_p_1.5": (["--top_p=1.5"], ["top_p", "1.5"]),
    "top_p_bool": (["--top_p=True"], ["top_p must be in (0, 1], got True"]),  # ran as top_p 1
    "temperature_negative": (["--temperature=-1"], ["temperature"]),
    "draft_k_0": (["--draft_k=0"], ["draft_k"]),
    "empty_stop": (["--stop="], ["stop"]),
    "unknown_setting": (["--temperatur=0.5"], ["temperatur", "did you mean 'temperature'"]),
    "unknown_characters": (["--prompt=na\u00efve \u20ac5 ~"], ["\u00ef", "\u20ac", "~"]),
    "empty_prompt": (["--prompt="], ["prompt"]),
    "prompt_longer_than_block_size": ([f"--prompt={'a' * BLOCK}"], [f"{BLOCK} tokens", f"block_size={BLOCK}"]),
    "missing_prompt_file": (["--prompt=FILE:/nonexistent/prompt.txt"], ["/nonexistent/prompt.txt"]),
    # each of these a traceback before
    "prompt_file_not_utf8": ([f"--prompt=FILE:{NOT_UTF8}"], [f"cannot read the prompt file {NOT_UTF8}: not UTF-8"]),
    "stop_a_number": (["--stop=123"], ["stop must be a non-empty string or a list of them, got 123"]),
    "seed_too_large": ([f"--seed={2**64}"], [f"seed must be at least 0 and below 2**64, got {2**64}"]),
    "device_not_one": (["--device=gpu"], ["--device=gpu is not a device this runs on"]),
    "bad_dtype": (["--dtype=float8"], ["dtype", "float8"]),
    "cuda_graph_text": (["--cuda_graph=yes"], ["cuda_graph", "yes"]),
    "cuda_graph_and_compile": (["--cuda_graph=True", "--compile=True"], ["cuda_graph=True", "--compile=True"]),
    "cuda_graph_and_draft": (["--cuda_graph=True", "--draft=lookup"], ["cuda_graph=True", "--draft"]),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_a_one_line_error(ckpts, monkeypatch, name):
    args, needles = BAD_INPUTS[name]
    message = script_error(monkeypatch, f"--out_dir={ckpts['target']}", *args)
    assert all(needle in message for needle in needles), message


@pytest.mark.parametrize("default", ["graphs_by_default", "compiles_by_default"])
def test_a_bad_prompt_is_the_only_line_where_the_decode_step_has_a_note(ckpts, monkeypatch, capsys, default):
    """On a GPU (an H200 found it) the CUDA-graph note came before the prompt's error: two lines, not one. The note
    of each default decode step is forced here, as a GPU or a model over 64 MB would choose it."""
    from gpt import engine
    monkeypatch.setattr(engine, default, lambda model: True)  # sample.py imports it afresh below
    capsys.readouterr()
    message = script_error(monkeypatch, f"--out_dir={ckpts['target']}", "--prompt=caf\u00e9 ~")
    assert "\u00e9" in message
    assert capsys.readouterr().err == ""


def test_no_checkpoint_says_how_to_train_one(monkeypatch, tmp_path):
    message = script_error(monkeypatch, f"--out_dir={tmp_path / 'nothing'}")
    assert "no checkpoint" in message and str(tmp_path / "nothing") in message and "python train.py" in message


def test_a_truncated_checkpoint_says_so(ckpts, monkeypatch):
    message = script_error(monkeypatch, f"--out_dir={ckpts['truncated']}")
    assert "truncated or corrupt" in message and ckpts["truncated"] in message


@pytest.mark.parametrize("draft", ["other_vocab", "truncated", "missing"])
def test_a_bad_draft_is_a_one_line_error(ckpts, monkeypatch, tmp_path, draft):
    path = ckpts.get(draft, str(tmp_path / "missing"))
    message = script_error(monkeypatch, f"--out_dir={ckpts['target']}", f"--draft={path}", f"--prompt={PROMPT}")
    assert {"other_vocab": "draft", "truncated": "truncated", "missing": "no checkpoint"}[draft] in message
    assert path in message


def test_a_missing_draft_names_the_draft_config_for_the_model_s_dataset_and_it_works(ckpts, monkeypatch, tmp_path,
                                                                                      capsys):
    """A model trained by train.py on shakespeare_char (its checkpoint says so) and --draft naming a folder without a
    checkpoint: the command trains config/small_draft.py on that dataset into that folder. Run with tiny settings
    after it (its config, --out_dir and --dataset kept), it gives a draft that sample.py then uses."""
    import train
    from configurator import configure
    from test_train import TINY, in_dir

    model_path = str(tmp_path / "model" / "ckpt.pt")
    checkpoint = torch.load(ckpts["target"], weights_only=True)
    os.makedirs(os.path.dirname(model_path))
    torch.save(dict(checkpoint, settings=dict(dataset="shakespeare_char")), model_path)
    draft = str(tmp_path / "my draft")
    message = script_error(monkeypatch, f"--out_dir={model_path}", f"--draft={draft}", f"--prompt={PROMPT}")
    assert f"no checkpoint at {os.path.join(draft, 'ckpt.pt')}" in message
    command = shlex.split(re.search(r"`([^`]+)`", message).group(1))
    assert command[:3] == ["python", "train.py", "config/small_draft.py"], message
    with in_dir(ROOT):
        settings = configure(train.DEFAULTS, command[2:])
        small = configure(train.DEFAULTS, ["config/small.py"])
    assert settings["out_dir"] == draft and settings["dataset"] == "shakespeare_char" == small["dataset"]
    assert settings["n_layer"] < small["n_layer"] and settings["block_size"] == small["block_size"]

    data = tmp_path / "work"
    prepare_char.main(["--out_dir", str(data / "data" / "shakespeare_char")])
    with in_dir(data):
        train.main([os.path.join(ROOT, command[2]), *TINY, *command[3:], "--max_iters=2", "--eval_interval=2"])
    err = run(capsys, f"--out_dir={model_path}", f"--draft={draft}", f"--prompt={PROMPT}", "--max_new_tokens=20").err
    assert ACCEPTANCE.search(err), err

    torch.save(dict(checkpoint, settings=dict(dataset="shakespeare")), model_path)  # a model of another dataset
    message = script_error(monkeypatch, f"--out_dir={model_path}", f"--draft={draft}x", f"--prompt={PROMPT}")
    with in_dir(ROOT):
        assert configure(train.DEFAULTS, shlex.split(re.search(r"`([^`]+)`", message).group(1))[2:])["dataset"] == \
            "shakespeare", message
    message = script_error(monkeypatch, f"--out_dir={ckpts['target']}", f"--draft={draft}x", f"--prompt={PROMPT}")
    assert "pass it as --dataset" in message and "--dataset=" not in message  # a model without train.py's settings


def broken_copy(checkpoint_path, folder, unpadded=False):
    """A copy of a checkpoint in folder whose logits hold NaN (a broken weight here; float16 overflowing elsewhere).
    unpadded: its vocabulary cut to the tokenizer's, as a Hugging Face model's may be (train.py pads it), and NaN in
    the embedding of every character the prompt does not hold: the logits turn NaN after the first such token, when a
    static-cache step has fed the token after it before reading it back."""
    checkpoint = torch.load(checkpoint_path, weights_only=True)
    weights, meta = checkpoint["model"], checkpoint["meta"]
    if unpadded:
        checkpoint["model_config"]["vocab_size"] = meta["vocab_size"]
        for name in ("embed_tokens.weight", "lm_head.weight"):
            weights[name] = weights[name][:meta["vocab_size"]].clone()
        weights["embed_tokens.weight"][[c not in PROMPT for c in meta["chars"]]] = float("nan")
    else:
        weights["lm_head.weight"][5, 0] = float("nan")  # logit 5 of every position
    os.makedirs(folder)
    torch.save(checkpoint, os.path.join(folder, "ckpt.pt"))
    return folder


@pytest.mark.parametrize("broken, unpadded, settings", [
    ("target", False, ["--temperature=0.8"]),
    ("target", False, ["--temperature=0"]),  # argmax would take the NaN's token: garbage, silently
    ("target", False, ["--temperature=0", "--draft=draft"]),
    ("target", False, ["--temperature=0", "--draft=lookup"]),
    ("draft", False, ["--temperature=0.8", "--draft=draft"]),  # its proposal would index the target's probabilities
    ("target", True, ["--temperature=0", "--cuda_graph=True"])],  # a static step feeds a token before reading it
    ids=["sampled", "greedy", "greedy_with_a_draft", "greedy_prompt_lookup", "a_broken_draft",
         "greedy_static_step_unpadded_vocabulary"])
def test_logits_of_nan_stop_sampling_in_one_line(ckpts, monkeypatch, tmp_path, broken, unpadded, settings):
    """A model whose logits hold NaN samples no text from them, greedy or not, plain or speculative, on a static cache
    too: greedy and draw have no token for such a row, and sample.py stops at it in one line (not garbage, nor a
    traceback). --cuda_graph=True on a CPU runs the static-cache step eagerly."""
    models = dict(target=ckpts["target"], draft=ckpts["draft"])
    models[broken] = broken_copy(models[broken], tmp_path / "nan", unpadded)
    settings = [arg.replace("=draft", f"={models['draft']}") for arg in settings]
    message = script_error(monkeypatch, f"--out_dir={models['target']}", f"--prompt={PROMPT}", *settings)
    if broken == "draft":
        assert "the draft's logits hold NaN or inf" in message, message
    else:
        assert "logits hold NaN or inf at new token" in message and "--dtype=float32" in message, message
        # unpadded: NaN from the second new token on, the one a static step feeds before it reads it back
        assert ("at new token 1;" in message) != unpadded, message


def test_errors_come_before_any_output(ckpts, capsys):
    with pytest.raises(UserError):
        sample.main([f"--out_dir={ckpts['target']}", "--max_new_tokens=ten"])
    with pytest.raises(UserError):
        sample.main([f"--out_dir={ckpts['target']}", f"--draft={ckpts['other_vocab']}"])
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------------------------------------
# BPE: streaming decode of characters split across tokens


TEXT = "Hi caf\u00e9 na\u00efve \u2014 \U0001F44B\U0001F3FD \u65e5\u672c\u8a9e \U0001F389 done."


@pytest.fixture(scope="module")
def bpe_ckpt(tmp_path_factory):
    """A gpt2-tokenizer model whose greedy continuation of TEXT's first token is the rest of TEXT, then
    end-of-text: each token's embedding is its own axis, the blocks add nothing (zero output projections),
    and the output head maps token i's axis to token i + 1."""
    enc = named_encoding("gpt2")
    chain = enc.encode(TEXT) + [enc.eot_token]
    assert len(set(chain)) == len(chain) <= 32
    config = GPTConfig(vocab_size=50304, block_size=64, n_layer=1, n_head=2, n_kv_head=1, n_embd=32,
                       tie_embeddings=False)
    model = GPT(config)
    with torch.no_grad():
        model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for i, (token, following) in enumerate(zip(chain, chain[1:])):
            model.embed_tokens.weight[token, i] = 1.0
            model.lm_head.weight[following, i] = 10.0
    path = str(tmp_path_factory.mktemp("bpe") / "ckpt.pt")
    save_checkpoint(path, model, {"tokenizer": "gpt2", "vocab_size": 50257, "eot_token": 50256})
    return path, enc.decode(chain[:1])


def test_bpe_samples_end_at_end_of_text_and_are_separated(bpe_ckpt, capsys):
    path, prompt = bpe_ckpt
    assert TEXT.startswith(prompt) and prompt != TEXT
    result = run(capsys, f"--out_dir={path}", f"--prompt={prompt}", "--num_samples=3", "--max_new_tokens=100",
                 "--temperature=1.0", "--top_p=0.9")
    assert result.out == sample.SEPARATOR.join([TEXT] * 3) + "\n"


def test_bpe_sample_ends_right_after_a_stop_string_inside_a_token(bpe_ckpt, capsys):
    """A stop string can end inside a BPE token (" caf", "ve"): the sample ends right after it all the same."""
    path, prompt = bpe_ckpt
    enc = named_encoding("gpt2")
    _, token_starts = enc.decode_with_offsets(enc.encode(TEXT))
    for stop in ("ca", "na\u00efv"):  # the second spans three tokens: " na", "\u00ef", "ve"
        end = TEXT.index(stop) + len(stop)
        assert end not in token_starts  # it does end inside a token
        result = run(capsys, f"--out_dir={path}", f"--prompt={prompt}", "--max_new_tokens=100", "--temperature=0",
                     f"--stop={stop}")
        assert result.out == TEXT[:end] + "\n"


def test_bpe_empty_prompt_starts_a_new_document(bpe_ckpt, capsys):
    path, _ = bpe_ckpt
    out = run(capsys, f"--out_dir={path}", "--prompt=", "--max_new_tokens=5", "--temperature=0").out
    assert len(out) > 1  # no error: the prompt is end-of-text


# ----------------------------------------------------------------------------------------------------
# Stop strings, prompts from a file and from stdin


def test_a_stop_string_ends_the_sample_right_after_it(ckpts, capsys):
    n = 60
    full = greedy(capsys, ckpts, PROMPT, n).out[len(PROMPT):-1]
    assert len(full) == n
    stop = full[20:23]
    end = full.find(stop) + len(stop)
    assert end < n
    result = greedy(capsys, ckpts, PROMPT, n, f"--stop={stop}")
    assert result.out == PROMPT + full[:end] + "\n"
    assert SPEED.match(result.err.strip().splitlines()[-1]).group(1) == str(end)
    # a list of stops: the first one that appears ends the sample
    other = full[40:42]
    later = full.find(other) + len(other)
    stops = repr([other, stop])
    assert greedy(capsys, ckpts, PROMPT, n, f"--stop={stops}").out == PROMPT + full[:min(end, later)] + "\n"


def test_stop_strings_decode_the_escapes_a_shell_passes_as_written():
    assert sample.unescape(r"\n\n") == "\n\n"  # README's --stop="\n\n": the shell passes backslash, n, backslash, n
    assert sample.unescape(r"a\tb\\n \u00e9") == "a\tb\\n \u00e9"
    assert sample.unescape("na\u00efve \\x \\u12") == "na\u00efve \\x \\u12"  # other text, non-ASCII too, as it is


def test_a_stop_string_written_with_escapes_ends_the_sample_and_no_line_end_is_added(ckpts, capsys):
    n = 200
    full = greedy(capsys, ckpts, PROMPT, n).out[len(PROMPT):]
    line_end = full.index("\n", 5)  # the model writes lines: a stop that ends with a line end
    stop = full[line_end - 2:line_end + 1]
    escaped = "".join("\\n" if c == "\n" else f"\\u{ord(c):04x}" for c in stop)  # as a user types it: --stop='o,\n'
    result = greedy(capsys, ckpts, PROMPT, n, f"--stop={escaped}")
    assert result.out == PROMPT + full[:full.index(stop) + len(stop)]  # ends with the stop's line end, no other


def test_a_stop_string_ends_each_of_several_samples(ckpts, capsys):
    result = run(capsys, f"--out_dir={ckpts['target']}", f"--prompt={PROMPT}", "--num_samples=4",
                 "--max_new_tokens=120", "--temperature=1.0", "--stop=e")
    texts = result.out[:-1].split(sample.SEPARATOR)
    assert len(texts) == 4
    for text in texts:
        generated = text[len(PROMPT):]
        assert text.startswith(PROMPT) and "e" not in generated[:-1]
        assert generated.endswith("e") or len(generated) == 120


def test_a_stop_string_with_speculative_decoding(ckpts, capsys):
    n = 60
    full = greedy(capsys, ckpts, PROMPT, n).out[len(PROMPT):-1]
    stop = full[25:27]
    end = full.find(stop) + len(stop)
    spec = greedy(capsys, ckpts, PROMPT, n, f"--stop={stop}", f"--draft={ckpts['draft']}", "--draft_k=6").out
    assert spec == PROMPT + full[:end] + "\n"


def test_ctrl_c_while_decoding_exits_130_without_a_traceback(ckpts, on_device):
    command = [sys.executable, os.path.join(ROOT, "sample.py"), f"--out_dir={ckpts['target']}", "--prompt=ROMEO:",
               "--max_new_tokens=1000000", "--compile=False", *on_device]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=sigint_as_in_a_terminal,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert proc.stdout.read(40)  # decoding has begun
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and b"Traceback" not in err, err.decode()


def test_prompt_from_a_file_and_from_stdin(ckpts, capsys, monkeypatch, tmp_path):
    prompt = "JULIET:\nO Romeo, Romeo!\n"  # newlines, which are awkward on a command line
    expected = greedy(capsys, ckpts, prompt, 25).out
    assert expected.startswith(prompt)
    path = tmp_path / "prompt.txt"
    path.write_text(prompt, encoding="utf-8")
    assert greedy(capsys, ckpts, f"FILE:{path}", 25).out == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    assert greedy(capsys, ckpts, "-", 25).out == expected


# ----------------------------------------------------------------------------------------------------
# In a separate process, what a user sees (last: the processes started with the module run meanwhile)


def test_script_prints_the_prompt_then_the_sample_and_the_seed_reproduces_it(processes, ckpts, capsys):
    result = processes.result("ok")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert out.startswith(PROMPT) and out.endswith("\n")
    assert len(out) == len(PROMPT) + 40 + 1  # a character model: one character per token
    assert len(set(out[len(PROMPT):])) > 3  # not one repeated character
    assert SPEED.match(result.stderr.strip().splitlines()[-1]).group(1) == "40"
    args = [f"--out_dir={ckpts['target']}", f"--prompt={PROMPT}", "--max_new_tokens=40", "--temperature=0.9"]
    assert run(capsys, *args, "--seed=7").out == out  # the same seed in another process: the same text
    assert run(capsys, *args, "--seed=8").out != out


def test_a_checkpoint_trained_by_train_py_samples_end_to_end(tmp_path, capsys, device, on_device):
    """The whole path a user takes: prepare the data, train a tiny model with train.py, then sample.py as a
    script prints the prompt and a continuation in the model's alphabet, and the same seed repeats it."""
    import train
    from data.shakespeare_char import prepare as prepare_char
    from test_train import TINY, in_dir

    prepare_char.main(["--out_dir", str(tmp_path / "data" / "shakespeare_char")])
    out_dir = tmp_path / "out"
    with in_dir(tmp_path):  # train.py reads data/<dataset> from its working directory
        train.main(TINY + ["--max_iters=30", "--eval_interval=30", f"--out_dir={out_dir}", f"--device={device}"])
    capsys.readouterr()
    args = [f"--out_dir={out_dir}", "--prompt=ROMEO:", "--max_new_tokens=60", "--temperature=1.0", "--seed=3"]
    result = subprocess.run([sys.executable, SAMPLE, *args, *on_device], capture_output=True, text=True,
                            encoding="utf-8", env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8"),
                            timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 60 + 1, out
    with open(os.path.join(ROOT, "data", "shakespeare", "input.txt"), encoding="utf-8") as f:
        assert set(out) <= set(f.read())  # only characters of the training text
    assert run(capsys, *args).out == out  # the same seed, in this process: the same text
    assert run(capsys, *args[:-1], "--seed=4").out != out


def test_the_default_out_dir_is_the_one_config_small_writes():
    from configurator import configure
    from train import DEFAULTS as TRAIN_DEFAULTS

    small = configure(TRAIN_DEFAULTS, [os.path.join(ROOT, "config", "small.py")])
    assert sample.DEFAULTS["out_dir"] == small["out_dir"]


def test_a_bad_input_in_a_separate_process_is_one_line_without_traceback(processes):
    result = processes.result("unknown_char")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "\u00e9" in lines[0] and "~" in lines[0], lines[0]  # the characters it does not know, named
    assert result.stdout == ""


def test_a_reader_that_stops_early_ends_the_run_without_a_traceback(ckpts):
    """`python sample.py | head -c 20`: a BrokenPipeError traceback before, from the streamed print and again as
    Python flushed stdout at exit. Exit status 1, stderr empty (pipefail: the status is sample.py's, not head's)."""
    command = [sys.executable, SAMPLE, f"--out_dir={ckpts['target']}", "--max_new_tokens=100000", "--compile=False"]
    result = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -c 20 > /dev/null', "bash", *command],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 1 and result.stderr == "", result.stderr


def test_compiled_greedy_with_inductor_in_a_separate_process(processes, ckpts, capsys):
    """sample.py --compile=True as a user runs it, on a CPU its decode kernels measured compiled and its step compiled
    with real inductor, decodes the text eager decodes. The longest of the module's processes: last here, so that it
    runs beside every test."""
    result = processes.result("compiled")
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy(capsys, ckpts, PROMPT, 2 * BLOCK + 5).out


def test_the_speed_after_the_first_tokens_leaves_out_a_slow_start(monkeypatch):
    """sample.py's second speed figure: 8 tokens that take 10 s each (compiling, recording CUDA graphs), then 0.1 s
    each: 10 tokens/s from the 8th token on, whatever the start cost."""
    from gpt import engine

    clock = iter([10.0 * i for i in range(1, 9)] + [80 + 0.1 * i for i in range(1, 33)])
    monkeypatch.setattr(engine.time, "perf_counter", lambda: next(clock))
    samples = engine.Samples(1, sample.Tokenizer(dict(tokenizer="char", vocab_size=3, chars=["a", "b", "c"])), [],
                             stream=False)
    for _ in range(40):
        samples.add(0, 1)
    assert samples.tokens_per_second_after(8) == pytest.approx(10.0)
    assert samples.tokens_per_second_after(39) is None  # too few tokens after it to time
