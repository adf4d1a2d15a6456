"""FineWeb (or any large text corpus) in GPT-2 tokens, written as llm.c shards of --shard_size tokens.

    python data/fineweb/prepare.py                                    # HuggingFaceFW/fineweb sample-10BT, streamed
    python data/fineweb/prepare.py --data_files 'corpus/*.parquet'    # local .parquet, .json/.jsonl or .txt files

Worker processes tokenize the documents; each document is prefixed with the end-of-text token (as llm.c
does), so the model sees where a new one starts. The token stream is cut into shards: the first is val
(fineweb_val_000000.bin), the rest train (fineweb_train_000001.bin, ...). Memory stays bounded whatever the
corpus size: documents are streamed, a few batches of them are in flight, and one shard is buffered.

Resume: after each finished shard, progress.json records where the stream stands (documents used, tokens
used of the next one). A rerun skips the finished shards and those documents, and writes exactly the files
an uninterrupted run would have. Shards are written under a temp name and renamed, so none is half-written.
"""

import argparse
import collections
import contextlib
import glob
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from datasets import load_dataset
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # run as a script: make `data` importable
from gpt import UserError
from gpt.prepare import dataset_file, shards_in, write_meta, write_shard
from gpt.bpe import GPT2_META
from gpt.tokenizer import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text"}  # extension -> datasets builder
DOCS_PER_TASK = 64  # documents sent to a worker at a time: large enough to amortize the inter-process copy


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="HuggingFaceFW/fineweb", help="Hugging Face hub dataset to stream")
    parser.add_argument("--name", default="sample-10BT", help="its configuration")
    parser.add_argument("--data_files", nargs="+", help="local files or globs instead of the hub (a .txt file is one document)")
    parser.add_argument("--text_field", default="text", help="the column holding each document's text")
    parser.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per shard")
    parser.add_argument("--num_workers", type=int, default=os.cpu_count(), help="tokenizer processes (1: tokenize in this one)")
    parser.add_argument("--out_dir", default=HERE, help="where shards, meta.json and progress.json go (default: this folder)")
    args = parser.parse_args(argv)
    if args.shard_size < 1 or args.num_workers < 1:
        parser.error("--shard_size and --num_workers must be at least 1")
    return args


def local_files(patterns):
    """The files matching the patterns, in a fixed order (so a rerun reads documents in the same order)."""
    files = [f for pattern in patterns for f in sorted(glob.glob(pattern))]
    if not files:
        raise UserError(f"--data_files {' '.join(patterns)}: no such files")
    kinds = {os.path.splitext(f)[1] for f in files}
    if len({BUILDERS.get(kind) for kind in kinds}) != 1 or not kinds <= BUILDERS.keys():  # .json with .jsonl is one
        raise UserError(f"--data_files must all be of one kind, .parquet, .json/.jsonl or .txt (got {', '.join(sorted(kinds))})")
    return files


def open_corpus(args, files):
    """The corpus as a stream of records (dicts): from local files, or streamed from the hub."""
    if files:
        builder = BUILDERS[os.path.splitext(files[0])[1]]
        options = {"sample_by": "document"} if builder == "text" else {}  # a whole .txt file is one document
        return load_dataset(builder, data_files=files, split="train", streaming=True, **options)
    try:
        return load_dataset(args.dataset, name=args.name, split="train", streaming=True)
    except Exception as e:  # offline, unknown name, ...: datasets raises many kinds
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"could not open {args.dataset} ({args.name}) on the Hugging Face hub: {reason}; "
                        "check the name and your connection, or pass --data_files with local files") from None


def text_batches(records, field, skip):
    """Lists of DOCS_PER_TASK document texts, after the first `skip` documents (read again, not tokenized).
    Reading in batches of the text column alone is ~10x faster than row by row."""
    if records.column_names is not None and field not in records.column_names:
        raise UserError(f"the documents have no '{field}' column (they have {', '.join(records.column_names)}); pass --text_field")
    for batch in records.skip(skip).select_columns([field]).iter(batch_size=DOCS_PER_TASK):
        yield batch[field]


def tokenize(texts):
    """Worker: each document's GPT-2 tokens, prefixed with the end-of-text token."""
    tokenizer = Tokenizer(GPT2_META)  # tiktoken caches the encoding after a process's first call
    return [np.array([tokenizer.eot] + tokenizer.encode(text), dtype=np.uint16) for text in texts]


def tokenize_stream(batches, pool, in_flight):
    """Each document's tokens, in corpus order. Batches of documents go to the pool's workers; at most
    `in_flight` batches are pending at a time, so memory stays bounded however fast the corpus is read."""
    if pool is None:  # one process: tokenize right here
        for batch in batches:
            yield from tokenize(batch)
        return
    pending = collections.deque()
    for batch in batches:
        pending.append(pool.submit(tokenize, batch))
        if len(pending) == in_flight:
            yield from pending.popleft().result()
    for future in pending:
        yield from future.result()


def shard_path(out_dir, index):
    split = "val" if index == 0 else "train"  # the first shard is the validation split, as in llm.c
    return os.path.join(out_dir, f"fineweb_{split}_{index:06d}.bin")


def load_progress(out_dir, settings):
    """Where an earlier run stopped: shards written, documents used, tokens used of the next document."""
    path = os.path.join(out_dir, "progress.json")
    if not os.path.exists(path):
        if shards_in(out_dir):
            raise UserError(f"{out_dir} holds shards but no progress.json (another run's, which train.py would read "
                            "with these); prepare into another --out_dir, or remove them")
        return {"settings": settings, "shards": 0, "docs": 0, "offset": 0, "done": False}
    try:
        with open(path) as f:
            progress = json.load(f)
        if not isinstance(progress, dict) or not {"settings", "shards", "docs", "offset", "done"} <= progress.keys():
            raise ValueError  # edited by hand, or not this script's
    except ValueError:
        raise UserError(f"{path} is damaged; remove it and the folder's shards, and run again") from None
    if progress["settings"] != settings:
        raise UserError(f"{path}: an earlier run used other settings ({progress['settings']}); "
                        "rerun with those, or use another --out_dir")
    return progress


def save_progress(out_dir, progress):
    with dataset_file(os.path.join(out_dir, "progress.json")) as f:
        f.write(json.dumps(progress, indent=1).encode())


def write_shards(docs, out_dir, shard_size, progress):
    """Cut the documents' token stream into shards, recording progress after each one. `docs` starts at
    document progress["docs"], of which the first progress["offset"] tokens are already in earlier shards."""
    buffer = np.empty(shard_size, dtype=np.uint16)
    filled, skip = 0, progress["offset"]
    bar = tqdm(unit="tok", unit_scale=True, initial=progress["shards"] * shard_size)
    for doc in docs:
        rest, skip = doc[skip:], 0
        while len(rest):
            take = min(shard_size - filled, len(rest))
            buffer[filled:filled + take] = rest[:take]
            filled, rest = filled + take, rest[take:]
            bar.update(take)
            if filled == shard_size:
                write_shard(shard_path(out_dir, progress["shards"]), buffer)
                filled = 0
                progress.update(shards=progress["shards"] + 1, offset=len(doc) - len(rest))
                save_progress(out_dir, progress)
        progress.update(docs=progress["docs"] + 1, offset=0)
    if filled:  # the last, shorter shard
        write_shard(shard_path(out_dir, progress["shards"]), buffer[:filled])
        progress["shards"] += 1
    progress["done"] = True
    save_progress(out_dir, progress)
    bar.close()


def main(argv=None):
    args = parse_args(argv)
    files = local_files(args.data_files) if args.data_files else None
    source = files or f"{args.dataset}/{args.name}"
    settings = {"source": source, "text_field": args.text_field, "shard_size": args.shard_size}
    os.makedirs(args.out_dir, exist_ok=True)
    progress = load_progress(args.out_dir, settings)
    if progress["done"]:
        print(f"{args.out_dir}: all {progress['shards']} shards are already written")
        return
    if progress["shards"]:
        print(f"resuming after {progress['shards']} finished shards ({progress['docs']:,} documents)")
    records = open_corpus(args, files)
    write_meta(args.out_dir, GPT2_META)

    batches = text_batches(records, args.text_field, skip=progress["docs"])
    pool = ProcessPoolExecutor(args.num_workers) if args.num_workers > 1 else contextlib.nullcontext()
    with pool as pool:
        write_shards(tokenize_stream(batches, pool, in_flight=2 * args.num_workers), args.out_dir, args.shard_size, progress)
    print(f"{args.out_dir}: {progress['shards']} shards from {progress['docs']:,} documents")
    if progress["shards"] == 1:
        print("note: the whole corpus fit in one shard, the val shard; lower --shard_size to get train shards")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C: no traceback; the shards written so far are kept, and a rerun goes on
        sys.exit(130)
