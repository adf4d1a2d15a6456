"""
Convert between this repo's checkpoints and Hugging Face folders (config.json + model.safetensors).

    python export.py --out_dir out-small --to hf-small/   # then AutoModelForCausalLM.from_pretrained("hf-small")
    python sample.py --init_from=hf:hf-small              # and back: train.py takes --init_from=hf:... too

Our model with bias=False, mlp="swiglu" is exactly a Llama (qk_norm=False) or a Qwen3 (qk_norm=True), and
its parameter names are the Hugging Face ones without the "model." prefix, so a conversion is renaming
plus a config.json. Nothing is converted approximately: a switch with no exact counterpart (a GELU MLP, a
scaled RoPE, a sliding window...) is refused with the reason. The tokenizer travels as tokenizer.json,
which transformers reads with AutoTokenizer and sample.py reads back through tiktoken.
Weights are safetensors only: loading them never runs code, unlike a pickle.
"""

import json
import os
import sys
from dataclasses import replace

import torch

from configurator import ConfigError, configure
from data.shards import atomic_open
from model import GPT, GPTConfig

DEFAULTS = dict(
    out_dir="out-small",  # the folder holding ckpt.pt (or a path to a .pt file)
    to="",  # the folder to write the Hugging Face model to
)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class ConvertError(Exception):
    """A model or folder that has no exact counterpart on the other side; the message says why."""


# ----------------------------------------------------------------------------------------------------
# Model config: GPTConfig <-> config.json


def hf_config(config, eot_token=None):
    """The config.json dict of the Hugging Face architecture that computes exactly what GPT(config) does."""
    if config.mlp != "swiglu":
        raise ConvertError(f"mlp={config.mlp!r} has no Llama/Qwen3 equivalent (they use swiglu); only swiglu models export")
    if config.qk_norm and config.bias:
        raise ConvertError("qk_norm=True with bias=True has no equivalent: Qwen3 (qk_norm) has no MLP biases")
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.mlp_width,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
        head_dim=config.head_dim, hidden_act="silu", max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings, attention_bias=config.bias,
        # rope_theta for readers of the older layout (vLLM, llama.cpp's converter), rope_parameters for newer ones
        rope_theta=config.rope_base, rope_parameters=dict(rope_type="default", rope_theta=config.rope_base),
        attention_dropout=0.0, initializer_range=0.02, bos_token_id=eot_token, eos_token_id=eot_token,
        torch_dtype="float32", use_cache=True,
    )
    if config.qk_norm:
        return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False,
                    sliding_window=None, **common)
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", mlp_bias=config.bias, **common)


def gpt_config(hf):
    """The GPTConfig of a Llama or Qwen3 config.json dict; ConvertError when it has no exact equivalent."""
    model_type = hf.get("model_type")
    if model_type not in ("llama", "qwen3"):
        raise ConvertError(f"model_type {model_type!r} is not supported; only llama and qwen3 models convert exactly")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"hidden_act={hf['hidden_act']!r}: only silu (swiglu) MLPs convert")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConvertError(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported; only plain RoPE converts")
    if hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConvertError("partial_rotary_factor != 1 is not supported; RoPE here turns the whole head")
    attention_bias = bool(hf.get("attention_bias", False))
    if model_type == "llama":
        if attention_bias != bool(hf.get("mlp_bias", False)):
            raise ConvertError("attention_bias and mlp_bias differ; bias here is one switch for every linear layer")
    else:
        if attention_bias:
            raise ConvertError("a Qwen3 with attention_bias=True has biases in attention only; bias here is all or none")
        layer_types = hf.get("layer_types") or []
        if hf.get("use_sliding_window") or any(kind != "full_attention" for kind in layer_types):
            raise ConvertError("sliding-window attention is not supported; attention here always sees the whole context")
    n_head = hf["num_attention_heads"]
    try:
        config = GPTConfig(
            vocab_size=hf["vocab_size"], block_size=hf.get("max_position_embeddings", 2048),
            n_layer=hf["num_hidden_layers"], n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head,
            n_embd=hf["hidden_size"], head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
            bias=attention_bias, mlp="swiglu", mlp_hidden=hf["intermediate_size"], qk_norm=model_type == "qwen3",
            rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf.get("tie_word_embeddings", False))
    except KeyError as e:
        raise ConvertError(f"config.json has no {e.args[0]}") from None
    except ValueError as e:
        raise ConvertError(str(e)) from None
    if config.mlp_hidden == replace(config, mlp_hidden=0).mlp_width:
        config.mlp_hidden = 0  # the default width, written as our configs write it, so a round trip is exact
    return config


# ----------------------------------------------------------------------------------------------------
# Tokenizer: meta.json <-> tokenizer.json


def byte_to_unicode():
    """GPT-2's map from each byte to a printable character, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


def bpe_merges(ranks):
    """The merge list of a tiktoken vocabulary (bytes -> rank): each token of two or more bytes is made by
    the merge that byte-pair encoding with the lower-ranked tokens ends on, listed in rank order."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:  # apply the best merge among the tokens made before this one, as BPE would
            pair_ranks = [ranks.get(parts[i] + parts[i + 1], rank) for i in range(len(parts) - 1)]
            best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            if pair_ranks[best] >= rank:
                raise ConvertError(f"token {token!r} cannot be made by merging earlier tokens; not a BPE vocabulary")
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        merges.append(tuple(parts))
    return merges


def tokenizer_json(meta):
    """tokenizer.json (for transformers' AutoTokenizer) of the tokenizer in a dataset's meta.json."""
    if meta["tokenizer"] == "char":  # one token per character: BPE with no merges, decoded by joining
        model = dict(type="BPE", vocab={c: i for i, c in enumerate(meta["chars"])}, merges=[], unk_token=None)
        return dict(version="1.0", added_tokens=[], normalizer=None, pre_tokenizer=None, post_processor=None,
                    decoder=dict(type="Fuse"), model=model)
    if meta["tokenizer"] != "gpt2":
        raise ConvertError(f"tokenizer {meta['tokenizer']!r} cannot be written as tokenizer.json; only gpt2 and char")
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    to_unicode = byte_to_unicode()
    text = lambda token: "".join(to_unicode[b] for b in token)  # noqa: E731
    ranks = enc._mergeable_ranks  # bytes -> id; tiktoken has no public accessor for the vocabulary
    model = dict(type="BPE", vocab={text(token): rank for token, rank in ranks.items()},
                 merges=[[text(a), text(b)] for a, b in bpe_merges(ranks)], unk_token=None,
                 continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    byte_level = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=True)
    added = [dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
             for s, i in enc._special_tokens.items()]
    return dict(version="1.0", added_tokens=added, normalizer=None, pre_tokenizer=byte_level,
                post_processor=None, decoder=byte_level, model=model)


def tokenizer_meta(folder, eot_token=None):
    """The meta dict (as in meta.json) of folder/tokenizer.json; None if there is none. GPT-2's BPE and
    one-token-per-character vocabularies get the meta that data prepared here has; any other byte-level
    BPE becomes {"tokenizer": "bpe", "path": ...}, which sample.Tokenizer reads through tiktoken_encoding."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model") or {}
    vocab = model.get("vocab", {})
    if (model.get("type") == "BPE" and not model.get("merges") and (spec.get("decoder") or {}).get("type") == "Fuse"
            and sorted(vocab.values()) == list(range(len(vocab))) and all(len(c) == 1 for c in vocab)):
        chars = sorted(vocab, key=vocab.get)
        return dict(tokenizer="char", vocab_size=len(chars), eot_token=None, chars=chars)
    enc = tiktoken_encoding(path)  # fails here, with the reason, if tiktoken cannot read it
    nfc = (spec.get("normalizer") or {}).get("type") == "NFC"  # Qwen's: sample.Tokenizer normalizes prompts first
    if not nfc and enc.n_vocab == 50257 and enc._pat_str == GPT2_PATTERN and enc._mergeable_ranks == gpt2_ranks():
        return dict(tokenizer="gpt2", vocab_size=50257, eot_token=50256)  # the meta that data prepared here has
    vocab_size = 1 + max([*vocab.values(), *(token["id"] for token in spec.get("added_tokens", []))])
    return dict(tokenizer="bpe", vocab_size=vocab_size, eot_token=eot_token, path=os.path.abspath(path), nfc=nfc)


def gpt2_ranks():
    """tiktoken's GPT-2 vocabulary, or None when its file can't be had (no network, no cache)."""
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")._mergeable_ranks
    except Exception:  # a download failure surfaces as any of several exception types
        return None


def tiktoken_encoding(path):
    """A tiktoken Encoding equal to the byte-level BPE in tokenizer.json (GPT-2, Llama 3 and Qwen ones).
    tiktoken merges the pair whose result has the lowest id, so ids must follow the merge order; checked."""
    import tiktoken

    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    splits = [step for step in steps if step.get("type") == "Split"]
    byte_level = steps[-1] if kinds[-1:] == ["ByteLevel"] else {}
    regexes = [step.get("pattern", {}).get("Regex") for step in splits] + [GPT2_PATTERN] * byte_level.get("use_regex", True)
    # Exactly one regex split (byte-level's own GPT-2 regex or a Split step, as in Llama 3 and Qwen), then
    # bytes: what tiktoken does. Anything else (digit splitting, a prefix space, other normalizers) is not.
    readable = (model.get("type") == "BPE" and byte_level and not byte_level.get("add_prefix_space")
                and set(kinds) <= {"Split", "ByteLevel"} and len(regexes) == 1 and None not in regexes
                and all(step.get("behavior") == "Isolated" and not step.get("invert") for step in splits)
                and (spec.get("normalizer") or {}).get("type") in (None, "NFC"))
    if not readable:
        raise ConvertError(f"{path}: only byte-level BPE tokenizers that split by one regex (GPT-2, Llama 3, Qwen) "
                           "can be read here")
    pattern = regexes[0]
    to_byte = {u: b for b, u in byte_to_unicode().items()}
    vocab = model["vocab"]
    ranks = {bytes(to_byte[ch] for ch in text): i for text, i in vocab.items()}
    merged_ids = [vocab.get("".join(m.split(" ", 1) if isinstance(m, str) else m)) for m in model.get("merges", [])]
    if any(a is None or b is None or a >= b for a, b in zip(merged_ids, merged_ids[1:])):
        raise ConvertError(f"{path}: token ids do not follow the merge order, so tiktoken cannot reproduce it")
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t["content"] not in vocab}
    return tiktoken.Encoding(name=os.path.basename(os.path.dirname(os.path.abspath(path))), pat_str=pattern,
                             mergeable_ranks=ranks, special_tokens=special)


# ----------------------------------------------------------------------------------------------------
# Whole folders


def hf_state_dict(model):
    """Our parameters under their Hugging Face names; a tied output head is stored once, as HF does."""
    state = {"model." + name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    state["lm_head.weight"] = state.pop("model.lm_head.weight")
    if model.config.tie_embeddings:
        del state["lm_head.weight"]
    return state


def write_json(path, obj):
    with atomic_open(path) as f:
        f.write(json.dumps(obj, indent=1, ensure_ascii=False).encode())


def export_hf(model, meta, folder):
    """Write model (a GPT) and its tokenizer (meta) to folder in the Hugging Face format; return the config.json dict."""
    from safetensors.torch import save_file

    config = hf_config(model.config, meta.get("eot_token") if meta else None)
    os.makedirs(folder, exist_ok=True)
    weights = os.path.join(folder, "model.safetensors")
    save_file(hf_state_dict(model), weights + ".tmp", metadata={"format": "pt"})
    os.replace(weights + ".tmp", weights)
    if meta:
        write_json(os.path.join(folder, "tokenizer.json"), tokenizer_json(meta))
        write_json(os.path.join(folder, "tokenizer_config.json"), dict(
            tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False,
            model_max_length=model.config.block_size, **({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
                                                        if meta["tokenizer"] == "gpt2" else {})))
    write_json(os.path.join(folder, "config.json"), config)  # last: a folder with config.json is complete
    return config


def load_hf(folder):
    """The GPT (fp32, on the CPU) of a local Llama or Qwen3 folder, and its tokenizer's meta dict (None
    when the folder has no tokenizer.json). ConvertError says what is missing or does not map."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ConvertError(f"no config.json in {folder}; expected a Hugging Face model folder")
    with open(config_path, encoding="utf-8") as f:
        hf = json.load(f)
    config = gpt_config(hf)
    weights = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(weights):
        found = sorted(f for f in os.listdir(folder) if f.endswith((".safetensors", ".bin", ".pt", ".pth")))
        raise ConvertError(f"no model.safetensors in {folder} (found: {', '.join(found) or 'no weights'}); "
                           "only a single safetensors file is read, never pickles")
    try:
        state = load_file(weights)
    except (SafetensorError, OSError) as e:
        raise ConvertError(f"cannot read {weights} ({e}); it is truncated or corrupt") from None
    state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    if config.tie_embeddings:
        state.setdefault("lm_head.weight", state.get("embed_tokens.weight"))
    model = GPT(config)
    expected = model.state_dict()
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ConvertError(f"{weights} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    wrong = [n for n, t in state.items() if t.shape != expected[n].shape]
    if wrong:
        raise ConvertError(f"{weights}: {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, the config implies "
                           f"{tuple(expected[wrong[0]].shape)}")
    model.load_state_dict(state)
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return model, tokenizer_meta(folder, eos)


def main(argv):
    settings = configure(DEFAULTS, argv)
    if not settings["to"]:
        raise ConvertError("say where to write the Hugging Face folder with --to, e.g. --to hf-small/")
    from sample import SampleError, load_model

    try:
        model, meta = load_model(settings["out_dir"], "cpu", torch.float32)
    except SampleError as e:
        raise ConvertError(str(e)) from None
    arch = export_hf(model, meta, settings["to"])["architectures"][0]
    print(f"wrote {arch} ({model.num_params() / 1e6:.2f}M parameters) to {settings['to']}; load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({settings['to']!r})")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, ConvertError) as e:
        sys.exit(f"error: {e}")
