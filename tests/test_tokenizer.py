"""Tests for tokenizer.py: streaming BPE decoding never prints half a character; no tiktoken files and no network
is a one-line error."""

import os
import subprocess
import sys

import pytest
import tiktoken

from test_sample import TEXT
from tokenizer import Tokenizer


def test_bpe_streaming_decode_never_prints_a_broken_character():
    enc = tiktoken.get_encoding("gpt2")
    tokens = enc.encode(TEXT)

    def whole(token):
        try:
            enc.decode_single_token_bytes(token).decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    assert not all(whole(t) for t in tokens)  # some character is split across tokens: the case under test
    decode = Tokenizer({"tokenizer": "gpt2", "vocab_size": 50257, "eot_token": 50256}).decoder()
    pieces = [decode(t) for t in tokens]
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", [["data/shakespeare/prepare.py", "--out_dir"], ["sample.py", "--out_dir"]])
def test_no_cached_bpe_files_and_no_network_is_a_one_line_error(tmp_path, script):
    # an empty tiktoken cache, and every download through a proxy where nothing listens (port 9): offline
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "cache"), HTTPS_PROXY="http://127.0.0.1:9",
               https_proxy="http://127.0.0.1:9")
    if script[0] == "sample.py":  # a checkpoint of a GPT-2-BPE model, so sample.py needs tiktoken's files
        from checkpoint import save_checkpoint
        from model import GPT, GPTConfig
        from tokenizer import GPT2_META

        model = GPT(GPTConfig(vocab_size=50304, block_size=8, n_layer=1, n_head=1, n_kv_head=1, n_embd=8))
        save_checkpoint(str(tmp_path / "ckpt.pt"), dict(model=model.state_dict(), model_config=vars(model.config),
                                                        meta=GPT2_META))
    result = subprocess.run([sys.executable, *script, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot load tiktoken's 'gpt2' encoding") and "TIKTOKEN_CACHE_DIR" in line
