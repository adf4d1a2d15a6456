"""
Text to token ids and back: one Tokenizer for every vocabulary this repo meets, described by a meta dict (what
data/<dataset>/meta.json and checkpoints hold), each with vocab_size and eot_token (end of text, None for characters):

- {"tokenizer": "char", "chars": [...]}: one token per character (Tiny Shakespeare by character);
- {"tokenizer": "gpt2"}: GPT-2's byte-level BPE, through tiktoken, from the files in gpt/tokenizer_files/gpt2/;
- {"tokenizer": "bpe", "path": ".../tokenizer.json"}: another byte-level BPE from a Hugging Face folder (Llama 3,
  Qwen), read through tiktoken where tiktoken reproduces it exactly, refused otherwise.
The BPE vocabularies are read by gpt/bpe.py, imported only for them.
"""

import codecs
import unicodedata

from gpt import UserError

def char_meta(text):
    """The meta of a character vocabulary: the distinct characters of text, sorted; token i is chars[i]."""
    chars = sorted(set(text))
    return {"tokenizer": "char", "vocab_size": len(chars), "eot_token": None, "chars": chars}


class Tokenizer:
    """encode, decode, and decoder() for streaming, for the vocabulary a meta dict describes."""

    def __init__(self, meta):
        self.meta, self.vocab_size, self.eot = meta, meta["vocab_size"], meta.get("eot_token")
        if meta["tokenizer"] == "char":
            self.chars = meta["chars"]
            self.index = {c: i for i, c in enumerate(self.chars)}
        else:  # byte-level BPE through tiktoken: gpt/bpe.py, imported only for such a vocabulary
            from gpt.bpe import meta_encoding
            self.enc = meta_encoding(meta)

    def encode(self, text, special_tokens=False):
        """Token ids of text. With special_tokens, "<|endoftext|>" written in the text is that token (a prompt);
        without, it is ordinary text (a training corpus)."""
        if self.meta.get("nfc"):  # the tokenizer.json normalizes to NFC first (Qwen)
            text = unicodedata.normalize("NFC", text)
        if self.meta["tokenizer"] != "char":
            return self.enc.encode(text, allowed_special="all") if special_tokens else self.enc.encode_ordinary(text)
        unknown = sorted(set(text) - self.index.keys())
        if unknown:
            raise UserError(f"characters the model's tokenizer does not know: {''.join(unknown)!r}; "
                                 "use only characters of its training text")
        return [self.index[c] for c in text]

    def decode(self, ids):
        if self.meta["tokenizer"] == "char":
            return "".join(self.chars[i] for i in ids)
        return self.enc.decode(ids)

    def byte_lengths(self):
        """The UTF-8 length of each token id's text (special tokens: 0), for bits per byte, which compares models
        whatever their tokenizer."""
        if self.meta["tokenizer"] == "char":
            return [len(c.encode()) for c in self.chars]
        special = set(self.enc._special_tokens.values())
        lengths = []
        for token in range(self.vocab_size):
            try:
                lengths.append(0 if token in special else len(self.enc.decode_single_token_bytes(token)))
            except KeyError:  # an id with no token
                lengths.append(0)
        return lengths

    def decoder(self):
        """A function from one token to its text, for streaming: a character split across BPE tokens (bytes) is held
        back until it is whole."""
        if self.meta["tokenizer"] == "char":
            return self.chars.__getitem__
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda token: utf8.decode(self.enc.decode_single_token_bytes(token))
