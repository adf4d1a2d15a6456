"""
Export a checkpoint as a Hugging Face folder (config.json, model.safetensors, tokenizer.json):

    python export.py --out_dir out-small --to hf-small/   # then AutoModelForCausalLM.from_pretrained("hf-small")
    python sample.py --init_from=hf:hf-small              # and back (checkpoint.py reads such folders)

Our model with bias=False, mlp="swiglu", window=0 is exactly a Llama (qk_norm=False) or a Qwen3 (qk_norm=True),
and its parameter names are the Hugging Face ones without the "model." prefix, so an export is renaming plus
a config.json. Nothing is exported approximately. A setting with no counterpart (a GELU MLP, a sliding
window...) is refused with the reason; then what is written is checked against the architecture itself:
the exact tensor names and shapes a Llama or Qwen3 of that config has, and, when transformers is installed,
its logits on one batch against ours. An edited model.py that no longer computes a Llama (learned positions,
LayerNorm...) is refused there, and no folder is left behind. Weights are safetensors: loading them never
runs code, unlike a pickle.
"""

import json
import os
import shutil
import sys
import tempfile

import torch

from gpt.checkpoint import CheckpointError, load_model
from configurator import ConfigError, configure
from gpt.files import atomic_open
from gpt.tokenizer import TokenizerError, byte_to_unicode, named_encoding

DEFAULTS = dict(
    out_dir="out-small",  # the folder holding ckpt.pt (or a path to a .pt file)
    to="",  # the folder to write the Hugging Face model to
)


class ConvertError(Exception):
    """A model with no exact Hugging Face counterpart; the message says why."""


# ----------------------------------------------------------------------------------------------------
# The target architecture: config.json, and the tensors a model of that config has


def hf_config(config, eot_token=None):
    """The config.json dict of the Hugging Face architecture that computes exactly what GPT(config) does."""
    if config.mlp != "swiglu":
        raise ConvertError(f"mlp={config.mlp!r} has no Llama/Qwen3 equivalent (they use swiglu); only swiglu models export")
    if config.qk_norm and config.bias:
        raise ConvertError("qk_norm=True with bias=True has no equivalent: Qwen3 (qk_norm) has no MLP biases")
    if config.window:
        raise ConvertError(f"window={config.window} (sliding-window attention) has no Llama/Qwen3 equivalent; "
                           "only window=0 models export")
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


def hf_tensor_shapes(hf):
    """Every tensor name and shape that a Llama or Qwen3 with config.json dict hf stores, written from the
    architecture's definition (not from our model), so that a model.py edit cannot slip through."""
    C, I, V, hd = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["head_dim"]
    q_width, kv_width = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, C)
    for i in range(hf["num_hidden_layers"]):
        layer = {"input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
                 "self_attn.q_proj.weight": (q_width, C), "self_attn.k_proj.weight": (kv_width, C),
                 "self_attn.v_proj.weight": (kv_width, C), "self_attn.o_proj.weight": (C, q_width),
                 "mlp.gate_proj.weight": (I, C), "mlp.up_proj.weight": (I, C), "mlp.down_proj.weight": (C, I)}
        if hf["attention_bias"]:
            layer.update({"self_attn.q_proj.bias": (q_width,), "self_attn.k_proj.bias": (kv_width,),
                          "self_attn.v_proj.bias": (kv_width,), "self_attn.o_proj.bias": (C,)})
        if hf.get("mlp_bias"):
            layer.update({"mlp.gate_proj.bias": (I,), "mlp.up_proj.bias": (I,), "mlp.down_proj.bias": (C,)})
        if hf["model_type"] == "qwen3":
            layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def hf_state_dict(model):
    """Our parameters under their Hugging Face names; a tied output head is stored once, as HF does."""
    state = {"model." + name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    state["lm_head.weight"] = state.pop("model.lm_head.weight")
    if model.config.tie_embeddings:
        del state["lm_head.weight"]
    return state


def check_tensors(state, hf):
    """ConvertError unless state holds exactly the tensors (names and shapes) the architecture of hf has."""
    expected, arch = hf_tensor_shapes(hf), hf["architectures"][0]
    extra, missing = sorted(state.keys() - expected.keys()), sorted(expected.keys() - state.keys())
    if extra or missing:
        raise ConvertError(f"the model's tensors are not a {arch}'s: {len(extra)} it does not have (e.g. {extra[:2]}), "
                           f"{len(missing)} it needs (e.g. {missing[:2]}); a changed model.py exports only as itself")
    wrong = next((name for name, shape in expected.items() if tuple(state[name].shape) != shape), None)
    if wrong:
        raise ConvertError(f"{wrong} has shape {tuple(state[wrong].shape)}, a {arch} of this config has {expected[wrong]}")


def our_logits(model, idx):
    """Logits (B, T, V) of idx through every attention path: a whole-sequence forward, and through the KV cache
    (a prefill, then one token at a time), so that an edit to the mask rule that training's fast path does not
    see is seen here. ConvertError if the two disagree."""
    T = idx.size(1)
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_kv_cache(*idx.shape)
        half = max(1, T // 2)
        cached = torch.cat([model(idx[:, :half], kv_cache=cache)[0]] +
                           [model(idx[:, t:t + 1], kv_cache=cache)[0] for t in range(half, T)], dim=1)
    if (full - cached).abs().max() > 1e-4 * max(1.0, full.abs().max().item()):
        raise ConvertError("the model's logits through the KV cache differ from a whole-sequence forward; "
                           "run python -m pytest tests/test_invariants.py to see where")
    return full


def check_logits(model, folder):
    """ConvertError unless transformers, loading folder, computes our model's logits on one batch; False when
    transformers is not installed (nothing checked)."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging
    except ImportError:
        return False
    logging.disable_progress_bar()  # its weight-loading bar would be the export's only stderr output
    theirs = AutoModelForCausalLM.from_pretrained(folder).float().eval()
    idx = torch.randint(0, model.config.vocab_size, (2, min(64, model.config.block_size)),
                        generator=torch.Generator().manual_seed(0))
    was_training = model.training
    expected = our_logits(model.eval(), idx)
    model.train(was_training)
    with torch.no_grad():
        actual = theirs(idx).logits
    difference = (expected - actual).abs().max().item()
    if not difference <= 1e-4 * max(1.0, expected.abs().max().item()):
        raise ConvertError(f"transformers' {type(theirs).__name__} computes other logits from the written folder "
                           f"(max difference {difference:.3g}): the model is not one it can represent")
    return True


# ----------------------------------------------------------------------------------------------------
# Tokenizer: meta.json -> tokenizer.json


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
    enc = named_encoding("gpt2")
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


# ----------------------------------------------------------------------------------------------------
# The folder


def write_json(path, obj):
    with atomic_open(path) as f:
        f.write(json.dumps(obj, indent=1, ensure_ascii=False).encode())


def write_folder(model, meta, config, folder):
    """model.safetensors, the tokenizer files and config.json into the (existing, empty) folder."""
    from safetensors.torch import save_file  # only exports need safetensors

    save_file(hf_state_dict(model), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    if meta:
        write_json(os.path.join(folder, "tokenizer.json"), tokenizer_json(meta))
        write_json(os.path.join(folder, "tokenizer_config.json"), dict(
            tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False,
            model_max_length=model.config.block_size, **({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
                                                        if meta["tokenizer"] == "gpt2" else {})))
    write_json(os.path.join(folder, "config.json"), config)


EXPORT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def export_hf(model, meta, folder):
    """Write model (a GPT on the CPU, in float32) and its tokenizer (meta) to folder in the Hugging Face format,
    after checking that it is exactly a Llama or Qwen3; return (the config.json dict, whether transformers
    checked the logits). The files are written to a temp folder, moved into folder only when every check has
    passed, and replace an earlier export there; a folder holding anything else is refused."""
    weight = model.lm_head.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise ConvertError(f"export a CPU float32 model (this one is {weight.dtype} on {weight.device}), "
                           "e.g. checkpoint.load_model(out_dir)")
    others = sorted(set(os.listdir(folder)) - EXPORT_FILES) if os.path.isdir(folder) else []
    if others:
        raise ConvertError(f"{folder} holds files an export does not write ({', '.join(others[:3])}); "
                           "export into a new or empty folder, or one holding an earlier export")
    config = hf_config(model.config, meta.get("eot_token") if meta else None)
    check_tensors(hf_state_dict(model), config)
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(os.path.normpath(folder)) + ".tmp-", dir=parent)
    try:
        write_folder(model, meta, config, tmp)
        checked = check_logits(model, tmp)
        os.makedirs(folder, exist_ok=True)
        written = os.listdir(tmp)
        for name in sorted(written, key=lambda name: name == "config.json"):  # config.json last: then complete
            os.replace(os.path.join(tmp, name), os.path.join(folder, name))
        for name in EXPORT_FILES - set(written):  # an earlier export's file that this one has not (tokenizer)
            if os.path.exists(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return config, checked


def main(argv):
    settings = configure(DEFAULTS, argv)
    if not settings["to"]:
        raise ConvertError("say where to write the Hugging Face folder with --to, e.g. --to hf-small/")
    model, meta = load_model(settings["out_dir"])
    config, checked = export_hf(model, meta, settings["to"])
    check = "same logits in transformers" if checked else "logits not compared: transformers is not installed"
    print(f"wrote {config['architectures'][0]} ({model.num_params() / 1e6:.2f}M parameters; {check}) to "
          f"{settings['to']}; load it with transformers.AutoModelForCausalLM.from_pretrained({settings['to']!r})")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, ConvertError, CheckpointError, TokenizerError) as e:
        sys.exit(f"error: {e}")
