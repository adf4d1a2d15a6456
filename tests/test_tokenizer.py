"""Tests for tokenizer.py: streaming BPE decoding never prints half a character. (Offline use: test_offline.py.)"""

from gpt.bpe import named_encoding
from gpt.tokenizer import Tokenizer
from test_sample import TEXT


def test_bpe_streaming_decode_never_prints_a_broken_character():
    enc = named_encoding("gpt2")
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
