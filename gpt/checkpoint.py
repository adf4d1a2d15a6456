"""
Where models come from: train.py's ckpt.pt (loaded without running code; gpt/files.py writes it) and, through
gpt/hf.py, Hugging Face folders. Every command loads through here, so a missing, truncated or foreign file gets the same
one-line message everywhere.

    model, meta, dataset = load_model("out-small", device="cpu", dtype=torch.float32)   # or "hf:folder"
"""

import io
import os
from dataclasses import replace

import torch

from gpt import UserError
from model import GPT, GPTConfig


def first_line(error):
    return (str(error) or type(error).__name__).splitlines()[0]


def checkpoint_path(source):
    """The ckpt.pt of an out_dir, or source itself when it names a .pt file."""
    return source if source.endswith(".pt") else os.path.join(source, "ckpt.pt")


def load_checkpoint(path, data=None):
    """The dict train.py saved at path (a ckpt.pt), loaded with weights_only=True: opening it never runs code.
    data: the file's bytes, where another process read them (train.py's rank 0, for ranks on other nodes)."""
    if data is None and not os.path.exists(path):
        from gpt.hints import train_command
        raise UserError(f"no checkpoint at {path}; train one first (--init_from=scratch, the default): "
                              f"{train_command(path)}")
    try:
        return torch.load(path if data is None else io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or corrupt files raise several kinds
        raise UserError(f"cannot read checkpoint {path} ({first_line(e)}); it is truncated or corrupt") from None


def load_weights(model, state, path, config_file=None):
    """model.load_state_dict(state), where tensors that do not fit (model.py changed since the file was written) are a
    UserError naming them: torch's error lists them over many lines, and its first line names none. config_file: the
    file the model was built from, where that is not path's own checkpoint (a Hugging Face folder's config.json)."""
    mismatch = tensor_mismatch(model.state_dict(), state)
    if mismatch and config_file:  # weights and config file disagree, or model.py was changed: the names say which
        raise UserError(f"{path} does not fit the model this model.py builds from its {config_file}: {mismatch}")
    if mismatch:
        raise UserError(f"{path} does not fit this model.py: {mismatch}; it was written by a model of another "
                              "shape: retrain with this model.py, or undo the edit to load it")
    model.load_state_dict(state)


def tensor_mismatch(expected, state):
    """In one line ("" if none), what keeps state from loading into expected: the names missing, unexpected and of
    another shape, in the model's order, at most 5 of each."""
    def listed(what, names):
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        return f"{what} {', '.join(names[:5])}{more}" if names else ""

    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    reshaped = [f"{name} {size(state[name])} (model: {size(expected[name])})"
                for name in expected if name in state and state[name].shape != expected[name].shape]
    return "; ".join(filter(None, [listed("missing", missing), listed("unexpected", unexpected),
                                   listed("other shape:", reshaped)]))


def size(tensor):
    return "x".join(map(str, tensor.shape)) or "scalar"


def load_hf(folder, dropout=None):
    """The GPT (fp32, on the CPU) of a local Hugging Face Llama or Qwen3 folder, which gpt/hf.py reads, and its
    tokenizer's meta dict (None when the folder has no tokenizer.json). dropout: a fine-tuning run's (else the
    folder's config's)."""
    from gpt.hf import read_hf  # Hugging Face's format: only this path needs it
    config, state, weights, meta = read_hf(folder)
    model = GPT(config if dropout is None else replace(config, dropout=dropout))
    load_weights(model, state, weights, config_file="config.json")
    return model, meta


def load_model(source, device="cpu", dtype=torch.float32, init_from="resume"):
    """The model (in eval mode, on device, in dtype), its tokenizer meta and the dataset it was trained on (None for a
    Hugging Face folder), from source: an out_dir holding ckpt.pt, a .pt file, or "hf:folder" for a Hugging Face
    Llama/Qwen3 folder with its tokenizer.json. init_from, a command's setting: "resume" loads source (its out_dir),
    "hf:folder" that folder instead."""
    if init_from != "resume" and not init_from.startswith("hf:"):
        raise UserError(f"init_from must be resume or hf:path/to/folder, got {init_from!r}")
    source = source if init_from == "resume" else init_from
    if source.startswith("hf:"):
        (model, meta), dataset = load_hf(source[3:]), None
        if meta is None:
            raise UserError(f"{source[3:]} has no tokenizer.json; the model's tokenizer is needed to read text")
    else:
        path = checkpoint_path(source)
        checkpoint = load_checkpoint(path)
        try:
            model, state, meta = GPT(GPTConfig(**checkpoint["model_config"])), checkpoint["model"], checkpoint["meta"]
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise UserError(f"{path} is not a checkpoint written by train.py ({type(e).__name__}: "
                            f"{first_line(e)})") from None
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise UserError(f"{path} is not a checkpoint written by train.py (its model is not a dict of tensors)")
        load_weights(model, state, path)
        dataset = checkpoint.get("settings", {}).get("dataset")
    return model.to(device=device, dtype=dtype).eval(), meta, dataset


def load_pretrained(folder, meta, dropout):
    """The model of a Hugging Face folder to fine-tune (train.py's init_from="hf:folder") with the run's dropout; its
    tokenizer must be the data's (meta)."""
    model, model_meta = load_hf(folder, dropout)
    if model_meta is not None and model_meta != meta:
        raise UserError(f"the model in {folder} has another tokenizer ({model_meta['tokenizer']}, "
                        f"{model_meta['vocab_size']} tokens) than the dataset ({meta['tokenizer']}, {meta['vocab_size']} "
                        "tokens); prepare the data with the model's tokenizer")
    return model
