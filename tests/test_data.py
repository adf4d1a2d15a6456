"""Tests for the token shards: format, prepare scripts, resume, errors, and the loader's sampling."""

import glob
import json
import os
import re
import resource
import shlex
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from data.shakespeare import prepare as shakespeare
from data.shakespeare_char import prepare as shakespeare_char
from gpt import UserError
from gpt.files import atomic_open
from gpt.prepare import write_meta, write_shard
from gpt.shards import ShardLoader, check_vocab, load_meta, read_shard
from gpt.bpe import named_encoding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_PATH = os.path.join(ROOT, "data", "shakespeare", "input.txt")
LLMC_MAGIC, GPT2_EOT = 20240520, 50256  # from llm.c's format and GPT-2's vocabulary, not from our code


class Crash(Exception):
    pass


def run_script(*args, max_file_bytes=None):
    """Run a script; with max_file_bytes, the kernel refuses to grow any file it writes past that size
    (EFBIG, "File too large"), which is what a full disk (ENOSPC) or a quota (EDQUOT) does to a write."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    limit = max_file_bytes and (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes)))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, preexec_fn=limit)


def same_files(folder_a, folder_b):
    """Both folders hold the same file names with the same bytes."""
    names = sorted(os.listdir(folder_a))
    return names == sorted(os.listdir(folder_b)) and all(
        open(os.path.join(folder_a, n), "rb").read() == open(os.path.join(folder_b, n), "rb").read() for n in names)


def assert_user_error(result):
    """A script failed with one line for the user, not a traceback."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def split_tokens(data_dir, split):
    paths = sorted(p for p in os.listdir(data_dir) if p.endswith(".bin") and f"_{split}_" in p)
    return [np.array(read_shard(os.path.join(data_dir, p))) for p in paths]


# --- the shard format ---

@pytest.mark.parametrize("high, version, dtype", [(50257, 1, "<u2"), (100_000, 2, "<u4")])
def test_header_round_trip(tmp_path, high, version, dtype):
    tokens = np.random.default_rng(0).integers(0, high, size=1000)
    tokens[0] = high - 1
    path = tmp_path / "x_train_000000.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    header = struct.unpack("<256i", raw[:1024])
    assert header[:3] == (LLMC_MAGIC, version, 1000) and not any(header[3:])
    assert np.array_equal(np.frombuffer(raw[1024:], dtype=dtype), tokens)
    back = read_shard(path)
    assert np.array_equal(back, tokens) and not back.flags.writeable
    assert not os.path.exists(f"{path}.tmp")


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "meta.json"
    path.write_bytes(b"old")
    with pytest.raises(Crash):
        with atomic_open(path) as f:
            f.write(b"half of the new")
            raise Crash
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["meta.json"]


def test_reads_hand_made_llmc_shard(tmp_path):
    # what llm.c's fineweb.py writes: int32 header, uint16 tokens; and no meta.json in the folder
    tokens = np.arange(GPT2_EOT - 999, GPT2_EOT + 1, dtype=np.uint16)
    header = struct.pack("<256i", LLMC_MAGIC, 1, len(tokens), *[0] * 253)
    for name in ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]:
        (tmp_path / name).write_bytes(header + tokens.astype("<u2").tobytes())
    assert np.array_equal(read_shard(tmp_path / "fineweb_val_000000.bin"), tokens)
    assert load_meta(tmp_path)["vocab_size"] == GPT2_EOT + 1
    x, y = ShardLoader(tmp_path, "train", batch_size=2, block_size=8).next_batch()
    assert x.shape == y.shape == (2, 8) and x.dtype == y.dtype == torch.int64
    assert (y == x + 1).all()  # consecutive tokens, shifted by one


# --- the Shakespeare prepare scripts ---
# Their main() runs in this process where a test is about what they write; their processes run where it is about the
# process: its one-line errors, a full disk (a limit on the process), the command a missing dataset names, and
# tests/test_offline.py's offline run of data/shakespeare/prepare.py.


@pytest.fixture(scope="module")
def char_prepared(tmp_path_factory):
    """A folder that data/shakespeare_char/prepare.py prepared; the tests only read it."""
    folder = tmp_path_factory.mktemp("shakespeare_char")
    shakespeare_char.main(["--out_dir", str(folder)])
    return folder


def test_shakespeare_char_prepare(char_prepared):
    text = open(TEXT_PATH, encoding="utf-8").read()
    meta = json.loads((char_prepared / "meta.json").read_text())
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == 65 == len(meta["chars"])
    assert meta["chars"] == sorted(set(text))
    n_train = len(text) * 9 // 10
    (train,), (val,) = split_tokens(char_prepared, "train"), split_tokens(char_prepared, "val")
    assert (len(train), len(val)) == (n_train, len(text) - n_train)
    decode = lambda ids: "".join(meta["chars"][i] for i in ids)
    assert decode(train) + decode(val) == text


def test_shakespeare_bpe_prepare(tmp_path):
    shakespeare.main(["--out_dir", str(tmp_path)])
    text = open(TEXT_PATH, encoding="utf-8").read()
    enc, n_train = named_encoding("gpt2"), len(text) * 9 // 10
    (train,), (val,) = split_tokens(tmp_path, "train"), split_tokens(tmp_path, "val")
    assert train.tolist() == enc.encode_ordinary(text[:n_train])
    assert val.tolist() == enc.encode_ordinary(text[n_train:])
    assert json.loads((tmp_path / "meta.json").read_text())["vocab_size"] == enc.n_vocab


def test_a_folder_holding_other_shards_is_refused_and_nothing_is_written(char_prepared, tmp_path):
    """The BPE prepare into a folder the character one prepared: both kinds of shards, one meta.json, which train.py
    read together (character ids as GPT-2 tokens, or an IndexError mid-run once the char meta came back)."""
    folder = tmp_path / "mine"
    shutil.copytree(char_prepared, folder)
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    with pytest.raises(UserError, match=rf"^{re.escape(str(folder))} holds other shards \(shakespeare_char_train_000000"
                                        r"\.bin, shakespeare_char_val_000000\.bin\), which train.py would read"):
        shakespeare.main(["--out_dir", str(folder)])
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    shakespeare_char.main(["--out_dir", str(folder)])  # its own shards it replaces
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before


def test_a_character_vocabulary_past_uint16_is_written_as_uint32(tmp_path):
    """A text of 70,000 distinct characters: version 2 shards (an OverflowError in a uint16 array before)."""
    text = "".join(map(chr, range(0x10000, 0x10000 + 70_000)))  # past the Basic Multilingual Plane: each once
    (tmp_path / "many.txt").write_text(text * 2, encoding="utf-8")
    shakespeare_char.main(["--input", str(tmp_path / "many.txt"), "--out_dir", str(tmp_path / "out")])
    (train,) = split_tokens(tmp_path / "out", "train")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["vocab_size"] == 70_000 and train.max() >= 2**16
    assert "".join(meta["chars"][i] for i in train[:70_000]) == text


def test_shakespeare_errors_are_one_line(tmp_path, monkeypatch):
    line = assert_user_error(run_script("data/shakespeare_char/prepare.py", "--input", str(tmp_path / "nope.txt")))
    assert "nope.txt" in line
    # no local copy and no network: the download fails with a hint
    monkeypatch.setattr(shakespeare, "TEXT", str(tmp_path / "input.txt"))
    monkeypatch.setattr(shakespeare, "URL", "http://127.0.0.1:9/input.txt")  # port 9: nothing listens
    with pytest.raises(UserError, match="--input"):
        shakespeare.read_text()
    assert not os.path.exists(tmp_path / "input.txt")
    # each of these a traceback before: a text not in UTF-8, an --out_dir that is a file
    (tmp_path / "latin.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin.txt: not UTF-8 text; convert it first \(iconv"):
        shakespeare_char.main(["--input", str(tmp_path / "latin.txt"), "--out_dir", str(tmp_path / "out")])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match=r"^the text is empty: nothing to prepare; give a text file with --input$"):
        shakespeare_char.main(["--input", str(tmp_path / "empty.txt"), "--out_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match=rf"^cannot make --out_dir {re.escape(str(tmp_path / 'afile'))} \(File exists\)"):
        shakespeare_char.main(["--input", TEXT_PATH, "--out_dir", str(tmp_path / "afile")])


def test_shakespeare_prepare_on_a_full_disk_leaves_no_partial_shard_and_a_rerun_completes(tmp_path, char_prepared):
    out = tmp_path / "out"
    result = run_script("data/shakespeare_char/prepare.py", "--out_dir", str(out), max_file_bytes=500_000)
    line = assert_user_error(result)  # the train shard (2 MB) does not fit
    assert f"{out / 'shakespeare_char_train_000000.bin'} (File too large)" in line and "no partial file" in line
    assert os.listdir(out) == []  # no partial shard, no temp file
    shakespeare_char.main(["--out_dir", str(out)])  # the rerun, with room on the disk
    assert same_files(out, char_prepared)  # as a run that never failed


# --- the web-scale prepare pipeline, on local files ---

def make_docs():
    lines = [l for l in open(TEXT_PATH, encoding="utf-8").read().splitlines() if l]
    docs = ["\n".join(lines[i:i + 3]) for i in range(0, 900, 3)]  # 300 documents, more than the pool holds at once
    return docs + ["", "naïve café ☕ — ünïcödé", "<|endoftext|> is plain text here"]


def write_corpus(path, docs):
    if str(path).endswith(".parquet"):
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))


@pytest.fixture
def fineweb():
    """data/fineweb/prepare.py; it reads corpora through datasets, which a GPU machine may not have."""
    pytest.importorskip("datasets", reason="data/fineweb/prepare.py reads corpora through datasets")
    from data.fineweb import prepare

    return prepare


def prepare_fineweb(fineweb, corpus, out_dir, shard_size=500):
    fineweb.main(["--data_files", str(corpus), "--out_dir", str(out_dir),
                  "--shard_size", str(shard_size), "--num_workers", "2"])


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_fineweb_pipeline_gives_tiktoken_tokens(tmp_path, ext, fineweb):
    docs = make_docs()
    write_corpus(tmp_path / f"corpus.{ext}", docs)
    prepare_fineweb(fineweb, tmp_path / f"corpus.{ext}", tmp_path / "out")
    enc = named_encoding("gpt2")
    expected = [t for d in docs for t in [GPT2_EOT] + enc.encode_ordinary(d)]
    val, train = split_tokens(tmp_path / "out", "val"), split_tokens(tmp_path / "out", "train")
    shards = val + train
    assert len(val) == 1 and len(shards) == -(-len(expected) // 500)
    assert all(len(s) == 500 for s in shards[:-1])
    assert np.concatenate(shards).tolist() == expected
    assert {"fineweb_val_000000.bin", "fineweb_train_000001.bin"} <= set(os.listdir(tmp_path / "out"))


def test_fineweb_reads_ahead_a_bounded_number_of_documents(fineweb):
    pulled = []

    def big_corpus():  # 1000 batches of 10 documents
        for _ in range(1000):
            pulled.append(1)
            yield ["a short document"] * 10

    with fineweb.ProcessPoolExecutor(2) as pool:
        docs = fineweb.tokenize_stream(big_corpus(), pool, in_flight=4)
        assert [len(next(docs)) for _ in range(100)] == [4] * 100  # end-of-text + 3 tokens
        docs.close()
    assert len(pulled) <= 100 // 10 + 4


def crash_on_call(function, n, before=None):
    """`function`, except that its n-th call runs `before` and then raises Crash, as if the process died there."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            before and before(*args)
            raise Crash
        return function(*args, **kwargs)
    return wrapped


def half_written(path, tokens):
    with open(f"{path}.tmp", "wb") as f:  # what a kill during a shard write leaves behind
        f.write(b"\0" * 1024 + tokens[:10].tobytes())


@pytest.mark.parametrize("where", ["writing a shard", "after a shard, before its progress"])
def test_fineweb_rerun_after_interruption_is_identical(tmp_path, monkeypatch, where, fineweb):
    write_corpus(tmp_path / "corpus.jsonl", make_docs())
    prepare_fineweb(fineweb, tmp_path / "corpus.jsonl", tmp_path / "whole")
    if where == "writing a shard":
        monkeypatch.setattr(fineweb, "write_shard", crash_on_call(fineweb.write_shard, 4, before=half_written))
    else:
        monkeypatch.setattr(fineweb, "save_progress", crash_on_call(fineweb.save_progress, 4))
    with pytest.raises(Crash):
        prepare_fineweb(fineweb, tmp_path / "corpus.jsonl", tmp_path / "resumed")
    monkeypatch.undo()
    progress = json.loads((tmp_path / "resumed" / "progress.json").read_text())
    assert progress["shards"] == 3 and progress["docs"] > 0 and not progress["done"]
    finished = {f"fineweb_{'val' if i == 0 else 'train'}_{i:06d}.bin": None for i in range(3)}
    for name in finished:
        finished[name] = os.stat(tmp_path / "resumed" / name).st_mtime_ns

    prepare_fineweb(fineweb, tmp_path / "corpus.jsonl", tmp_path / "resumed")
    assert sorted(os.listdir(tmp_path / "resumed")) == sorted(os.listdir(tmp_path / "whole"))  # no .tmp left
    for name in os.listdir(tmp_path / "whole"):
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    for name, mtime in finished.items():  # finished shards were skipped, not rewritten
        assert os.stat(tmp_path / "resumed" / name).st_mtime_ns == mtime


FULL_DISK_FROM_SHARD_3 = """
import resource, runpy, sys
sys.path.insert(0, sys.argv[1])
import gpt.prepare
real_write_shard, calls = gpt.prepare.write_shard, []

def write_shard(path, tokens):  # from the third shard on, the disk is full: no file may grow past 2000 bytes
    calls.append(path)
    if len(calls) == 3:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
    real_write_shard(path, tokens)

gpt.prepare.write_shard = write_shard  # prepare.py, run below, imports it from gpt.prepare
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_fineweb_on_a_full_disk_leaves_no_partial_shard_and_a_rerun_resumes(tmp_path, fineweb):
    write_corpus(tmp_path / "corpus.jsonl", make_docs())
    prepare_fineweb(fineweb, tmp_path / "corpus.jsonl", tmp_path / "whole")
    (tmp_path / "full_disk.py").write_text(FULL_DISK_FROM_SHARD_3)
    out = tmp_path / "resumed"
    result = run_script(str(tmp_path / "full_disk.py"), ROOT, "data/fineweb/prepare.py", "--data_files",
                        str(tmp_path / "corpus.jsonl"), "--out_dir", str(out), "--shard_size", "500", "--num_workers", "1")
    *progress_bar, line = result.stderr.strip().splitlines()  # tqdm's bar, then the error
    assert result.returncode == 1 and line.startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    assert f"{out / 'fineweb_train_000002.bin'} (File too large)" in line, line
    # two finished shards (500 tokens: 2024 bytes each), a progress.json that says so; nothing partial
    assert sorted(os.listdir(out)) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin", "meta.json", "progress.json"]
    assert json.loads((out / "progress.json").read_text())["shards"] == 2
    prepare_fineweb(fineweb, tmp_path / "corpus.jsonl", out)  # the disk has room again
    assert same_files(out, tmp_path / "whole")


def test_fineweb_errors_are_one_line(tmp_path, fineweb):
    line = assert_user_error(run_script("data/fineweb/prepare.py", "--out_dir", str(tmp_path)))  # hub, offline
    assert "--data_files" in line
    with pytest.raises(UserError, match="no such files"):
        fineweb.main(["--data_files", str(tmp_path / "*.parquet"), "--out_dir", str(tmp_path)])
    write_corpus(tmp_path / "c.jsonl", ["a", "b"])
    with pytest.raises(UserError, match="--text_field"):
        fineweb.main(["--data_files", str(tmp_path / "c.jsonl"), "--out_dir", str(tmp_path), "--text_field", "body"])


def test_fineweb_reads_json_and_jsonl_together_and_refuses_a_folder_it_cannot_continue(tmp_path, fineweb):
    """.json and .jsonl are one kind (datasets' json builder), which was refused as two. A folder holding shards but
    no progress.json (a rerun with another --shard_size after removing it) kept the other run's shards beside the new
    ones; a damaged progress.json was a traceback."""
    write_corpus(tmp_path / "a.jsonl", ["one document"] * 60)
    write_corpus(tmp_path / "b.json", ["another document"] * 60)
    fineweb.main(["--data_files", str(tmp_path / "a.jsonl"), str(tmp_path / "b.json"), "--out_dir",
                  str(tmp_path / "out"), "--shard_size", "100", "--num_workers", "1"])
    assert len(split_tokens(tmp_path / "out", "train")) == 3  # 120 documents of 3 tokens (their end-of-text one too)
    args = ["--data_files", str(tmp_path / "a.jsonl"), "--out_dir", str(tmp_path / "out"), "--num_workers", "1"]
    for progress in ("{torn", '{"shards": 3}', None):
        if progress is None:
            os.remove(tmp_path / "out" / "progress.json")
        else:
            (tmp_path / "out" / "progress.json").write_text(progress)
        before = {name: (tmp_path / "out" / name).read_bytes() for name in os.listdir(tmp_path / "out")}
        with pytest.raises(UserError, match="progress.json (is damaged|\\(another run's)"):
            fineweb.main(args)
        assert {name: (tmp_path / "out" / name).read_bytes() for name in os.listdir(tmp_path / "out")} == before


# --- the loader's errors ---

def assert_one_line(error, *words):
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert str(word) in message, message


@pytest.fixture
def dataset(tmp_path):
    """Two shards whose tokens are all distinct (0..999 and 1000..2299), so a window's first token names it."""
    write_shard(tmp_path / "toy_train_000000.bin", np.arange(0, 1000))
    write_shard(tmp_path / "toy_train_000001.bin", np.arange(1000, 2300))
    write_meta(tmp_path, {"tokenizer": "gpt2", "vocab_size": 2300, "eot_token": None})
    return tmp_path


@pytest.mark.parametrize("corrupt, words", [
    (lambda raw: struct.pack("<i", 1234) + raw[4:], ["magic", 1234]),
    (lambda raw: raw[:4] + struct.pack("<i", 7) + raw[8:], ["version", 7]),
    (lambda raw: raw[:-2], ["bytes", "truncated"]),
    (lambda raw: raw[:100], ["header"]),
])
def test_corrupt_shard_errors(dataset, corrupt, words):
    path = dataset / "toy_train_000001.bin"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(UserError) as error:
        ShardLoader(dataset, "train", batch_size=2, block_size=8)
    assert_one_line(error, path, *words)


def test_loader_errors(dataset, tmp_path):
    with pytest.raises(UserError) as error:
        ShardLoader(tmp_path / "nope", "train", batch_size=2, block_size=8)
    names = sorted(n for n in os.listdir(os.path.join(ROOT, "data"))
                   if os.path.isfile(os.path.join(ROOT, "data", n, "prepare.py")))
    assert_one_line(error, tmp_path / "nope", f"the datasets are {', '.join(names)} (data/<name>/prepare.py)")
    assert "shakespeare_char" in names and "data/nope/prepare.py" not in str(error.value)  # no such script
    with pytest.raises(UserError) as error:
        ShardLoader(dataset, "val", batch_size=2, block_size=8)
    assert_one_line(error, "*_val_*.bin", dataset)
    with pytest.raises(UserError) as error:  # 1300 tokens cannot hold a 1301-token window
        ShardLoader(dataset, "train", batch_size=2, block_size=1300)
    assert_one_line(error, dataset, "block_size")
    ShardLoader(dataset, "train", batch_size=2, block_size=1299)  # one window fits the longer shard
    meta = load_meta(dataset)
    with pytest.raises(UserError) as error:
        check_vocab(dataset, meta, 2299)
    assert_one_line(error, dataset / "meta.json", 2300, 2299)
    assert meta["vocab_size"] == 2300
    check_vocab(dataset, meta, 2300)  # fits: no error
    for text in ("{not json", "[1, 2]", '{"tokenizer": "char"}', '{"tokenizer": "char", "vocab_size": "65"}'):
        (dataset / "meta.json").write_text(text)  # the last three: a TypeError or KeyError where they were read
        with pytest.raises(UserError) as error:
            load_meta(dataset)
        assert_one_line(error, dataset / "meta.json", "not a dataset's meta.json")


def hinted_command(error):
    """The command in backquotes in a UserError's message, as argv."""
    return shlex.split(re.search(r"`([^`]+)`", str(error.value)).group(1))


def test_a_dataset_whose_prepare_script_was_not_run_names_that_script_and_it_works(tmp_path, monkeypatch):
    """From another directory than the repository's root, data/shakespeare_char there is made by the repository's
    script with --out_dir; the same message for a folder that exists without shards."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as error:
        ShardLoader("data/shakespeare_char", "train", batch_size=2, block_size=8)
    assert_one_line(error, "dataset folder data/shakespeare_char not found; prepare it with `python ")
    command = hinted_command(error)
    assert command[1] == os.path.join(ROOT, "data", "shakespeare_char", "prepare.py")
    os.makedirs("data/shakespeare_char")  # an empty folder: no shards yet
    with pytest.raises(UserError) as error:
        ShardLoader("data/shakespeare_char", "train", batch_size=2, block_size=8)
    assert_one_line(error, "no train shards")
    assert hinted_command(error) == command
    subprocess.run([sys.executable, *command[1:]], check=True, capture_output=True, timeout=120)
    ShardLoader("data/shakespeare_char", "train", batch_size=2, block_size=8)


def test_from_the_repository_root_the_prepare_command_is_the_short_one(monkeypatch):
    monkeypatch.chdir(ROOT)
    if glob.glob("data/fineweb/*_train_*.bin"):
        pytest.skip("data/fineweb is prepared in this checkout")
    with pytest.raises(UserError) as error:
        ShardLoader("data/fineweb", "train", batch_size=2, block_size=8)
    assert_one_line(error, "no train shards (*_train_*.bin) in data/fineweb; "
                           "prepare them with `python data/fineweb/prepare.py`")
    with pytest.raises(UserError) as error:
        ShardLoader("data/nope", "train", batch_size=2, block_size=8)
    commands = [shlex.split(c) for c in re.findall(r"`([^`]+)`", str(error.value))]
    assert commands or "pass --dataset=" in str(error.value)  # none when every dataset is prepared here
    assert all(len(c) == 2 and c[1].startswith("data/") and os.path.isfile(c[1]) for c in commands), commands


# --- the loader's sampling ---

def window_starts(loader, n_batches):
    starts = []
    for _ in range(n_batches):
        x, y = loader.next_batch()
        assert (y == x + 1).all()  # y is x shifted by one, both cut from one contiguous window
        starts += x[:, 0].tolist()
    return starts


def epoch_starts(loader, n_windows):
    """The first token of each of the next n_windows windows, drawn one per batch."""
    assert loader.batch_size == 1
    return window_starts(loader, n_windows)


def test_each_epoch_cuts_each_shard_on_a_shifted_grid(dataset):
    # windows of 10 tokens: the 1000- and 1300-token shards hold 100 and 130, of which 99 and 129 are used
    # per epoch, leaving room to shift the grid.
    loader = ShardLoader(dataset, "train", batch_size=1, block_size=9)
    epochs = []
    for epoch in range(3):
        starts = epoch_starts(loader, 99 + 129)
        assert starts != sorted(starts)  # shuffled
        shards = [sorted(s for s in starts if s < 1000), sorted(s for s in starts if s >= 1000)]
        assert [len(s) for s in shards] == [99, 129]
        for shard in shards:  # one grid per shard: consecutive, non-overlapping windows
            assert all(b - a == 10 for a, b in zip(shard, shard[1:]))
        epochs.append(set(starts))
    epoch_starts(loader, 1)
    assert loader.state_dict()["epoch"] == 3  # three whole epochs were drawn
    assert epochs[0] != epochs[1] != epochs[2]  # the grid moves between epochs


def test_ranks_get_disjoint_windows(dataset):
    # each rank takes 99 // 2 + 129 // 2 = 113 windows per epoch
    ranks = [set(epoch_starts(ShardLoader(dataset, "train", 1, 9, seed=3, rank=r, world_size=2), 113)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 113
    assert all(abs(a - b) >= 10 for a in ranks[0] for b in ranks[1])  # no two windows overlap


def test_same_seed_and_position_give_same_batches(dataset):
    def batches(loader, n):
        return [torch.cat(loader.next_batch()) for _ in range(n)]

    first = ShardLoader(dataset, "train", batch_size=4, block_size=15, seed=7)
    before = batches(first, 30)
    state = json.loads(json.dumps(first.state_dict()))  # it goes into a checkpoint
    after = batches(first, 40)  # crosses shard and epoch boundaries

    resumed = ShardLoader(dataset, "train", batch_size=4, block_size=15, seed=7)
    resumed.load_state_dict(state)
    assert all((a == b).all() for a, b in zip(after, batches(resumed, 40)))
    again = ShardLoader(dataset, "train", batch_size=4, block_size=15, seed=7)
    assert all((a == b).all() for a, b in zip(before, batches(again, 30)))
    other_seed = ShardLoader(dataset, "train", batch_size=4, block_size=15, seed=8)
    assert not all((a == b).all() for a, b in zip(before, batches(other_seed, 30)))
