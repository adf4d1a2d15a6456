"""Offline by default: GPT-2's BPE files ship in gpt/tokenizer_files/gpt2/, are the very files tiktoken downloads for
its "gpt2" encoding, and give the same tokens with no network and no tiktoken cache, without trying the network
(a download that cannot get through may hang: requests sets no timeout)."""

import functools
import hashlib
import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import tiktoken
import tiktoken.load
from tiktoken_ext import openai_public

from conftest import finished
from gpt.bpe import GPT2_META, named_encoding
from gpt.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2_FILES = os.path.join(ROOT, "gpt", "tokenizer_files", "gpt2")
# tiktoken caches of the official files to compare with, where this machine has one (never downloaded here)
OFFICIAL_CACHES = [os.environ.get("TIKTOKEN_CACHE_DIR"), os.path.join(ROOT, "..", "shared", "tiktoken_cache")]
SAMPLE = ("Hello world! It's 2024: we'll see, they're here, I'd've... 3.14159 x 1e-9 <|endoftext|>\n\n"
          "  indented\tand\ttabbed   \r\n caf\u00e9 na\u00efve \u2014 \U0001F44B\U0001F3FD \u65e5\u672c\u8a9e "
          "\u0645\u0631\u062d\u0628\u0627 \u00ff\u0100 trailing spaces   ")
# Runs a script and its arguments, or -c CODE and its arguments, reporting on stderr every attempt to reach a host
# (resolving a name, connecting an internet socket) without interfering with it.
GUARD = """
import runpy, sys
def report(event, args):
    internet = event == "socket.connect" and isinstance(args[1], tuple)  # not a Unix socket
    if event in ("socket.getaddrinfo", "socket.gethostbyname") or internet:
        sys.stderr.write(f"network use: {event} {args[1] if event == 'socket.connect' else args[0]!r}\\n")
sys.addaudithook(report)
if sys.argv[1] == "-c":
    code, sys.argv = sys.argv[2], ["-c", *sys.argv[3:]]
    exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def official_gpt2_files():
    """{file name: (url, sha256)} of the files tiktoken's own "gpt2" constructor loads, as it asks for them."""
    calls = []
    with mock.patch.object(openai_public, "data_gym_to_mergeable_bpe_ranks", lambda **kw: calls.append(kw) or {}):
        openai_public.ENCODING_CONSTRUCTORS["gpt2"]()
    (kw,) = calls
    return {os.path.basename(kw[f"{key}_file"]): (kw[f"{key}_file"], kw[f"{key}_hash"])
            for key in ("vocab_bpe", "encoder_json")}


@functools.cache
def official_gpt2():
    """tiktoken's "gpt2" Encoding built by tiktoken's own code from the official files in a tiktoken cache
    ($TIKTOKEN_CACHE_DIR's or ../shared/tiktoken_cache, which tiktoken checks against its sha256), or None when
    neither holds them: never downloaded here."""
    def no_download(url):
        raise FileNotFoundError(url)

    for folder in filter(None, OFFICIAL_CACHES):
        with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": folder}), \
                mock.patch.object(tiktoken.load, "read_file", no_download):
            try:
                return tiktoken.Encoding(**openai_public.ENCODING_CONSTRUCTORS["gpt2"]())
            except FileNotFoundError:
                continue
    return None


@functools.cache
def unshare_prefix():
    """A command prefix that runs a command in a new network namespace, where no host is reachable (unshare -n
    as root, -rn as a user where the kernel allows it), or [] where neither works."""
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return []


def start_offline(tmp_path, *args, code=None):
    """Start python (a script and its arguments, or code) with the network unreachable (a network namespace of its
    own where unshare works, and in any case every proxy at a closed port), an empty tiktoken cache, and no
    cache of Hugging Face's: what a fresh clone on a machine with no internet has. Returns its Popen."""
    cache = tmp_path / "empty-tiktoken-cache"
    cache.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k.upper() not in ("DATA_GYM_CACHE_DIR", "NO_PROXY")}
    closed = "http://127.0.0.1:9"  # port 9 (discard): nothing listens
    env.update(TIKTOKEN_CACHE_DIR=str(cache), TMPDIR=str(tmp_path), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               **{k: closed for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                                      "all_proxy")})
    if code is not None:
        args = ("-c", code, *args)
    return subprocess.Popen([*unshare_prefix(), sys.executable, "-c", GUARD, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_offline(tmp_path, *args, code=None):
    """start_offline's run, waited for: its CompletedProcess."""
    return finished(start_offline(tmp_path, *args, code=code))


def test_shipped_files_are_the_ones_tiktoken_downloads():
    files = official_gpt2_files()
    assert sorted(files) == ["encoder.json", "vocab.bpe"]
    for name, (url, sha256) in files.items():
        with open(os.path.join(GPT2_FILES, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sha256, f"{name} is not the file tiktoken downloads ({url})"
    with open(os.path.join(GPT2_FILES, "LICENSE"), encoding="utf-8") as f:
        assert "MIT License" in f.read()  # the files' licence travels with them


def test_gpt2_tokenizer_offline_encodes_as_tiktoken_without_trying_the_network(tmp_path):
    code = """if True:
        import json, sys, time
        start = time.perf_counter()
        from gpt.bpe import GPT2_META
        from gpt.tokenizer import Tokenizer
        tokenizer = Tokenizer(GPT2_META)
        ids = tokenizer.encode(sys.argv[1], special_tokens=True), tokenizer.encode(sys.argv[1])
        print(json.dumps(dict(ids=ids, text=tokenizer.decode(ids[0]), seconds=time.perf_counter() - start)))"""
    result = run_offline(tmp_path, SAMPLE, code=code)
    assert result.returncode == 0 and "network use" not in result.stderr, result.stderr
    out = json.loads(result.stdout)
    assert out["text"] == SAMPLE and out["seconds"] < 10, out["seconds"]  # about 0.2 s: import, files, encode
    (with_special, ordinary) = out["ids"]
    assert GPT2_META["eot_token"] in with_special and GPT2_META["eot_token"] not in ordinary

    official = official_gpt2()
    if official is None:
        pytest.skip("no tiktoken cache with the official gpt2 files here to compare with")
    assert with_special == official.encode(SAMPLE, allowed_special="all")
    assert ordinary == official.encode_ordinary(SAMPLE)
    shipped = named_encoding("gpt2")  # the same in this process, and the whole vocabulary this time
    assert (shipped.name, shipped._pat_str, shipped._special_tokens, shipped.n_vocab) == \
        (official.name, official._pat_str, official._special_tokens, official.n_vocab)
    assert shipped._mergeable_ranks == official._mergeable_ranks


def test_bpe_prepare_and_sample_work_offline(tmp_path):
    """The two commands run side by side (each start costs seconds): sample.py's checkpoint is made here, not from
    the prepared data."""
    import torch

    from model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=50304, block_size=16, n_layer=1, n_head=1, n_kv_head=1, n_embd=8))
    torch.save(dict(model=model.state_dict(), model_config=vars(model.config), meta=GPT2_META), tmp_path / "ckpt.pt")
    prepare = start_offline(tmp_path, "data/shakespeare/prepare.py", "--out_dir", str(tmp_path / "data"))
    sample = start_offline(tmp_path, "sample.py", f"--out_dir={tmp_path}", "--prompt=Hello, world",
                           "--max_new_tokens=5", "--device=cpu")
    result, sampled = finished(prepare), finished(sample)
    assert result.returncode == 0 and "network use" not in result.stderr, result.stderr
    assert json.loads((tmp_path / "data" / "meta.json").read_text()) == GPT2_META
    from gpt.shards import read_shard

    tokens = [read_shard(tmp_path / "data" / f"shakespeare_{split}_000000.bin").tolist() for split in ("train", "val")]
    with open(os.path.join(ROOT, "data", "shakespeare", "input.txt"), encoding="utf-8") as f:
        text = f.read()
    official = official_gpt2()
    reference = official or Tokenizer(GPT2_META).enc  # where no official copy is at hand, the shipped files
    n_train = len(text) * 9 // 10
    assert tokens == [reference.encode_ordinary(text[:n_train]), reference.encode_ordinary(text[n_train:])]
    assert sampled.returncode == 0 and "network use" not in sampled.stderr, sampled.stderr
    assert sampled.stdout.startswith("Hello, world")
