"""
Byte-level BPE vocabularies through tiktoken, for gpt/tokenizer.py's Tokenizer: GPT-2's from the files shipped in
gpt/tokenizer_files/gpt2/ (no network), and a Hugging Face tokenizer.json where tiktoken reproduces it exactly.
"""

import functools
import json
import os

from gpt import UserError

GPT2_META = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_token": 50256}
# GPT-2's vocab.bpe and encoder.json as tiktoken downloads them, byte for byte (with OpenAI's Modified MIT License)
GPT2_FILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer_files", "gpt2")
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def meta_encoding(meta):
    """The tiktoken Encoding of a BPE meta dict: {"tokenizer": "bpe", "path": tokenizer.json} or a tiktoken name."""
    return tiktoken_encoding(meta["path"]) if meta["tokenizer"] == "bpe" else named_encoding(meta["tokenizer"])


def named_encoding(name):
    """tiktoken's encoding `name`: GPT-2's from the shipped files (no network, no cache); others, and GPT-2's if those
    are missing, through tiktoken's download and cache (offline with no cached copy, the error says where it looks)."""
    import tiktoken

    if name == "gpt2" and os.path.isdir(GPT2_FILES):
        # before trying tiktoken's download, not after: offline it (requests, no timeout) can be slow to fail, or hang
        # where a firewall accepts the connection and says nothing
        return shipped_gpt2()
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # no network: requests' ConnectionError; an unknown name: ValueError; ...
        reason = (str(e) or type(e).__name__).splitlines()[0][:160]
        shipped = f"restore {GPT2_FILES} (git checkout -- gpt/tokenizer_files) or " if name == "gpt2" else ""
        raise UserError(f"cannot load tiktoken's {name!r} encoding ({reason}); offline, {shipped}set "
                             "TIKTOKEN_CACHE_DIR to a folder holding a cached copy of its files") from None


@functools.cache
def shipped_gpt2():
    """tiktoken.get_encoding("gpt2")'s Encoding, built from the shipped files as tiktoken's
    data_gym_to_mergeable_bpe_ranks builds it (the 256 bytes, then a token per merge, checked against encoder.json's
    ids), not by calling it: it would copy both files into tiktoken's cache folder, and fail where that is read-only."""
    import tiktoken
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    eot = GPT2_META["eot_token"]
    try:
        with open(os.path.join(GPT2_FILES, "vocab.bpe"), "rb") as f:
            merges = [line.split() for line in f.read().decode().split("\n")[1:-1]]  # line 1: "#version: 0.2"
        with open(os.path.join(GPT2_FILES, "encoder.json"), "rb") as f:
            encoder = json.loads(f.read())
        to_byte = {u: b for b, u in byte_to_unicode().items()}
        ranks = {bytes([b]): i for i, b in enumerate(to_byte.values())}  # the same order as tiktoken's
        ranks.update({bytes(to_byte[c] for c in a + b): len(to_byte) + i for i, (a, b) in enumerate(merges)})
        consistent = (encoder.pop(ENDOFTEXT, None) == eot
                      and ranks == {bytes(to_byte[c] for c in token): i for token, i in encoder.items()})
    except (OSError, ValueError, KeyError) as e:  # a missing or unreadable file, bad JSON or UTF-8, a bad line
        consistent, reason = False, f" ({type(e).__name__}: {str(e)[:100]})"
    else:
        reason = ""
    if not consistent:
        raise UserError(f"{GPT2_FILES}: vocab.bpe or encoder.json is damaged{reason}; restore them "
                             "from git (git checkout -- gpt/tokenizer_files)")
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: eot}, explicit_n_vocab=GPT2_META["vocab_size"])


# ----------------------------------------------------------------------------------------------------
# tokenizer.json (Hugging Face) read through tiktoken


def byte_to_unicode():
    """GPT-2's map from each byte to a printable character, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


def tiktoken_encoding(path):
    """A tiktoken Encoding equal to tokenizer.json's byte-level BPE. tiktoken merges the pair whose result has the
    lowest id, so ids must follow the merge order; checked."""
    import tiktoken

    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    splits = [step for step in steps if step.get("type") == "Split"]
    byte_level = steps[-1] if kinds[-1:] == ["ByteLevel"] else {}
    regexes = [step.get("pattern", {}).get("Regex") for step in splits] + [GPT2_PATTERN] * byte_level.get("use_regex", True)
    # what tiktoken does: one regex split (byte-level's GPT-2 one or a Split step), then bytes; no digit splitting etc.
    readable = (model.get("type") == "BPE" and byte_level and not byte_level.get("add_prefix_space")
                and set(kinds) <= {"Split", "ByteLevel"} and len(regexes) == 1 and None not in regexes
                and all(step.get("behavior") == "Isolated" and not step.get("invert") for step in splits)
                and (spec.get("normalizer") or {}).get("type") in (None, "NFC"))
    if not readable:
        raise UserError(f"{path}: only byte-level BPE tokenizers that split by one regex (GPT-2, Llama 3, Qwen) "
                             "can be read here")
    pattern = regexes[0]
    to_byte = {u: b for b, u in byte_to_unicode().items()}
    vocab = model["vocab"]
    ranks = {bytes(to_byte[ch] for ch in text): i for text, i in vocab.items()}
    merged_ids = [vocab.get("".join(m.split(" ", 1) if isinstance(m, str) else m)) for m in model.get("merges", [])]
    if any(a is None or b is None or a >= b for a, b in zip(merged_ids, merged_ids[1:])):
        raise UserError(f"{path}: token ids do not follow the merge order, so tiktoken cannot reproduce it")
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t["content"] not in vocab}
    return tiktoken.Encoding(name=os.path.basename(os.path.dirname(os.path.abspath(path))), pat_str=pattern,
                             mergeable_ranks=ranks, special_tokens=special)


def gpt2_ranks():
    """tiktoken's GPT-2 vocabulary, or None when its files can't be had."""
    try:
        return named_encoding("gpt2")._mergeable_ranks
    except UserError:
        return None


def tokenizer_json_meta(path, eot_token=None):
    """The meta dict of a tokenizer.json: GPT-2's BPE and character vocabularies get the meta that data prepared here
    has, another byte-level BPE tiktoken reads exactly {"tokenizer": "bpe", "path": ...}, else a UserError."""
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model") or {}
    vocab = model.get("vocab", {})
    if (model.get("type") == "BPE" and not model.get("merges") and (spec.get("decoder") or {}).get("type") == "Fuse"
            and sorted(vocab.values()) == list(range(len(vocab))) and all(len(c) == 1 for c in vocab)):
        chars = sorted(vocab, key=vocab.get)  # in id order, which need not be sorted
        return {"tokenizer": "char", "vocab_size": len(chars), "eot_token": None, "chars": chars}
    enc = tiktoken_encoding(path)  # fails here, with the reason, if tiktoken cannot read it
    nfc = (spec.get("normalizer") or {}).get("type") == "NFC"  # Qwen's: prompts are normalized first
    if not nfc and enc.n_vocab == 50257 and enc._pat_str == GPT2_PATTERN and enc._mergeable_ranks == gpt2_ranks():
        return dict(GPT2_META)
    vocab_size = 1 + max([*vocab.values(), *(token["id"] for token in spec.get("added_tokens", []))])
    return dict(tokenizer="bpe", vocab_size=vocab_size, eot_token=eot_token, path=os.path.abspath(path), nfc=nfc)
