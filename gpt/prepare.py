"""What the data/<name>/prepare.py scripts share: token shards and meta.json written atomically, in the format
gpt/shards.py reads."""

import contextlib
import glob
import json
import os

import numpy as np

from gpt import UserError
from gpt.files import atomic_open
from gpt.shards import HEADER_INTS, MAGIC, TOKEN_DTYPES


@contextlib.contextmanager
def dataset_file(path):
    """atomic_open(path), where a failed write (disk full, over quota) is a one-line UserError naming the file."""
    try:
        with atomic_open(path) as f:
            yield f
    except OSError as e:
        raise UserError(f"could not write {path} ({e.strerror or e}); no partial file was left: "
                        "fix that and run the same command again") from None


def shards_in(folder):
    """The shards train.py would read from folder, of either split (gpt/shards.py's `*_<split>_*.bin`): a prepare
    writing there must find none but its own, or they would be read together."""
    return sorted(glob.glob(os.path.join(folder, "*_train_*.bin")) + glob.glob(os.path.join(folder, "*_val_*.bin")))


def write_shard(path, tokens):
    """Write tokens as one shard, atomically; uint16 (version 1) when every token fits, else uint32 (version 2)."""
    tokens = np.asarray(tokens)
    if len(tokens) >= 2**31:
        raise UserError(f"{path}: {len(tokens):,} tokens do not fit one shard's int32 count; use smaller shards")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise UserError(f"{path}: token ids must lie in [0, 2**32)")
    version = 1 if len(tokens) == 0 or tokens.max() < 2**16 else 2
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = MAGIC, version, len(tokens)
    with dataset_file(path) as f:
        f.write(header.tobytes())
        f.write(np.ascontiguousarray(tokens, dtype=TOKEN_DTYPES[version]))  # no copy when already the right dtype


def write_meta(data_dir, meta):
    """Write meta.json (tokenizer, vocab_size, eot_token, and for "char" the character list), atomically."""
    with dataset_file(os.path.join(data_dir, "meta.json")) as f:
        f.write(json.dumps(meta, indent=1).encode())
