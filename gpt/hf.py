"""
Hugging Face Llama/Qwen3 folders (config.json, model.safetensors, tokenizer.json), both ways. Our model with
bias=False, mlp="swiglu", window=0 is exactly a Llama (qk_norm=False) or a Qwen3 (qk_norm=True), and its parameter
names are the Hugging Face ones without the "model." prefix, so a conversion is renaming plus a config.json; nothing
converts approximately. A setting with no counterpart is refused with the reason; an export then proves that it
computes what the checkpoint does (the tensor names and shapes of the architecture, the token ids read by the embedding
alone, the causal mask rule, and where transformers is installed its outputs: see "The proof"), so an edited model.py
that no longer computes a Llama is refused, naming what differs, and leaves no folder behind.
"""

import json
import os
import shutil
import tempfile
import traceback
from dataclasses import fields, replace

import torch

from gpt import UserError
from gpt.files import failing_write, write_json
from gpt.bpe import byte_to_unicode, named_encoding, tokenizer_json_meta
import model as model_py  # the module: its can_attend as it is at the time of an export (an edit, a test's patch)
from model import GPTConfig

# ----------------------------------------------------------------------------------------------------
# Reading: config.json -> GPTConfig, model.safetensors -> weights, tokenizer.json -> meta


def gpt_config(hf):
    """The GPTConfig of a Llama or Qwen3 config.json dict; UserError when it has no exact equivalent."""
    model_type = hf.get("model_type")
    if model_type not in ("llama", "qwen3"):
        raise UserError(f"model_type {model_type!r} is not supported; only llama and qwen3 models convert exactly")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act={hf['hidden_act']!r}: only silu (swiglu) MLPs convert")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UserError(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported; only plain RoPE converts")
    if hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError("partial_rotary_factor != 1 is not supported; RoPE here turns the whole head")
    attention_bias = bool(hf.get("attention_bias", False))
    if model_type == "llama" and attention_bias != bool(hf.get("mlp_bias", False)):
        raise UserError("attention_bias and mlp_bias differ; bias here is one switch for every linear layer")
    if model_type == "qwen3" and attention_bias:
        raise UserError("a Qwen3 with attention_bias=True has biases in attention only; bias here is all or none")
    if hf.get("use_sliding_window") or any(kind != "full_attention" for kind in hf.get("layer_types") or []):
        raise UserError("sliding-window attention is not supported on import; these layers would see the whole context")
    n_head = hf.get("num_attention_heads")
    try:
        config = GPTConfig(
            vocab_size=hf["vocab_size"], block_size=hf.get("max_position_embeddings", 2048),
            n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"],
            n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=hf["hidden_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head, bias=attention_bias, mlp="swiglu",
            mlp_hidden=hf["intermediate_size"], qk_norm=model_type == "qwen3",
            rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf.get("tie_word_embeddings", False))
    except KeyError as e:
        raise UserError(f"config.json has no {e.args[0]}") from None
    except ValueError as e:
        raise UserError(str(e)) from None
    if config.mlp_hidden == replace(config, mlp_hidden=0).mlp_width:
        config.mlp_hidden = 0  # the default width, written as our configs write it, so a round trip is exact
    return config


def read_hf(folder):
    """What a local Llama or Qwen3 folder holds, in this repo's terms: (GPTConfig, state dict with our names, the path
    of its weights, its tokenizer's meta dict or None without tokenizer.json); gpt/checkpoint.py's load_hf builds the
    model. UserError says what is missing or does not map."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"no config.json in {folder}; expected a Hugging Face model folder")
    try:
        from safetensors import SafetensorError  # only this path needs safetensors
        from safetensors.torch import load_file
    except ImportError:
        raise UserError("reading a Hugging Face folder needs safetensors: pip install safetensors") from None
    with open(config_path, encoding="utf-8") as f:
        hf = json.load(f)
    config = gpt_config(hf)
    weights = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(weights):
        found = sorted(f for f in os.listdir(folder) if f.endswith((".safetensors", ".bin", ".pt", ".pth")))
        raise UserError(f"no model.safetensors in {folder} (found: {', '.join(found) or 'no weights'}); "
                              "only a single safetensors file is read, never pickles")
    try:
        state = load_file(weights)
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {weights} ({e}); it is truncated or corrupt") from None
    state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    if config.tie_embeddings and "embed_tokens.weight" in state:  # else named missing below
        state.setdefault("lm_head.weight", state["embed_tokens.weight"])
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    tokenizer_path = os.path.join(folder, "tokenizer.json")
    meta = tokenizer_json_meta(tokenizer_path, eos) if os.path.exists(tokenizer_path) else None
    return config, state, weights, meta


# ----------------------------------------------------------------------------------------------------
# Writing: config.json, and the tensors a model of that config has


# The GPTConfig fields hf_config maps (or checks): any other one, a field an edit of model.py added, is refused unless
# at its default, since export cannot know what it changes (document masking, value embeddings...).
EXPORT_KNOWS = {"vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "dropout", "bias",
                "mlp", "mlp_hidden", "qk_norm", "rope_base", "norm_eps", "tie_embeddings", "window"}


def hf_config(config, eot_token=None):
    """The config.json dict of the Hugging Face architecture that computes exactly what GPT(config) does."""
    unknown = [f"{f.name}={getattr(config, f.name)!r}" for f in fields(config)
               if f.name not in EXPORT_KNOWS and getattr(config, f.name) != f.default]
    if unknown:
        raise UserError(f"{', '.join(unknown)}: a setting export does not know (added to model.py?); it exports only "
                        "at its default, since a Llama/Qwen3 cannot say what it changes")
    if config.mlp != "swiglu":
        raise UserError(f"mlp={config.mlp!r} has no Llama/Qwen3 equivalent (they use swiglu); only swiglu models export")
    if config.qk_norm and config.bias:
        raise UserError("qk_norm=True with bias=True has no equivalent: Qwen3 (qk_norm) has no MLP biases")
    if config.window:
        raise UserError(f"window={config.window} (sliding-window attention) has no Llama/Qwen3 equivalent; "
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
    """UserError unless state holds exactly the tensors (names and shapes) the architecture of hf has."""
    expected, arch = hf_tensor_shapes(hf), hf["architectures"][0]
    extra, missing = sorted(state.keys() - expected.keys()), sorted(expected.keys() - state.keys())
    if extra or missing:
        raise UserError(f"the model's tensors are not a {arch}'s: {len(extra)} it does not have (e.g. {extra[:2]}), "
                        f"{len(missing)} it needs (e.g. {missing[:2]}); a changed model.py exports only as itself")
    wrong = next((name for name, shape in expected.items() if tuple(state[name].shape) != shape), None)
    if wrong:
        raise UserError(f"{wrong} has shape {tuple(state[wrong].shape)}, a {arch} of this config has {expected[wrong]}")


# ----------------------------------------------------------------------------------------------------
# The proof: what export shows before it writes. Two functions of the same weights, ours and transformers' Llama or
# Qwen3, are equal where (1) the token ids reach nothing but their lookup in embed_tokens, (2) the mask rule is the
# causal one at every pair of positions (by its values at the first PROOF_POSITIONS, past them by what it computes:
# key <= query and nothing else), and (3) the outputs agree on random ids at every position of the context (the first
# PROOF_POSITIONS of a longer one, which export's line then says): with (1) and (2), what is left is a function of the
# embedded tokens and their positions, and two such architectures that differ (a norm, RoPE's pairing, a soft cap)
# give other outputs on almost every input, which random ids are. No batch has to find a rule of the tokens by luck: a
# model with one is refused by (1), naming the function that reads them.

PROOF_POSITIONS = 4096  # (2) and (3) at the first 4096 positions at most: a forward of 32k on a CPU takes minutes
LOGITS_POSITIONS = 64  # logits (B, T, V) compared at these first positions (a 150k-token head), hidden states at all


class TokensRead(Exception):
    """A torch function other than the embedding lookup read the token ids."""


# What may be read of the ids without reading them: their shape, device and type
METADATA = {torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndim.__get__,
            torch.Tensor.__len__, torch.Tensor.device.__get__, torch.Tensor.dtype.__get__, torch.Tensor.numel}


class TokenIds(torch.Tensor):
    """Token ids whose values only the lookup in their table (the model's embed_tokens.weight, set as .table) may
    read: any other torch function of them (a comparison, an index, .tolist(), a lookup in another table) raises
    TokensRead. Their shape, device and dtype are free to read."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        looked_up = func is torch.nn.functional.embedding and args[1:2] and args[1] is args[0].table
        if func not in METADATA and not looked_up:
            raise TokensRead(getattr(func, "__name__", str(func)))
        with torch._C.DisableTorchFunctionSubclass():  # the result a plain tensor: the embeddings are no ids
            return func(*args, **(kwargs or {}))


class RecordedPositions(torch.Tensor):
    """Positions whose every torch function (and those of the tensors computed from them) is named in calls."""
    calls = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in METADATA:
            cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs)


def reader(error):
    """Where TokensRead was raised from: the innermost function of the traceback outside torch and this file."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not frame.filename.startswith(os.path.dirname(torch.__file__)) and frame.filename != __file__]
    return f"{frames[-1].name} ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else "?"


def tokens_read(error):
    return UserError(f"{reader(error)} reads the token ids ({error}): a Llama/Qwen3 reads them only to look up their "
                     "embeddings, so a rule of the tokens (document masking, a separator) cannot be exported")


def check_mask_rule(model, tokens):
    """(2): UserError unless model.py's can_attend is a Llama's rule, key <= query, at every pair of positions of
    tokens (1, T) in every layer, without reading the tokens; and, where the context is longer than T, unless it
    computes key <= query and nothing else (a rule of the positions past T would not show in their values)."""
    positions = torch.arange(tokens.size(1))
    causal = positions <= positions[:, None]  # (T, T)
    for layer in range(model.config.n_layer):
        try:
            visible = model_py.can_attend(positions[:, None], positions, model.config, layer, tokens)  # (T, T) or more
        except TokensRead as e:
            raise tokens_read(e) from None
        wrong = (visible != causal).nonzero()
        if len(wrong):
            query, key = wrong[0][-2:].tolist()
            raise UserError(f"model.py's can_attend is not a Llama's causal rule: in layer {layer} the query at "
                            f"{query} {'may' if key > query else 'may not'} see the key at {key}")
        if model.config.block_size > tokens.size(1):  # positions whose pairs were not checked: the rule as written
            calls = rule_calls(lambda query, key: model_py.can_attend(query, key, model.config, layer, tokens))
            if calls != rule_calls(lambda query, key: key <= query):
                raise UserError(f"model.py's can_attend computes {', '.join(calls)} of the positions in layer {layer}, "
                                f"not key <= query alone: export checks the rule's values at the first "
                                f"{tokens.size(1)} positions only, and this model reads {model.config.block_size}")


def rule_calls(rule):
    """The torch functions rule(query_pos, key_pos) computes of the positions, by name, in order."""
    RecordedPositions.calls = []
    positions = torch.arange(2)
    rule(positions[:, None].as_subclass(RecordedPositions), positions.as_subclass(RecordedPositions))
    return [name.strip("_") for name in RecordedPositions.calls]


def proof_ids(config):
    """Random ids (1, T), T = min(block_size, PROOF_POSITIONS), of a fixed seed."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (1, min(config.block_size, PROOF_POSITIONS)), generator=generator)


def our_outputs(model, idx):
    """(1) and (2), then our side of (3): the logits (1, LOGITS_POSITIONS, V) of idx's first tokens through forward,
    and the final hidden states (1, T, C) of all of idx, each computed from ids only the embedding may read."""
    tokens, first = idx.as_subclass(TokenIds), idx[:, :LOGITS_POSITIONS].as_subclass(TokenIds)  # (1, T), (1, 64)
    tokens.table = first.table = model.embed_tokens.weight
    check_mask_rule(model, tokens)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(first)[0], model.hidden_states(tokens)
    except TokensRead as e:
        raise tokens_read(e) from None
    finally:
        model.train(was_training)


def check_logits(folder, idx, ours):
    """(3): UserError unless transformers, loading folder, computes our_outputs ours of idx; False when transformers
    is not installed (nothing compared)."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging
    except ImportError:
        return False
    logging.disable_progress_bar()  # its weight-loading bar would be the export's only stderr output
    theirs = AutoModelForCausalLM.from_pretrained(folder).float().eval()
    with torch.no_grad():
        outputs = theirs(idx[:, :LOGITS_POSITIONS]).logits, theirs.model(idx).last_hidden_state
    for expected, actual in zip(ours, outputs):
        difference = (expected - actual).abs().max().item()
        if not difference <= 1e-4 * max(1.0, expected.abs().max().item()):
            raise UserError(f"transformers' {type(theirs).__name__} computes other logits from the written folder "
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
                raise UserError(f"token {token!r} cannot be made by merging earlier tokens; not a BPE vocabulary")
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
        raise UserError(f"tokenizer {meta['tokenizer']!r} cannot be written as tokenizer.json; only gpt2 and char")
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


def write_folder(model, meta, config, folder):
    """model.safetensors, the tokenizer files and config.json into the (existing, empty) folder."""
    from safetensors.torch import save_file  # only exports need safetensors

    save_file(hf_state_dict(model), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    if meta:
        write_json(os.path.join(folder, "tokenizer.json"), tokenizer_json(meta), indent=1, ensure_ascii=False)
        write_json(os.path.join(folder, "tokenizer_config.json"), dict(
            tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False,
            model_max_length=model.config.block_size, **({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
                                                        if meta["tokenizer"] == "gpt2" else {})), indent=1)
    write_json(os.path.join(folder, "config.json"), config, indent=1, ensure_ascii=False)


EXPORT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def export_hf(model, meta, folder):
    """Write model (a GPT on the CPU, in float32) and its tokenizer (meta) to folder in the Hugging Face format,
    after checking that it is exactly a Llama or Qwen3; return (the config.json dict, whether transformers
    checked the logits). The files are written to a temp folder, moved into folder only when every check has
    passed, and replace an earlier export there; a folder holding anything else is refused."""
    weight = model.lm_head.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise UserError(f"export a CPU float32 model (this one is {weight.dtype} on {weight.device}), "
                        "e.g. gpt.checkpoint.load_model(out_dir)")
    if os.path.exists(folder) and not os.path.isdir(folder):  # else a FileExistsError once the export was checked
        raise UserError(f"{folder} is a file; export into a new or empty folder")
    others = sorted(set(os.listdir(folder)) - EXPORT_FILES) if os.path.isdir(folder) else []
    if others:
        raise UserError(f"{folder} holds files an export does not write ({', '.join(others[:3])}); "
                        "export into a new or empty folder, or one holding an earlier export")
    config = hf_config(model.config, meta.get("eot_token") if meta else None)
    check_tensors(hf_state_dict(model), config)
    idx = proof_ids(model.config)
    ours = our_outputs(model, idx)
    parent = os.path.dirname(os.path.abspath(folder))
    with failing_write(parent):  # a file where the path has a folder: one line
        os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(os.path.normpath(folder)) + ".tmp-", dir=parent)
    try:
        write_folder(model, meta, config, tmp)
        checked = check_logits(tmp, idx, ours)
        os.makedirs(folder, exist_ok=True)
        written = os.listdir(tmp)
        umask = os.umask(0o022)  # read back (os.umask sets it): the files get the mode any new file gets
        os.umask(umask)
        for name in sorted(written, key=lambda name: name == "config.json"):  # config.json last: then complete
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)  # safetensors writes through a private (0600) file
            os.replace(os.path.join(tmp, name), os.path.join(folder, name))
        for name in EXPORT_FILES - set(written):  # an earlier export's file that this one has not (tokenizer)
            if os.path.exists(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return config, checked
