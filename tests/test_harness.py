"""Tests for harness.py (lm-eval on our models) and the scoring functions of engine.py it uses: per request the
same log-likelihoods and accuracies as lm-eval's own Hugging Face backend (HFLM) on the model exported with
export.py, log-probabilities checked by hand against the model's logits, the KV-cache and sliding-window
scorers against direct forward passes, greedy generation against model.generate, and one-line errors.
Everything runs on a tiny random GPT-2-BPE model in seconds. The tests of harness.py skip where lm-eval (or, for
the comparison, transformers) is missing, as on the GPU machine; those of the engine's scorers run everywhere.
"""

import json
from pathlib import Path

import pytest
import torch

from gpt import UserError
from gpt.scoring import continuation_logprobs, sequence_logprobs, token_logprobs
from gpt.bpe import GPT2_META
from gpt.tokenizer import Tokenizer
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

BLOCK = 64
LONG_Q = " ".join(["Long ago, in a kingdom by the sea, there lived a maiden whom you may know."] * 5) + " She was"
MC_DOCS = [  # choices of one question share its context: the KV-cache path; LONG_Q is past BLOCK: cut per request
    {"q": "The cat sat on the", "choices": ["mat", "moon", "idea of it"], "label": 0},
    {"q": "One, two, three,", "choices": ["four", "blue", "dog", "five six"], "label": 0},
    {"q": LONG_Q, "choices": ["happy", "a queen of the land"], "label": 1},
]
ROLL_DOCS = [  # each fits in one block: our sliding window then equals lm-eval's disjoint windows
    {"text": "First Citizen: Before we proceed any further, hear me speak."},
    {"text": "All: Speak, speak. " * 6 + "You are all resolved rather to die than to famish?"},
]
MC_YAML = """task: t_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data}"}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_target: label
doc_to_choice: choices
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""
ROLL_YAML = """task: t_roll
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data}"}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: bits_per_byte}}]
"""


@pytest.fixture(scope="module")
def harness():
    """harness.py, which needs lm-eval. Two set-up costs of lm-eval's are paid once here, not per call:

    - the index of lm-eval's own tasks (thousands of YAML files: 6-9 s to parse), which a TaskManager that includes
      them builds anew each time: built the first time, then merged with each include_path's as TaskIndex.build
      merges its paths (later ones override earlier ones); the include_path's are indexed afresh every time.
    - the report of the machine simple_evaluate adds to its results (torch's collect_env, which runs `pip list` in a
      subprocess: over a second per call); no test reads it."""
    pytest.importorskip("lm_eval")
    import lm_eval.evaluator
    from lm_eval.tasks import _index  # lm-eval's own module (requirements-dev pins lm-eval < 0.5)
    from gpt import harness

    defaults, built = Path(lm_eval.tasks.__file__).parent, []
    real_build = _index.TaskIndex.build

    def build(paths, **kwargs):
        paths = list(paths)
        if kwargs or not paths or Path(paths[0]) != defaults:
            return real_build(paths, **kwargs)
        if not built:
            built.append(real_build([defaults]))
        return {**built[0], **real_build(paths[1:])}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_index.TaskIndex, "build", staticmethod(build))
        patch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
        yield harness


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(GPT2_META)


@pytest.fixture(scope="module")
def model():
    """Random weights (as in test_export.py), larger than the init's: the scores depend on every context token."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=BLOCK, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                          qk_norm=False))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.3 * noise if "norm" in name else 0.1 * noise)
    return model.eval()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    for name, docs, yaml in (("mc", MC_DOCS, MC_YAML), ("roll", ROLL_DOCS, ROLL_YAML)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (folder / f"{name}.yaml").write_text(yaml.format(data=folder / f"{name}.jsonl"))
    return folder


def logprobs_after(model, tokens):
    """log p(next token | tokens) over the vocabulary, from one plain forward pass."""
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0][0, -1].log_softmax(-1)


def by_doc(results, task):
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def test_scores_match_lm_evals_huggingface_backend(harness, model, tok, task_dir, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from test_export import export_or_skip  # here, not above: that module needs transformers

    assert len(tok.encode(LONG_Q)) > BLOCK and all(len(tok.encode(d["text"])) <= BLOCK for d in ROLL_DOCS)
    export_or_skip(model, GPT2_META, str(tmp_path / "hf"))  # after an edit export refuses: test_export.py says so
    calls = []  # which scoring paths ran: both must, or the comparison misses one
    for name in ("continuation_logprobs", "sequence_logprobs"):
        real = getattr(harness, name)
        monkeypatch.setattr(harness, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    ours = harness.run_tasks(model, tok, ["t_mc", "t_roll"], include_path=str(task_dir), log_samples=True)
    assert set(calls) == {"continuation_logprobs", "sequence_logprobs"}
    hf = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", dtype="float32", batch_size=4)
    theirs = lm_eval.simple_evaluate(model=hf, tasks=["t_mc", "t_roll"], log_samples=True,
                                     task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    for task in ("t_mc", "t_roll"):
        for a, b in zip(by_doc(ours, task), by_doc(theirs, task), strict=True):
            assert a["arguments"] == b["arguments"]
            for (ra,), (rb,) in zip(a["resps"], b["resps"], strict=True):
                ra, rb = (ra, rb) if task == "t_mc" else ((ra, None), (rb, None))
                assert ra[0] == pytest.approx(rb[0], abs=1e-4) and ra[1] == rb[1], (task, a["arguments"])
            if task == "t_mc":
                assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["t_mc"][metric] == theirs["results"]["t_mc"][metric]


def test_loglikelihood_is_the_models_log_probability_by_hand(harness, model, tok):
    from lm_eval.api.instance import Instance

    context = "Question: what is two plus two? Answer:"
    ctx = tok.encode(context)
    first = logprobs_after(model, ctx)
    a1 = first.argmax().item()
    a2 = logprobs_after(model, ctx + [a1]).argmax().item()
    other = tok.encode(" dog")[0]
    choices = [[a1, a2], [a1, other], [other]]  # greedy, greedy then not, not greedy
    assert other not in (a1, a2)
    for tokens in choices:  # each continuation's text tokenizes back to its tokens after the context
        assert tok.encode(context + tok.decode(tokens)) == ctx + tokens
    second = logprobs_after(model, ctx + [a1])
    expected = [first[a1] + second[a2], first[a1] + second[other], first[other]]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=(context, tok.decode(t)), idx=0)
                for t in choices]
    got = harness.GPTLM(model, tok).loglikelihood(requests)
    assert [lp for lp, _ in got] == pytest.approx([e.item() for e in expected], abs=1e-5)
    assert [greedy for _, greedy in got] == [True, False, False]


def test_cached_continuations_score_as_whole_sequences(model, tok):
    context = tok.encode("Once upon a time, in a land far away, there lived")
    greedy = model.generate(torch.tensor([context]), 4, temperature=0)[0, len(context):].tolist()
    continuations = [greedy, greedy[:1], tok.encode(" a very old king and his three daughters"), [11]]
    cached = continuation_logprobs(model, context, continuations)
    whole = sequence_logprobs(model, [(context, c) for c in continuations])
    assert [g for _, g in cached] == [g for _, g in whole] == [True, True, False, False]
    assert [lp for lp, _ in cached] == pytest.approx([lp for lp, _ in whole], abs=1e-4)


@pytest.fixture(scope="module")
def windows(model):
    """150 random tokens, and table[j, t] = log p(tokens[j + t + 1] | tokens[j : j + t + 1]) by plain forward passes."""
    n = 150
    tokens = torch.randint(0, 50257, (n,), generator=torch.Generator().manual_seed(5))
    padded = torch.cat([tokens, torch.zeros(BLOCK, dtype=torch.long)])  # causal: padding never changes a position
    table = torch.zeros(n, BLOCK)
    with torch.no_grad():
        for j0 in range(0, n, 16):
            rows = torch.stack([padded[j:j + BLOCK + 1] for j in range(j0, min(j0 + 16, n))])
            table[j0:j0 + len(rows)] = model(rows[:, :-1])[0].log_softmax(-1).gather(-1, rows[:, 1:, None])[..., 0]
    return tokens, table


@pytest.mark.parametrize("stride", [1, 16, None, BLOCK])
def test_sliding_window_gives_each_token_the_promised_context(model, windows, stride):
    """Each target i's log-prob is that of a direct forward pass over tokens[j:i]: j = 0 inside the first block,
    past it at least BLOCK - stride tokens of context (and at most BLOCK)."""
    tokens, table = windows
    got = token_logprobs(model, tokens.tolist(), stride, batch_size=3)
    assert got.shape == (len(tokens) - 1,)
    least = BLOCK - (stride or BLOCK // 2)
    for i in range(1, len(tokens)):
        starts = [0] if i <= BLOCK else range(i - BLOCK, min(i - 1, i - least) + 1)
        assert min(abs(table[j, i - j - 1] - got[i - 1]).item() for j in starts) < 1e-5, (stride, i)


def test_generate_until_is_greedy_decoding_cut_before_the_first_stop(harness, model, tok):
    from lm_eval.api.instance import Instance

    context = "The cat sat on the"
    prompt = tok.encode(context)
    new = model.generate(torch.tensor([prompt]), 20, temperature=0)[0, len(prompt):].tolist()
    assert tok.eot not in new
    text = tok.decode(new)
    stop = next(tok.decode([t]).strip() for t in new[5:] if tok.decode([t]).strip().isalpha())
    requests = [Instance(request_type="generate_until", doc={}, idx=0,
                         arguments=(context, {"until": until, "max_gen_toks": 20})) for until in ([stop], ["\x00"])]
    # lm-eval's convention (HFLM's too): the answer is the text before the stop string, the stop left out
    assert harness.GPTLM(model, tok).generate_until(requests) == [text[:text.index(stop)], text]


def test_unknown_task_names_the_closest_tasks(harness, model, tok, task_dir):
    with pytest.raises(UserError) as error:
        harness.run_tasks(model, tok, ["t_rol"], include_path=str(task_dir))
    assert "t_roll" in str(error.value) and "\n" not in str(error.value)


def test_missing_include_path_is_named(harness, model, tok, tmp_path):
    with pytest.raises(UserError, match="no_such_folder"):
        harness.run_tasks(model, tok, ["t_mc"], include_path=str(tmp_path / "no_such_folder"))


def test_a_task_yaml_that_does_not_parse_is_named_in_one_line(harness, model, tok, tmp_path):
    (tmp_path / "broken.yaml").write_text("task: broken\ndataset_path: json\n  doc_to_text: [oops\n")
    with pytest.raises(UserError) as error:
        harness.run_tasks(model, tok, ["broken"], include_path=str(tmp_path))
    assert "broken.yaml" in str(error.value) and "\n" not in str(error.value)
