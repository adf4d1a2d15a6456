"""Tests for export.py against transformers (a test-only dependency): tiny random Llama and Qwen3 models
imported here give transformers' logits and greedy tokens, our models exported give ours there, a round
trip is bit-exact, tokenizer.json encodes as tiktoken does, and what has no exact counterpart is refused.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import unicodedata
from dataclasses import asdict

import pytest
import tiktoken
import torch

transformers = pytest.importorskip("transformers")  # in requirements-dev.txt; CI installs it

import sample  # noqa: E402
import train  # noqa: E402
from checkpoint import CheckpointError, gpt_config, load_hf, load_model  # noqa: E402
from data.shakespeare_char import prepare as prepare_char  # noqa: E402
from export import ConvertError, export_hf, hf_config, tokenizer_json  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

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
    export_hf(ours, char_meta(), str(tmp_path))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected_class = "Qwen3ForCausalLM" if ours.config.qk_norm else "LlamaForCausalLM"
    assert type(theirs).__name__ == expected_class
    assert_same_predictions(ours, theirs)


@pytest.mark.parametrize("kind", OUR_MODELS)
def test_round_trip_is_bit_exact(kind, tmp_path):
    ours = our_model(kind)
    export_hf(ours, char_meta(), str(tmp_path))
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
    expected = tiktoken.get_encoding("gpt2").encode(text, allowed_special="all")
    assert theirs.encode(text) == expected
    assert theirs.decode(expected) == text


def test_exported_tokenizers_load_with_autotokenizer_and_come_back(tmp_path):
    text = "ROMEO:\nWhat light through yonder window breaks?"
    for name, meta in (("gpt2", GPT2_META), ("char", char_meta())):
        folder = tmp_path / name
        model = GPT(GPTConfig(vocab_size=50304 if name == "gpt2" else 128, block_size=32, n_layer=1, n_head=2,
                              n_kv_head=1, n_embd=16))
        export_hf(model, meta, str(folder))
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

    from export import hf_state_dict
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
        with pytest.raises(CheckpointError, match="only byte-level BPE"):
            load_hf(str(tmp_path))


# ----------------------------------------------------------------------------------------------------
# Refusals: nothing is converted approximately


@pytest.mark.parametrize("overrides,needle", [
    (dict(mlp="gelu"), "mlp='gelu'"),
    (dict(mlp="relu2"), "mlp='relu2'"),
    (dict(qk_norm=True, bias=True), "bias"),
])
def test_export_refuses_switches_without_an_equivalent(overrides, needle, tmp_path):
    model = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, **overrides))
    with pytest.raises(ConvertError, match=needle):
        export_hf(model, char_meta(), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing half-written


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
    with pytest.raises(CheckpointError, match=needle):
        gpt_config(hf)


@pytest.mark.parametrize("change,needle", [
    (dict(use_sliding_window=True, sliding_window=16), "sliding"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_import_refuses_qwen3_configs_without_an_equivalent(change, needle):
    with pytest.raises(CheckpointError, match=needle):
        gpt_config(dict(hf_config(our_model("qwen3_like").config), **change))


def test_import_reads_safetensors_only_and_checks_them(tmp_path):
    model = our_model("llama_like")
    export_hf(model, None, str(tmp_path))
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_hf(str(tmp_path))
    weights.unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="never pickles"):
        load_hf(str(tmp_path))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(str(tmp_path / "nowhere"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, intermediate_size=128)))
    weights.write_bytes(data)
    with pytest.raises(CheckpointError, match="shape"):
        load_hf(str(tmp_path))


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


def run_sample(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        sample.main(["--prompt=ROMEO:", "--max_new_tokens=40", "--temperature=0", "--device=cpu", *args])
    return out.getvalue()


def test_export_script_then_sample_from_the_folder(char_ckpts, tmp_path):
    folder, refused = tmp_path / "hf", tmp_path / "refused"
    runs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "export.py"), f"--out_dir={out_dir}", "--to", str(to)],
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
            for out_dir, to in ((char_ckpts["swiglu"], folder), (char_ckpts["gelu"], refused))]
    (ok_out, ok_err), (_, bad_err) = (run.communicate(timeout=120) for run in runs)
    assert runs[0].returncode == 0 and "wrote Qwen3ForCausalLM" in ok_out, ok_err
    assert runs[1].returncode == 1 and bad_err.strip().splitlines() == [bad_err.strip()], bad_err
    assert bad_err.startswith("error: mlp='gelu'") and "Traceback" not in bad_err
    assert not refused.exists()
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]

    from_checkpoint = run_sample(f"--out_dir={char_ckpts['swiglu']}")
    assert from_checkpoint.startswith("ROMEO:") and len(from_checkpoint) > 40
    assert run_sample(f"--init_from=hf:{folder}") == from_checkpoint
    assert run_sample(f"--out_dir={char_ckpts['swiglu']}", "--draft_k=3", f"--draft=hf:{folder}") == from_checkpoint


def test_sample_errors_for_hf_folders(tmp_path):
    export_hf(our_model("llama_like"), None, str(tmp_path))
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        run_sample(f"--init_from=hf:{tmp_path}")
    with pytest.raises(sample.SampleError, match="init_from must be"):
        run_sample(f"--init_from={tmp_path}")


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("work")
    prepare_char.main(["--out_dir", str(path / "data" / "shakespeare_char")])
    return path


def test_train_fine_tunes_from_an_exported_folder(char_data, char_ckpts, tmp_path):
    """The run's first evaluation equals that of the exported model itself: the weights arrived intact."""
    folder = tmp_path / "hf"
    model, meta = load_model(char_ckpts["swiglu"])
    export_hf(model, meta, str(folder))
    out_dir = tmp_path / "run"
    args = dict(dataset="shakespeare_char", init_from=f"hf:{folder}", out_dir=str(out_dir), block_size=32, batch_size=4,
                eval_iters=2, max_iters=2, eval_interval=100, log_interval=1, device="cpu", compile=False,
                learning_rate=1e-3, min_lr=1e-4, warmup_iters=1)
    settings, argv = dict(train.DEFAULTS, **args), [f"--{k}={v}" for k, v in args.items()]
    cwd = os.getcwd()
    os.chdir(char_data)
    try:
        train.main(argv)
        expected = train.estimate_loss(model, settings, os.path.join("data", "shakespeare_char"), 0, 1, "cpu",
                                       contextlib.nullcontext())
    finally:
        os.chdir(cwd)
    with open(out_dir / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert first["iter"] == 0 and first["val_loss"] == pytest.approx(expected["val"], abs=1e-6)
    checkpoint = torch.load(out_dir / "ckpt.pt", weights_only=True)
    assert checkpoint["model_config"] == asdict(model.config) and checkpoint["iter_num"] == 2

    other = dict(meta, chars=meta["chars"][::-1])  # the same characters, other ids: another tokenizer
    export_hf(model, other, str(folder))
    os.chdir(char_data)
    try:
        with pytest.raises(train.TrainError, match="another tokenizer"):
            train.main(argv)
    finally:
        os.chdir(cwd)
