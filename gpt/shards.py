"""Token shards: the llm.c file format, dataset metadata, and the loader train.py samples batches from.

A shard is a 1024-byte header of 256 little-endian int32 (magic, version, token count, then zeros), then the tokens:
uint16 for version 1 (llm.c's, so its GPT-2 shards load unchanged), uint32 for version 2 (vocabularies above 65,535).
Dataset folders (`*_<split>_*.bin` and meta.json) and the loader's order: data/README.md.
"""

import glob
import json
import os

import numpy as np

from gpt import UserError

MAGIC = 20240520  # llm.c's token shard magic
HEADER_INTS, HEADER_BYTES = 256, 1024
TOKEN_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}  # version -> token dtype


def read_shard(path):
    """The tokens of a shard as a read-only memory map, after checking its header against the file size."""
    size = os.path.getsize(path)
    magic, version, count = np.fromfile(path, dtype="<i4", count=3) if size >= HEADER_BYTES else (0, 0, 0)
    dtype = TOKEN_DTYPES.get(int(version))
    if magic != MAGIC or dtype is None or size != HEADER_BYTES + int(count) * dtype.itemsize:
        raise UserError(f"{path}: not a token shard whose header (magic {magic}, version {version}, {count} tokens) "
                        f"fits its {size} bytes: truncated or corrupt; delete it and re-run the prepare script")
    if count == 0:  # mmap cannot map zero bytes
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(int(count),))


def require_dir(data_dir):
    if not os.path.isdir(data_dir):
        from gpt.hints import missing_dataset  # imported only on the error, as every hint
        raise UserError(f"dataset folder {data_dir} not found; {missing_dataset(data_dir)}")


def load_meta(data_dir):
    """The dataset's meta.json; a folder of shards without one (as llm.c writes them) is read as GPT-2 tokens."""
    require_dir(data_dir)
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        from gpt.bpe import GPT2_META
        return dict(GPT2_META)
    try:
        with open(path) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or "tokenizer" not in meta or type(meta.get("vocab_size")) is not int:
            raise ValueError("a tokenizer and an int vocab_size are missing")  # a KeyError or TypeError later
        return meta
    except ValueError as e:
        from gpt.hints import rerun
        raise UserError(f"{path}: not a dataset's meta.json ({e}); {rerun(data_dir)}") from None


def check_vocab(data_dir, meta, model_vocab_size):
    """Fail early if the data can hold token ids the model has no embedding for."""
    if meta["vocab_size"] > model_vocab_size:
        raise UserError(f"{os.path.join(data_dir, 'meta.json')}: vocab_size {meta['vocab_size']} exceeds the model's "
                        f"vocab_size {model_vocab_size}; set the model's vocab_size to at least {meta['vocab_size']}")


def find_shards(data_dir, split):
    """The shard files of a split, in name order: `*_<split>_*.bin` (llm.c's fineweb_val_000000.bin works as is)."""
    require_dir(data_dir)
    paths = sorted(glob.glob(os.path.join(data_dir, f"*_{split}_*.bin")))
    if not paths:
        from gpt.hints import missing_shards
        raise UserError(f"no {split} shards (*_{split}_*.bin) in {data_dir}; {missing_shards(data_dir)}")
    return paths


class ShardLoader:
    """Batches of block_size + 1 token windows from the shards of one split, reproducible from (seed, position), in the
    order data/README.md describes. Rank r of W takes windows r, r + W, ... of each shard (the < W left over are
    skipped), so all ranks (same seed) move in lockstep and one position (epoch, shard, window) is the state of all."""

    def __init__(self, data_dir, split, batch_size, block_size, seed=0, rank=0, world_size=1, device="cpu"):
        self.paths = find_shards(data_dir, split)
        self.shards = [read_shard(p) for p in self.paths]
        self.batch_size, self.window_len = batch_size, block_size + 1
        self.seed, self.rank, self.world_size, self.device = seed, rank, world_size, device
        # windows per shard and epoch: all that fit, less one when there are several (room to shift the grid)
        self.windows = [n - 1 if n >= 2 else n for n in (len(s) // self.window_len for s in self.shards)]
        self.windows_per_rank = [n // world_size for n in self.windows]
        if sum(self.windows_per_rank) == 0:
            raise UserError(f"{data_dir}: the {split} split ({sum(map(len, self.shards))} tokens in {len(self.shards)} "
                            f"shards) is shorter than one window of block_size + 1 = {self.window_len} tokens per shard "
                            "and rank; lower block_size or prepare more data")
        self.epoch, self.shard, self.window, self._order_key, self._order = 0, 0, 0, None, None

    def state_dict(self):
        """The next window's position: epoch, index into its shard order, window in this rank's share of the shard."""
        return {"epoch": self.epoch, "shard": self.shard, "window": self.window, "world_size": self.world_size}

    def load_state_dict(self, state):
        """Resume at a saved position, also on another number of ranks: the windows all ranks took together are the
        same, so the next global batch is too (up to the < W windows skipped at a shard's end)."""
        epoch, shard, window = int(state["epoch"]), int(state["shard"]), int(state["window"])
        window = window * int(state.get("world_size", self.world_size)) // self.world_size  # older: same ranks
        if not 0 <= shard < len(self.shards) or window < 0:
            raise UserError(f"loader position {state} does not fit the {len(self.shards)} shards of {self.paths[0]} and "
                            "its siblings; the data changed since the checkpoint, resume with the data it was made from")
        self.epoch, self.shard, self.window = epoch, shard, window

    def _orders(self):
        """This epoch's current shard, its grid offset and window order (cached: computed once per shard)."""
        key = (self.epoch, self.shard)
        if key != self._order_key:
            shard_id = int(np.random.default_rng([self.seed, self.epoch]).permutation(len(self.shards))[self.shard])
            rng = np.random.default_rng([self.seed, self.epoch, shard_id])
            n_windows = self.windows[shard_id]
            offset = int(rng.integers(len(self.shards[shard_id]) - n_windows * self.window_len + 1))
            self._order_key, self._order = key, (shard_id, offset, rng.permutation(n_windows))
        return self._order

    def _next_window(self):
        # move past finished (or too short) shards, and past the end of the epoch
        while self.window >= self.windows_per_rank[self._orders()[0]]:
            self.window, self.shard = 0, self.shard + 1
            if self.shard == len(self.shards):
                self.shard, self.epoch = 0, self.epoch + 1
        shard_id, offset, window_order = self._orders()
        start = offset + int(window_order[self.window * self.world_size + self.rank]) * self.window_len
        self.window += 1
        return self.shards[shard_id][start:start + self.window_len]

    def next_batch(self):
        """x, y: int64 tensors of shape (batch_size, block_size) on the device; y is x shifted by one token."""
        import torch  # here, not at the top: the prepare scripts read this file's constants and start without torch
        windows = np.stack([self._next_window() for _ in range(self.batch_size)]).astype(np.int64)  # (B, T+1)
        pinned = torch.device(self.device).type == "cuda"  # pinned host memory lets the copy overlap with compute
        return tuple((t.pin_memory() if pinned else t).to(self.device, non_blocking=pinned)  # on the CPU: t itself
                     for t in (torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())))
