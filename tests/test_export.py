"""Tests for export.py against transformers (a test-only dependency): tiny random Llama and Qwen3 models
imported here give transformers' logits and greedy tokens, our models exported give ours there, a round
trip is bit-exact, tokenizer.json encodes as tiktoken does, and what has no exact counterpart is refused,
including a model.py edited into another architecture (imitated here on model instances).
"""

import contextlib
import inspect
import io
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import types
import unicodedata
import dataclasses
from dataclasses import asdict

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")  # in requirements-dev.txt; CI installs it

import export  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from data.shakespeare_char import prepare as prepare_char  # noqa: E402
from gpt import UserError
from gpt.checkpoint import load_model  # noqa: E402
from gpt.checkpoint import load_hf  # noqa: E402
from gpt.hf import export_hf, gpt_config, hf_config, tokenizer_json  # noqa: E402
from gpt.bpe import named_encoding  # noqa: E402
from gpt.tokenizer import Tokenizer  # noqa: E402
import model as model_py  # noqa: E402  (the module: tests swap its rule)
from model import GPT, GPTConfig, rope  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_PATH = os.path.join(ROOT, "data", "shakespeare", "input.txt")
GPT2_META = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_token": 50256}

# Small but complete: GQA (4 query heads on 2 kv heads), a non-default RoPE base and MLP width, both head
# tying choices, biases, and Qwen3's heads wider than hidden_size / heads.
HF_MODELS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False, rope_theta=1000.0)),
    "llama_bias_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                                        rope_theta=1000.0)),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True, head_dim=24, rope_theta=5000.0)),
}
OUR_MODELS = {
    "llama_like": dict(qk_norm=False, tie_embeddings=False),
    "llama_bias": dict(qk_norm=False, bias=True),
    "qwen3_like": dict(qk_norm=True, head_dim=24, norm_eps=1e-6, rope_base=5000.0),
}


def randomize_(model, seed, std=0.2):
    """Every parameter random, norm weights around 1: a skipped norm or a swapped weight shows in the logits,
    and the distributions are sharp enough that greedy decoding depends on the whole context."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.3 * noise if "norm" in name else std * noise)
    return model.eval()


def hf_model(kind):
    config_class, overrides = HF_MODELS[kind]
    config = config_class(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None, **overrides)
    return randomize_(transformers.AutoModelForCausalLM.from_config(config), seed=1)


def our_model(kind):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, **OUR_MODELS[kind])
    return randomize_(GPT(config), seed=2)


def tokens(n, seed=3):
    return torch.randint(0, 97, (2, n), generator=torch.Generator().manual_seed(seed))


def assert_same_predictions(ours, theirs):
    """Logits within 1e-4 on random tokens (fp32), and greedy generation with each side's KV cache equal."""
    idx = tokens(40)
    with torch.no_grad():
        max_diff = (ours(idx)[0] - theirs(idx).logits).abs().max().item()
    assert max_diff < 1e-4, max_diff
    prompt = tokens(6, seed=4)
    expected = theirs.generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=30)
    actual = ours.generate(prompt, max_new_tokens=30, temperature=0)
    assert torch.equal(actual, expected)
    assert len(set(actual[0, 6:].tolist())) > 3  # the test would be weak if greedy only repeated one token


def chars():
    with open(TEXT_PATH, encoding="utf-8") as f:
        return sorted(set(f.read()))


def char_meta():
    alphabet = chars()
    return {"tokenizer": "char", "vocab_size": len(alphabet), "eot_token": None, "chars": alphabet}


# ----------------------------------------------------------------------------------------------------
# After an edit to model.py that export refuses (learned positions, LayerNorm...), one group of tests fails to say
# so, test_exported_model_matches_in_transformers, once per architecture; the tests that only need an export as a
# step skip. Only then: where the plain model of that architecture still exports, their refusal is a bug, and fails.

MODEL_PY_EXPORTS = "test_export.py::test_exported_model_matches_in_transformers"


def model_py_refusal(model):
    """Why export_hf refuses the plain model of model's architecture (Llama or Qwen3), or None where it exports.
    Asked only after an export failed, so a run on the unedited model.py pays nothing for it."""
    plain = our_model("qwen3_like" if model.config.qk_norm else "llama_like")
    try:
        with tempfile.TemporaryDirectory() as folder:
            export_hf(plain, None, os.path.join(folder, "hf"))
    except UserError as e:
        return str(e)
    return None


def skip_if_model_py_does_not_export(model):
    reason = model_py_refusal(model)
    if reason is not None:
        pytest.skip(f"model.py no longer exports as Llama/Qwen3: see {MODEL_PY_EXPORTS} ({reason})")


def export_or_skip(model, meta, folder):
    """export_hf, as a step of a test about something else: a skip where export refuses model.py itself."""
    try:
        return export_hf(model, meta, folder)
    except UserError:
        skip_if_model_py_does_not_export(model)
        raise


def assert_refused(model, folder, needle, monkeypatch):
    """Assert that export_hf refuses model with a message matching needle; a skip where it refuses for model.py
    itself, which then hides the refusal under test."""
    with pytest.raises(UserError) as refused:
        export_hf(model, char_meta(), folder)
    if not re.search(needle, str(refused.value)):
        monkeypatch.undo()  # the plain model is asked of model.py as it is, not as the test patched it
        skip_if_model_py_does_not_export(model)
    assert re.search(needle, str(refused.value)), str(refused.value)


# ----------------------------------------------------------------------------------------------------
# Import: a Hugging Face model computes the same here


@pytest.mark.parametrize("kind", HF_MODELS)
def test_imported_model_matches_transformers(kind, tmp_path):
    theirs = hf_model(kind)
    theirs.save_pretrained(tmp_path)
    ours, meta = load_hf(str(tmp_path))
    assert meta is None  # the folder has no tokenizer.json
    assert ours.config.qk_norm == (kind == "qwen3") and ours.config.bias == ("bias" in kind)
    assert ours.config.norm_eps == 1e-6 and ours.config.rope_base == HF_MODELS[kind][1]["rope_theta"]
    assert_same_predictions(ours.eval(), theirs)


# ----------------------------------------------------------------------------------------------------
# Export: transformers computes the same as our model


@pytest.mark.parametrize("kind", OUR_MODELS)
def test_exported_model_matches_in_transformers(kind, tmp_path):
    ours = our_model(kind)
    expected_class = "Qwen3ForCausalLM" if ours.config.qk_norm else "LlamaForCausalLM"
    try:
        export_hf(ours, char_meta(), str(tmp_path))
    except UserError as e:  # the one failure for an edit export refuses; tests that need an export skip
        pytest.fail(f"model.py no longer exports as a {expected_class}: {e}", pytrace=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == expected_class
    assert_same_predictions(ours, theirs)


@pytest.mark.parametrize("kind", OUR_MODELS)
def test_round_trip_is_bit_exact(kind, tmp_path):
    ours = our_model(kind)
    export_or_skip(ours, char_meta(), str(tmp_path))
    back, meta = load_hf(str(tmp_path))
    assert asdict(back.config) == asdict(ours.config)
    assert meta == char_meta()
    state, back_state = ours.state_dict(), back.state_dict()
    assert state.keys() == back_state.keys()
    for name in state:
        assert torch.equal(state[name], back_state[name]), name
    assert (back.lm_head.weight is back.embed_tokens.weight) == ours.config.tie_embeddings


def test_config_maps_both_ways():
    for kind in OUR_MODELS:
        config = our_model(kind).config
        assert gpt_config(json.loads(json.dumps(hf_config(config)))) == config


# ----------------------------------------------------------------------------------------------------
# Tokenizers


def test_gpt2_tokenizer_json_encodes_as_tiktoken_in_transformers(tmp_path):
    with open(tmp_path / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(GPT2_META), f)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    with open(TEXT_PATH, encoding="utf-8") as f:
        text = f.read()[:100_000] + " naïve café 😀 日本語 <|endoftext|>  spaces \n\n\t end"
    expected = named_encoding("gpt2").encode(text, allowed_special="all")
    assert theirs.encode(text) == expected
    assert theirs.decode(expected) == text


def test_exported_tokenizers_load_with_autotokenizer_and_come_back(tmp_path):
    text = "ROMEO:\nWhat light through yonder window breaks?"
    for name, meta in (("gpt2", GPT2_META), ("char", char_meta())):
        folder = tmp_path / name
        model = GPT(GPTConfig(vocab_size=50304 if name == "gpt2" else 128, block_size=32, n_layer=1, n_head=2,
                              n_kv_head=1, n_embd=16))
        export_or_skip(model, meta, str(folder))
        theirs = transformers.AutoTokenizer.from_pretrained(folder)
        assert Tokenizer(meta).encode(text, special_tokens=True) == theirs.encode(text)
        assert theirs.decode(theirs.encode(text)) == text
        assert load_hf(str(folder))[1] == meta  # recognized as the meta data prepared here has


def test_other_byte_level_bpe_reads_through_tiktoken(tmp_path):
    """A tokenizer.json that is not GPT-2's (here GPT-2's with fewer merges, one more special token, and
    pre-tokenized as Qwen's is: NFC, a Split regex, then bytes) is read as a "bpe" meta, and
    Tokenizer then encodes as transformers does."""
    spec = tokenizer_json(GPT2_META)
    spec["normalizer"] = dict(type="NFC")
    spec["pre_tokenizer"] = dict(type="Sequence", pretokenizers=[
        dict(type="Split", pattern=dict(Regex=r"\p{N}| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"),
             behavior="Isolated", invert=False),
        dict(type="ByteLevel", add_prefix_space=False, trim_offsets=False, use_regex=False)])
    spec["model"]["merges"] = spec["model"]["merges"][:5000]
    spec["model"]["vocab"] = {t: i for t, i in spec["model"]["vocab"].items() if i < 256 + 5000}
    spec["added_tokens"] = [dict(spec["added_tokens"][0], id=5256), dict(spec["added_tokens"][0], id=5257, content="<|im_end|>")]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    model = GPT(GPTConfig(vocab_size=5312, block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, qk_norm=False))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(model.config, eot_token=5257)))
    from safetensors.torch import save_file

    from gpt.hf import hf_state_dict
    save_file(hf_state_dict(model), str(tmp_path / "model.safetensors"))
    _, meta = load_hf(str(tmp_path))
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == 5258 and meta["eot_token"] == 5257
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "First Citizen:\nBefore we proceed 2024 times, hear me speak.<|im_end|> ünïcödé cafe\u0301"
    ours = Tokenizer(meta)
    assert ours.encode(text, special_tokens=True) == theirs.encode(text)
    decode = ours.decoder()
    assert "".join(decode(t) for t in ours.encode(text, special_tokens=True)) == unicodedata.normalize("NFC", text)

    steps = spec["pre_tokenizer"]["pretokenizers"]
    for changed in ([dict(type="Digits", individual_digits=True), steps[1]], [steps[0], dict(steps[1], add_prefix_space=True)]):
        spec["pre_tokenizer"]["pretokenizers"] = changed  # what tiktoken cannot do is refused, not ignored
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
        with pytest.raises(UserError, match="only byte-level BPE"):
            load_hf(str(tmp_path))


# ----------------------------------------------------------------------------------------------------
# Refusals: nothing is converted approximately


@pytest.mark.parametrize("overrides,needle", [
    (dict(mlp="gelu"), "mlp='gelu'"),
    (dict(mlp="relu2"), "mlp='relu2'"),
    (dict(qk_norm=True, bias=True), "bias"),
    (dict(window=8), "window=8"),
])
def test_export_refuses_switches_without_an_equivalent(overrides, needle, tmp_path):
    model = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, **overrides))
    with pytest.raises(UserError, match=needle):
        export_hf(model, char_meta(), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_export_refuses_a_setting_it_does_not_know_unless_at_its_default(tmp_path):
    """A field a researcher added to GPTConfig (here document masking's separator) is refused by name before any file
    is written, whatever one check batch happens to contain; at its default it changes nothing and exports."""
    edited = dataclasses.make_dataclass("EditedConfig", [("doc_separator", tuple, ())], bases=(GPTConfig,))
    small = dict(vocab_size=97, block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16)
    with pytest.raises(UserError, match=r"^doc_separator=\(1, 1\): a setting export does not know"):
        hf_config(edited(**small, doc_separator=(1, 1)))
    assert hf_config(edited(**small)) == hf_config(GPTConfig(**small))


@pytest.mark.parametrize("change,needle", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1000.0)), "linear"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "llama3"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_import_refuses_llama_configs_without_an_equivalent(change, needle):
    hf = dict(hf_config(our_model("llama_like").config), **change)
    hf.pop("rope_parameters") if "rope_scaling" in change else None
    with pytest.raises(UserError, match=needle):
        gpt_config(hf)


@pytest.mark.parametrize("change,needle", [
    (dict(use_sliding_window=True, sliding_window=16), "sliding"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_import_refuses_qwen3_configs_without_an_equivalent(change, needle):
    with pytest.raises(UserError, match=needle):
        gpt_config(dict(hf_config(our_model("qwen3_like").config), **change))


def test_import_reads_safetensors_only_and_checks_them(tmp_path):
    model = our_model("llama_like")
    export_or_skip(model, None, str(tmp_path))
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="truncated or corrupt"):
        load_hf(str(tmp_path))
    weights.unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match="never pickles"):
        load_hf(str(tmp_path))
    with pytest.raises(UserError, match="no config.json"):
        load_hf(str(tmp_path / "nowhere"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, intermediate_size=128)))
    weights.write_bytes(data)
    with pytest.raises(UserError, match="shape") as error:
        load_hf(str(tmp_path))
    assert str(error.value).startswith(f"{weights} does not fit the model this model.py builds from its config.json: ")


# ----------------------------------------------------------------------------------------------------
# Export checks what it writes against the architecture: a model.py edited into something else is refused.
# The edits are made on a model instance (or by monkeypatching model.py's functions, which attention looks
# up at call time), as a researcher's edit of model.py would change it.


def learned_positions(model):  # GPT-2's position embedding table: a tensor no Llama has
    model.embed_positions = nn.Embedding(model.config.block_size, model.config.n_embd)


def layer_norms(model, **kwargs):
    """Every RMSNorm of the residual stream made a LayerNorm (GPT-2's) with the same scale; with bias=False it
    stores exactly RMSNorm's tensor, but also subtracts the mean."""
    places = [(model, "norm")] + [(block, name) for block in model.layers
                                  for name in ("input_layernorm", "post_attention_layernorm")]
    for module, name in places:
        layer_norm = nn.LayerNorm(model.config.n_embd, eps=model.config.norm_eps, **kwargs)
        with torch.no_grad():
            layer_norm.weight.copy_(getattr(module, name).weight)
        setattr(module, name, layer_norm)


def wider_mlp_in_one_layer(model):  # runs, but config.json has one intermediate_size for all layers
    C, mlp = model.config.n_embd, model.layers[1].mlp
    mlp.gate_proj, mlp.up_proj = nn.Linear(C, 256, bias=False), nn.Linear(C, 256, bias=False)
    mlp.down_proj = nn.Linear(256, C, bias=False)


def no_norm_before_mlp(model):
    for block in model.layers:
        block.post_attention_layernorm = nn.Identity()


OTHER_TENSORS = {  # edit: what the refusal says
    "learned_positions": (learned_positions,
                          r"not a LlamaForCausalLM's: 1 it does not have \(e.g. \['model.embed_positions.weight'\]\)"),
    "layer_norm_with_bias": (layer_norms, r"5 it does not have \(e.g. \['model.layers.0.input_layernorm.bias'"),
    "wider_mlp_in_one_layer": (wider_mlp_in_one_layer, r"model.layers.1.mlp.gate_proj.weight has shape \(256, 64\), "
                                                       r"a LlamaForCausalLM of this config has \(192, 64\)"),
    "no_norm_before_mlp": (no_norm_before_mlp, r"2 it needs \(e.g. \['model.layers.0.post_attention_layernorm.weight'"),
}


@pytest.mark.parametrize("edit", OTHER_TENSORS)
def test_export_refuses_a_model_whose_tensors_are_not_a_llamas(edit, tmp_path, monkeypatch):
    """Tensors a Llama of the config lacks, needs, or has in another shape are refused by name (also where
    transformers would load the folder and compute the same logits, as with an unused extra table), and
    nothing is written: no folder, no temp folder."""
    model = our_model("llama_like")
    change, needle = OTHER_TENSORS[edit]
    change(model)
    assert_refused(model, str(tmp_path / "out"), needle, monkeypatch)
    assert os.listdir(tmp_path) == []


def interleaved_rope(x, positions):
    """RoPE turning the pairs (x[2i], x[2i + 1]), as Meta's Llama code does, not Hugging Face's (x[i], x[i + hd/2])."""
    turned = rope(x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2), positions)  # evens, then odds
    return turned.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def documents_hard_coded(monkeypatch, ends):
    """Document masking written into model.py with no setting (nothing for export to refuse by name): can_attend
    hides keys before a document's end, ends(tokens) (B, S) bool, and attention always builds the mask (the
    is_causal shortcut would skip the rule; a window as long as the model's context changes nothing else)."""
    rule, attend = model_py.can_attend, model_py.attention

    def can_attend(query_pos, key_pos, config, layer, tokens):
        end = ends(tokens).long()
        before = end.cumsum(-1) - end  # (B, S): the ends before each position
        same_document = before[:, query_pos] == before[:, None, key_pos]  # (B, T, S)
        return rule(query_pos, key_pos, config, layer, tokens) & same_document[:, None]

    def attention(*args, **kwargs):  # model.attention's arguments by name: its signature is not copied here
        given = inspect.signature(attend).bind(*args, **kwargs)
        layer = given.arguments["module"]  # the calling CausalSelfAttention, as attention reads it
        config = dataclasses.replace(layer.config, window=layer.config.block_size)
        given.arguments["module"] = types.SimpleNamespace(config=config, layer_idx=layer.layer_idx)
        return attend(*given.args, **given.kwargs)

    monkeypatch.setattr(model_py, "can_attend", can_attend)
    monkeypatch.setattr(model_py, "attention", attention)


def after_the_pair_1_1(tokens):  # (1, 1) ends a document: the edit export once passed as a plain Qwen3
    return (tokens == 1) & (tokens.roll(1, dims=-1) == 1) & (torch.arange(tokens.size(-1)) > 0)


SAME_TENSORS_OTHER_MODEL = {
    "no_rope": lambda model, monkeypatch: monkeypatch.setattr("model.rope", lambda x, positions: x),
    "interleaved_rope": lambda model, monkeypatch: monkeypatch.setattr("model.rope", interleaved_rope),
    "layer_norm_without_bias": lambda model, monkeypatch: layer_norms(model, bias=False),
}


@pytest.mark.parametrize("edit", SAME_TENSORS_OTHER_MODEL)
def test_export_refuses_a_model_with_a_llamas_tensors_that_computes_something_else(edit, monkeypatch, tmp_path):
    """Exactly a Llama's tensors, but positions ignored, paired differently, or LayerNorm in place of RMSNorm:
    transformers' outputs from the written folder differ on the proof's ids, the export is refused, and the temp
    folder it loaded them from is gone."""
    model = our_model("llama_like")
    SAME_TENSORS_OTHER_MODEL[edit](model, monkeypatch)
    assert_refused(model, str(tmp_path / "out"), "LlamaForCausalLM computes other logits", monkeypatch)
    assert os.listdir(tmp_path) == []


def zeroed_after_an_id(monkeypatch):
    """hidden_states edited to give the id 0 no embedding: a rule of the tokens outside the mask."""
    original = model_py.GPT.hidden_states

    def hidden_states(self, idx, kv_cache=None, input_pos=None):
        if (idx == 0).any():
            pass  # what the edit does then does not matter: reading the ids is what export refuses
        return original(self, idx, kv_cache, input_pos)

    monkeypatch.setattr(model_py.GPT, "hidden_states", hidden_states)


TOKEN_RULES = {  # edit: the function the refusal names
    "documents_after_the_last_id": (lambda monkeypatch: documents_hard_coded(monkeypatch, lambda t: t == 96),
                                    "<lambda>"),
    "documents_after_the_pair_1_1": (lambda monkeypatch: documents_hard_coded(monkeypatch, after_the_pair_1_1),
                                     "after_the_pair_1_1"),
    "zeroed_after_an_id": (zeroed_after_an_id, "hidden_states"),
}


@pytest.mark.parametrize("edit", TOKEN_RULES)
def test_export_refuses_a_model_that_reads_the_token_ids_naming_where(edit, monkeypatch, tmp_path):
    """Documents masked after an id or a pair of ids that one random batch would rarely hold (the pair (1, 1) was
    once exported as a plain Qwen3), or ids read outside the mask: no batch has to hold the rule's ids, since export
    refuses any reading of the ids but the embedding lookup, naming the function that read them."""
    change, function = TOKEN_RULES[edit]
    change(monkeypatch)
    assert_refused(our_model("llama_like"), str(tmp_path / "out"),
                   rf"^{re.escape(function)} \(test_export.py:\d+\) reads the token ids \(__eq__\): a Llama/Qwen3 reads "
                   "them only to look up their embeddings", monkeypatch)
    assert os.listdir(tmp_path) == []


def test_without_transformers_the_rest_of_the_proof_still_runs(monkeypatch, tmp_path):
    """--unchecked leaves out only transformers' outputs: a rule of the tokens is refused all the same, and the plain
    model is written."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    TOKEN_RULES["documents_after_the_pair_1_1"][0](monkeypatch)
    assert_refused(our_model("llama_like"), str(tmp_path / "out"), r"^after_the_pair_1_1 \(test_export.py:\d+\) "
                   "reads the token ids", monkeypatch)
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert export_hf(our_model("llama_like"), char_meta(), str(tmp_path / "out"))[1] is False  # written, unchecked


def test_export_refuses_a_mask_rule_of_positions_that_is_not_causal_naming_the_first_pair(monkeypatch, tmp_path):
    """A rule of positions alone (here: from query 3 on, key 0 hidden; the first token's removal as a sink) differs
    from a Llama's at pairs the rule names: refused by the check of every pair, before any output is compared."""
    rule = model_py.can_attend
    monkeypatch.setattr(model_py, "can_attend", lambda query_pos, key_pos, config, layer, tokens: rule(
        query_pos, key_pos, config, layer, tokens) & ~((query_pos >= 3) & (key_pos == 0)))
    assert_refused(our_model("llama_like"), str(tmp_path / "out"), r"^model.py's can_attend is not a Llama's causal "
                   r"rule: in layer 0 the query at 3 may not see the key at 0$", monkeypatch)
    monkeypatch.setattr(model_py, "can_attend", lambda query_pos, key_pos, config, layer, tokens: rule(
        query_pos, key_pos, config, layer, tokens) | ((layer == 1) & (key_pos == query_pos + 1)))
    assert_refused(our_model("llama_like"), str(tmp_path / "out"), r"^model.py's can_attend is not a Llama's causal "
                   r"rule: in layer 1 the query at 0 may see the key at 1$", monkeypatch)
    assert os.listdir(tmp_path) == []


def test_export_refuses_ids_looked_up_in_a_table_of_their_own(monkeypatch, tmp_path):
    """A rule of the tokens written as a lookup (a table whose row for id 0 is 1: a separator) reads the ids as the
    embedding does: only their lookup in embed_tokens is allowed, any other table is refused by name."""
    original = model_py.GPT.hidden_states

    def hidden_states(self, idx, kv_cache=None, input_pos=None):
        is_zero = torch.nn.functional.embedding(idx, torch.eye(self.config.vocab_size)[:, :1])  # (B, T, 1)
        return original(self, idx, kv_cache, input_pos) * (1 - is_zero)

    monkeypatch.setattr(model_py.GPT, "hidden_states", hidden_states)
    assert_refused(our_model("llama_like"), str(tmp_path / "out"),
                   r"^hidden_states \(test_export.py:\d+\) reads the token ids \(embedding\)", monkeypatch)
    assert os.listdir(tmp_path) == []


def test_past_the_positions_export_checks_the_mask_rule_must_be_key_before_query_as_written(monkeypatch, tmp_path):
    """A context longer than the proof's positions (4,096): a rule that hides keys only past them (here key 5,000 on)
    has a Llama's values wherever they are checked, so the rule itself must compute key <= query and nothing else;
    the plain rule still exports."""
    model = randomize_(GPT(GPTConfig(vocab_size=97, block_size=6000, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                                     qk_norm=False, tie_embeddings=False)), seed=2)
    rule = model_py.can_attend
    monkeypatch.setattr(model_py, "can_attend", lambda query_pos, key_pos, config, layer, tokens: rule(
        query_pos, key_pos, config, layer, tokens) & (key_pos < 5000))
    assert_refused(model, str(tmp_path / "out"), r"^model.py's can_attend computes le, lt, and of the "
                   r"positions in layer 0, not key <= query alone: export checks the rule's values at the first 4096 "
                   r"positions only, and this model reads 6000$", monkeypatch)
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert export_or_skip(model, char_meta(), str(tmp_path / "out"))[1] in (True, False)  # written


def test_a_refused_export_leaves_an_earlier_export_in_the_folder_as_it_was(monkeypatch, tmp_path):
    folder = tmp_path / "hf"
    export_or_skip(our_model("llama_like"), char_meta(), str(folder))
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    monkeypatch.setattr("model.rope", lambda x, positions: x)
    model = randomize_(our_model("llama_like"), seed=7)  # other weights too: any file replaced would show
    with pytest.raises(UserError, match="other logits"):
        export_hf(model, None, str(folder))
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    assert os.listdir(tmp_path) == ["hf"]


def test_an_export_replaces_an_earlier_one_and_refuses_a_folder_holding_other_files(tmp_path):
    """No file of an earlier export outlives a new one (a stale tokenizer.json would be read as the new model's),
    and a folder holding files an export does not write (another model's generation_config.json) is refused."""
    folder = tmp_path / "hf"
    export_or_skip(our_model("llama_like"), char_meta(), str(folder))
    assert "tokenizer.json" in os.listdir(folder)
    export_or_skip(our_model("qwen3_like"), None, str(folder))
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    assert load_hf(str(folder))[1] is None and load_hf(str(folder))[0].config.qk_norm
    (folder / "generation_config.json").write_text("{}")
    with pytest.raises(UserError, match="generation_config.json"):
        export_hf(our_model("llama_like"), None, str(folder))
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    with pytest.raises(UserError, match="CPU float32"):
        export_hf(our_model("llama_like").to(torch.bfloat16), None, str(tmp_path / "bf16"))
    (tmp_path / "a_file").write_text("")  # a file where the folder or one above it would be: FileExistsError before
    with pytest.raises(UserError, match=f"^{re.escape(str(tmp_path / 'a_file'))} is a file; export into a new or"):
        export_hf(our_model("llama_like"), None, str(tmp_path / "a_file"))
    with pytest.raises(UserError, match=rf"^could not write {re.escape(str(tmp_path / 'a_file'))} \(File exists\)$"):
        export_hf(our_model("llama_like"), None, str(tmp_path / "a_file" / "hf"))
    assert sorted(os.listdir(tmp_path)) == ["a_file", "hf"] and (tmp_path / "a_file").read_text() == ""


# ----------------------------------------------------------------------------------------------------
# The scripts: export.py, sample.py --init_from=hf:..., train.py --init_from=hf:...


@pytest.fixture(scope="module")
def char_ckpts(tmp_path_factory):
    """A random character model's out_dir, and one with a GELU MLP (not exportable)."""
    root = tmp_path_factory.mktemp("export")
    paths = {}
    for name, mlp in (("swiglu", "swiglu"), ("gelu", "gelu")):
        torch.manual_seed(0)
        model = randomize_(GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                                         mlp=mlp, tie_embeddings=False)), seed=5, std=0.4)
        os.makedirs(root / name)
        torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "meta": char_meta()},
                   root / name / "ckpt.pt")
        paths[name] = str(root / name)
    return paths


def run_sample(*args, device):
    """sample.py's output on device, in float32 ("auto" would pick bfloat16 on CUDA)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        sample.main(["--prompt=ROMEO:", "--max_new_tokens=40", "--temperature=0", f"--device={device}",
                     "--dtype=float32", *args])
    return out.getvalue()


def test_export_script_then_sample_from_the_folder(char_ckpts, tmp_path, device):
    folder, refused = tmp_path / "hf", tmp_path / "refused"
    runs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "export.py"), f"--out_dir={out_dir}", "--to", str(to)],
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
            for out_dir, to in ((char_ckpts["swiglu"], folder), (char_ckpts["gelu"], refused))]
    (ok_out, ok_err), (_, bad_err) = (run.communicate(timeout=120) for run in runs)
    if runs[0].returncode and ok_err.startswith("error: "):  # refused: the export step, or model.py itself?
        skip_if_model_py_does_not_export(load_model(char_ckpts["swiglu"])[0])
    assert runs[0].returncode == 0 and ok_out.startswith("wrote Qwen3ForCausalLM") and ok_out.count("\n") == 1, ok_err
    assert "; same logits in transformers) to " in ok_out  # checked, and said so
    assert runs[1].returncode == 1 and bad_err.strip().splitlines() == [bad_err.strip()], bad_err
    assert bad_err.startswith("error: mlp='gelu'") and "Traceback" not in bad_err
    assert not refused.exists()
    assert os.listdir(tmp_path) == ["hf"]  # no temp folder left by either run
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]

    from_checkpoint = run_sample(f"--out_dir={char_ckpts['swiglu']}", device=device)
    assert from_checkpoint.startswith("ROMEO:") and len(from_checkpoint) > 40
    assert run_sample(f"--init_from=hf:{folder}", device=device) == from_checkpoint
    assert run_sample(f"--out_dir={char_ckpts['swiglu']}", "--draft_k=3", f"--draft=hf:{folder}",
                      device=device) == from_checkpoint


def run_script_here(path, *args):
    """The script at path as a command with args, in this process (each new one costs seconds): its __main__ block
    run under the umask processes start with here (0o022). Returns (exit status, stderr) as a process of it would end:
    a SystemExit with a message is status 1 with the message on stderr, as Python's exit makes it."""
    stderr, argv, umask = io.StringIO(), sys.argv, os.umask(0o022)
    sys.argv = [path, *args]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            runpy.run_path(path, run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            stderr.write(e.code + "\n")
    finally:
        sys.argv = argv
        os.umask(umask)
    return status, stderr.getvalue()


def test_export_script_refuses_an_earlier_export_without_overwrite_and_writes_files_as_any_other(char_ckpts,
                                                                                               tmp_path):
    """export.py's __main__ in this process (run_script_here): test_export_script_then_sample_from_the_folder runs
    its own process."""
    folder = tmp_path / "hf"

    def export(*extra):
        return run_script_here(os.path.join(ROOT, "export.py"), f"--out_dir={char_ckpts['swiglu']}", f"--to={folder}",
                               *extra)

    status, stderr = export()
    if status and stderr.startswith("error: "):  # refused: the export step, or model.py itself?
        skip_if_model_py_does_not_export(load_model(char_ckpts["swiglu"])[0])
    assert status == 0, stderr
    assert {name: oct(os.stat(folder / name).st_mode & 0o777) for name in os.listdir(folder)} == {
        name: "0o644" for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")}
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    status, stderr = export()
    assert status == 1 and stderr.strip() == (
        f"error: {folder} holds an export already (config.json, model.safetensors, tokenizer.json, "
        "tokenizer_config.json); pass --overwrite=True to replace it, or choose another --to")
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    assert export("--overwrite=True")[0] == 0


def test_export_without_transformers_is_refused_unless_unchecked(char_ckpts, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(UserError, match="transformers is not installed, so the export's logits cannot be compared"):
        export.main([f"--out_dir={char_ckpts['swiglu']}", f"--to={tmp_path / 'hf'}"])
    assert not (tmp_path / "hf").exists()
    try:
        export.main([f"--out_dir={char_ckpts['swiglu']}", f"--to={tmp_path / 'hf'}", "--unchecked=True"])
    except UserError:  # refused: the export step, or model.py itself?
        skip_if_model_py_does_not_export(load_model(char_ckpts["swiglu"])[0])
        raise
    assert "logits not compared: transformers is not installed" in capsys.readouterr().out
    assert (tmp_path / "hf" / "config.json").exists()


def test_sample_errors_for_hf_folders(tmp_path, device):
    export_or_skip(our_model("llama_like"), None, str(tmp_path))
    with pytest.raises(UserError, match="no tokenizer.json"):
        run_sample(f"--init_from=hf:{tmp_path}", device=device)
    with pytest.raises(UserError, match="init_from must be"):
        run_sample(f"--init_from={tmp_path}", device=device)


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("work")
    prepare_char.main(["--out_dir", str(path / "data" / "shakespeare_char")])
    return path


def test_train_fine_tunes_from_an_exported_folder(char_data, char_ckpts, tmp_path, device):
    """The run's first evaluation equals that of the exported model itself: the weights arrived intact."""
    folder = tmp_path / "hf"
    model, meta, _ = load_model(char_ckpts["swiglu"])  # on the CPU: export_hf takes a CPU float32 model
    export_or_skip(model, meta, str(folder))
    out_dir = tmp_path / "run"
    args = dict(dataset="shakespeare_char", init_from=f"hf:{folder}", out_dir=str(out_dir), block_size=32, batch_size=4,
                eval_iters=2, max_iters=2, eval_interval=100, log_interval=1, device=device, dtype="float32",
                compile=False, learning_rate=1e-3, min_lr=1e-4, warmup_iters=1)
    settings, argv = dict(train.DEFAULTS, **args), [f"--{k}={v}" for k, v in args.items()]
    cwd = os.getcwd()
    os.chdir(char_data)
    try:
        train.main(argv)
        loaders = train.eval_loaders(settings, os.path.join("data", "shakespeare_char"), 0, 1, device)
        expected = train.estimate_loss(load_model(char_ckpts["swiglu"], device)[0], loaders, settings, 1,
                                       contextlib.nullcontext())
    finally:
        os.chdir(cwd)
    with open(out_dir / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert first["iter"] == 0 and first["val_loss"] == pytest.approx(expected["val"], abs=1e-6)
    checkpoint = torch.load(out_dir / "ckpt.pt", weights_only=True)
    assert checkpoint["model_config"] == asdict(model.config) and checkpoint["iter_num"] == 2

    other = dict(meta, chars=meta["chars"][::-1])  # the same characters, other ids: another tokenizer
    export_hf(model, other, str(folder))  # over the earlier export
    assert not (tmp_path / "hf.tmp").exists()
    os.chdir(char_data)
    try:
        with pytest.raises(UserError, match="another tokenizer"):
            train.main(argv + ["--overwrite"])  # over the run above
    finally:
        os.chdir(cwd)
