"""Tiny Shakespeare at the character level: each of its 65 distinct characters is a token; 90% train, 10% val.

    python data/shakespeare_char/prepare.py [--input PATH] [--out_dir DIR]

Reads input.txt in this folder if there is one, else the copy in data/shakespeare/ (downloaded if missing).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # run as a script: make `data` importable
from data.shakespeare.prepare import read_text, write_splits
from gpt import UserError
from gpt.tokenizer import Tokenizer, char_meta

HERE = os.path.dirname(os.path.abspath(__file__))
LOCAL_TEXT = os.path.join(HERE, "input.txt")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="the text file (default: input.txt here, else data/shakespeare/input.txt)")
    parser.add_argument("--out_dir", default=HERE, help="where the shards and meta.json go (default: this folder)")
    args = parser.parse_args(argv)

    text = read_text(args.input or (LOCAL_TEXT if os.path.isfile(LOCAL_TEXT) else None))
    write_splits(text, Tokenizer(char_meta(text)), args.out_dir, "shakespeare_char")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
