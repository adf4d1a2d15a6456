"""Tiny Shakespeare in GPT-2 tokens (tiktoken BPE): the first 90% of the text is train, the rest val.

    python data/shakespeare/prepare.py [--input PATH] [--out_dir DIR]

The text ships in this folder (input.txt, public domain); if it is missing it is downloaded once.
"""

import argparse
import os
import sys
import urllib.request

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # run as a script: make `data` importable
from gpt import UserError
from gpt.prepare import dataset_file, shards_in, write_meta, write_shard
from gpt.bpe import GPT2_META
from gpt.tokenizer import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "input.txt")
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TRAIN_FRACTION = 0.9


def read_text(path=None):
    """The text at `path` if given, else the repo's copy, else downloaded (and saved as the repo's copy)."""
    if path is not None:
        if not os.path.isfile(path):
            raise UserError(f"--input {path}: no such file")
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError:
            raise UserError(f"--input {path}: not UTF-8 text; convert it first (iconv -f latin1 -t utf-8)") from None
    if not os.path.isfile(TEXT):
        print(f"{TEXT} is missing, downloading {URL}")
        try:
            with urllib.request.urlopen(URL, timeout=30) as response:
                data = response.read()
        except OSError as e:  # no network, DNS failure, HTTP error: all OSErrors
            raise UserError(f"could not download Tiny Shakespeare ({e}); pass --input PATH to a local copy") from None
        with dataset_file(TEXT) as f:
            f.write(data)
    return read_text(TEXT)


def split_text(text):
    """Train and val text, split at a character boundary like nanoGPT."""
    n = int(len(text) * TRAIN_FRACTION)
    return text[:n], text[n:]


def write_splits(text, tokenizer, out_dir, name):
    """The train and val parts of text, tokenized, as one shard each (name_train_000000.bin, ...), and meta.json,
    in out_dir, which holds no other shards: train.py would read them with these (another tokenizer's, say)."""
    if not text:  # else 0 tokens and a vocabulary of 0, refused only by train.py, and as too short for block_size
        raise UserError("the text is empty: nothing to prepare; give a text file with --input")
    ours = {os.path.join(out_dir, f"{name}_{split}_000000.bin") for split in ("train", "val")}
    others = sorted(set(shards_in(out_dir)) - ours)
    if others:
        raise UserError(f"{out_dir} holds other shards ({', '.join(map(os.path.basename, others[:3]))}), which "
                        "train.py would read with these; prepare into another --out_dir, or remove them")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:  # a file there, or no permission
        raise UserError(f"cannot make --out_dir {out_dir} ({e.strerror})") from None
    for split, part in zip(["train", "val"], split_text(text)):
        tokens = np.array(tokenizer.encode(part), dtype=np.uint32)  # "<|endoftext|>" in the text is plain text
        write_shard(os.path.join(out_dir, f"{name}_{split}_000000.bin"), tokens)
        print(f"{split}: {len(tokens):,} tokens")
    write_meta(out_dir, tokenizer.meta)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="the text file (default: input.txt in this folder)")
    parser.add_argument("--out_dir", default=HERE, help="where the shards and meta.json go (default: this folder)")
    args = parser.parse_args(argv)
    write_splits(read_text(args.input), Tokenizer(GPT2_META), args.out_dir, "shakespeare")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
