"""
A decoder-only transformer (GPT) in one file, small enough to read in one sitting.

What is in it, and the GPTConfig switch for each choice:
- Token embedding, no learned positions: rotary position embeddings (RoPE) on q and k, with the
  "rotate-half" pairing (dim i with dim i + head_dim/2) that Hugging Face Llama and Qwen use (rope_base).
- Pre-norm residual blocks, x + attn(norm(x)) then x + mlp(norm(x)), with RMSNorm (norm_eps).
- Grouped-query attention (GQA): n_head query heads share n_kv_head key/value heads; query head h reads
  kv head h // (n_head // n_kv_head). n_kv_head == n_head is multi-head attention, n_kv_head == 1 is
  multi-query attention. Optional RMSNorm of q and k per head (qk_norm), as in Qwen3.
- MLP: "swiglu" (Llama), "gelu" (GPT-2) or "relu2" (squared ReLU, modded-nanogpt); width mlp_hidden.
- Optional biases (bias), dropout (dropout), output head tied to the embedding (tie_embeddings).
- A preallocated KV cache for incremental decoding that handles the three attention cases: a full
  causal sequence (training), one new token (decoding), and a chunk of new tokens after a cached prefix
  (chunked prefill, speculative verification). It can be truncated to reject speculated tokens.
  With input_pos (positions as a tensor), the static-shape variant of gpt-fast: k and v are written at
  those positions and attention reads the whole cache under a mask, so a compiled decode step compiles once.

bias=False, mlp="swiglu", qk_norm=False is exactly a Llama; the same with qk_norm=True (the default) is
exactly a Qwen3 (norm_eps: Llama uses 1e-5, Qwen3 1e-6). Module names follow the Hugging Face Llama
checkpoint layout (embed_tokens, layers.N.self_attn.q_proj, mlp.gate_proj, ...), so weights map 1:1.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

MLP_KINDS = ("swiglu", "gelu", "relu2")


@dataclass
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    block_size: int = 1024  # the longest sequence the model sees (RoPE tables and KV cache size)
    n_layer: int = 12
    n_head: int = 12  # query heads
    n_kv_head: int = 4  # key/value heads, shared by n_head // n_kv_head query heads each
    n_embd: int = 768
    head_dim: int = 0  # width of each attention head; 0 means n_embd // n_head (Qwen3 sets it apart)
    dropout: float = 0.0
    bias: bool = False  # biases in the linear layers (GPT-2 has them, Llama and Qwen3 do not)
    mlp: str = "swiglu"  # one of MLP_KINDS
    mlp_hidden: int = 0  # MLP width; 0 picks 4 * n_embd, or about 8/3 * n_embd for swiglu (same params)
    qk_norm: bool = True  # RMSNorm on q and k per head before RoPE (Qwen3); steadies training
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # the output head reuses the token embedding matrix

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) or self.head_dim < 0:
            raise ValueError(f"GPTConfig.head_dim must be a non-negative integer (0 = n_embd // n_head), got {self.head_dim!r}")
        if self.head_dim == 0:
            if self.n_embd % self.n_head != 0:
                raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}), or set head_dim")
            self.head_dim = self.n_embd // self.n_head
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"GPTConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"GPTConfig.head_dim ({self.head_dim}) must be even for RoPE")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"GPTConfig.mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
        if not isinstance(self.mlp_hidden, int) or self.mlp_hidden < 0:
            raise ValueError(f"GPTConfig.mlp_hidden must be a non-negative integer (0 = default), got {self.mlp_hidden!r}")
        if self.rope_base <= 0 or self.norm_eps <= 0:
            raise ValueError(f"GPTConfig.rope_base and norm_eps must be positive, got {self.rope_base!r} and {self.norm_eps!r}")

    @property
    def mlp_width(self):
        if self.mlp_hidden:
            return self.mlp_hidden
        if self.mlp == "swiglu":  # three matrices instead of two: 2/3 of 4x keeps the parameter count
            return 64 * math.ceil(8 * self.n_embd / 3 / 64)
        return 4 * self.n_embd


# ----------------------------------------------------------------------------------------------------
# A linear layer for decoding on CPU


class Linear(nn.Linear):
    """nn.Linear (the same parameters and names), which on CPU computes an input of 4 to 16 rows, the batch of
    a decode step, as (W @ x^T)^T: for such thin inputs MKL's fp32 kernel for x @ W^T runs well below memory
    bandwidth (24.7 vs 13.6 ms for the 50304 x 768 output head at 8 rows; bench/RESULTS.md). One row, and
    2 to 3 rows, where the transposed product is slower, and everything on GPUs, take the usual path."""

    def forward(self, x):
        rows = x.numel() // x.size(-1)
        if x.device.type != "cpu" or not 4 <= rows <= 16:
            return super().forward(x)
        y = (self.weight @ x.reshape(rows, -1).T).T  # (rows, out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


# ----------------------------------------------------------------------------------------------------
# Rotary position embeddings


def rope_tables(head_dim, max_len, base):
    """cos and sin of position * frequency, each (max_len, head_dim) in fp32: the angle of pair i
    (dims i and i + head_dim/2) is written at both of its columns, so apply_rope needs no slicing."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (max_len, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (max_len, hd)
    return angles.cos(), angles.sin()


def apply_rope(x, rope_cos, rope_sin):
    """Rotate each pair (x[i], x[i + hd/2]) of x (B, T, nh, hd) by its position's angle:
    (x[i] cos - x[i + hd/2] sin, x[i + hd/2] cos + x[i] sin), written as x cos + rotate_half(x) sin.

    rope_cos and rope_sin are (T, hd): the rows for the positions of x's T tokens.
    """
    x_float = x.float()  # rotate in fp32 under bf16 autocast too
    x1, x2 = x_float.chunk(2, dim=-1)  # (B, T, nh, hd/2) each
    rotated_half = torch.cat((-x2, x1), dim=-1)  # (B, T, nh, hd): each dim's partner, signed
    rotated = x_float * rope_cos[:, None, :] + rotated_half * rope_sin[:, None, :]  # (T, 1, hd) broadcast over heads
    return rotated.to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# Attention and the KV cache


def causal_attention(q, k, v, n_cached, dropout_p=0.0, input_pos=None):
    """softmax(q k^T / sqrt(hd) + causal mask) v, with grouped-query heads.

    q is (B, nh, T, hd) for T new tokens at positions n_cached .. n_cached + T - 1; k and v are
    (B, n_kv, n_cached + T, hd), every key from position 0. Query i may see keys 0 .. n_cached + i.
    With input_pos, the positions (T,) of the queries as a tensor, k and v are instead the whole cache
    (B, n_kv, max_len, hd) and n_cached is unused: the static shapes that torch.compile needs.
    """
    B, n_head, T, head_dim = q.shape
    n_kv_head, S = k.size(1), k.size(2)
    mask = None  # True where a query may see a key; None: every query sees every key
    if input_pos is not None:  # the query at position p sees keys 0 .. p; the unfilled rest is masked out
        mask = input_pos[:, None] >= torch.arange(S, device=q.device)  # (T, max_len)
    elif n_cached == 0:  # training or a fresh prefill: the square causal mask
        # enable_gqa lets SDPA pair query head h with kv head h // (nh // n_kv) without copying K and V.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                              enable_gqa=n_head != n_kv_head)
    elif T > 1:  # a chunk after a cached prefix: is_causal would align the mask top-left (query i sees
        # keys 0..i), so spell the bottom-right alignment out: row i allows columns 0 .. n_cached + i.
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=n_cached)
    if T == 1:  # decoding one token: the query heads of a group see the same keys under the same mask, so
        # they can be the rows of one query block per kv head: no GQA pairing, each kv head read once.
        group_queries = q.reshape(B, n_kv_head, n_head // n_kv_head, head_dim)  # (B, n_kv, nh/n_kv, hd)
        y = F.scaled_dot_product_attention(group_queries, k, v, attn_mask=mask, dropout_p=dropout_p)
        return y.view(B, n_head, 1, head_dim)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=n_head != n_kv_head)


class KVCache:
    """Keys and values of every layer for up to max_len positions, preallocated once.

    Only the n_kv_head key/value heads are stored, so with GQA the cache is n_head / n_kv_head times
    smaller than a multi-head cache of the same model (and decoding reads that much less memory).
    """

    def __init__(self, n_layer, batch_size, n_kv_head, max_len, head_dim, device=None, dtype=None):
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # how many positions are filled; the next token goes here

    @property
    def max_len(self):
        return self.k.size(3)

    def append(self, layer, k, v):
        """Write this layer's k, v (B, n_kv, T, hd) at pos; return all keys and values up to pos + T."""
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def write(self, layer, k, v, input_pos):
        """append's static-shape twin (gpt-fast's): write k, v (B, n_kv, T, hd) at the positions input_pos (T,),
        a tensor, and return the whole buffers (B, n_kv, max_len, hd). Neither reads nor moves pos."""
        # One index_put_ on the whole buffer rather than on the view self.k[layer]: compiled, a write into a view
        # of an input becomes a copy of the whole input (every layer's cache, every step), this one stays in place.
        index = (torch.tensor([layer], device=input_pos.device), slice(None), slice(None), input_pos)
        self.k[index] = k.permute(2, 0, 1, 3)  # the indexed dims come first: (T, B, n_kv, hd)
        self.v[index] = v.permute(2, 0, 1, 3)
        return self.k[layer], self.v[layer]

    def select_rows(self, rows):
        """Keep the batch rows `rows` (indices, in order; a repeated index copies its row): share one
        prompt's prefill among several samples, or drop the samples that have finished."""
        rows = torch.as_tensor(rows, device=self.k.device)
        self.k, self.v = self.k[:, rows], self.v[:, rows]

    def truncate(self, length):
        """Forget every position from `length` on (e.g. speculated tokens that were rejected)."""
        if not 0 <= length <= self.pos:
            raise ValueError(f"KVCache.truncate: length must be in [0, {self.pos}] (the filled length), got {length}")
        self.pos = length


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx  # which slice of the KV cache is ours
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.dropout = config.dropout
        self.q_proj = Linear(config.n_embd, config.n_head * self.head_dim, bias=config.bias)
        self.k_proj = Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=config.bias)
        self.v_proj = Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=config.bias)
        self.o_proj = Linear(config.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.qk_norm:  # one weight per head dim, shared by all heads (Qwen3)
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x, rope_cos, rope_sin, kv_cache=None, input_pos=None):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim))  # (B, T, nh, hd)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim))  # (B, T, n_kv, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        q, k = apply_rope(q, rope_cos, rope_sin), apply_rope(k, rope_cos, rope_sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # heads first: (B, h, T, hd)
        n_cached = 0
        if input_pos is not None:
            k, v = kv_cache.write(self.layer_idx, k, v, input_pos)  # (B, n_kv, max_len, hd)
        elif kv_cache is not None:
            n_cached = kv_cache.pos
            k, v = kv_cache.append(self.layer_idx, k, v)  # (B, n_kv, n_cached + T, hd)
        dropout_p = self.dropout if self.training else 0.0
        y = causal_attention(q, k, v, n_cached, dropout_p, input_pos)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return self.resid_dropout(self.o_proj(y))


# ----------------------------------------------------------------------------------------------------
# The rest of the block and the model


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.kind = config.mlp
        width = config.mlp_width
        if self.kind == "swiglu":  # silu(gate) * up: a learned gate on each hidden unit
            self.gate_proj = Linear(config.n_embd, width, bias=config.bias)
        self.up_proj = Linear(config.n_embd, width, bias=config.bias)
        self.down_proj = Linear(width, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        if self.kind == "swiglu":
            hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        elif self.kind == "gelu":
            hidden = F.gelu(self.up_proj(x), approximate="tanh")
        else:  # relu2
            hidden = F.relu(self.up_proj(x)).square()
        return self.dropout(self.down_proj(hidden))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = CausalSelfAttention(config, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope_cos, rope_sin, kv_cache=None, input_pos=None):
        x = x + self.self_attn(self.input_layernorm(x), rope_cos, rope_sin, kv_cache, input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Computed once for every position; not saved in checkpoints (they follow from the config).
        rope_cos, rope_sin = rope_tables(config.head_dim, config.block_size, config.rope_base)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2's init: N(0, 0.02) weights, zero biases, and the projections that write into the
        residual stream scaled by 1/sqrt(2 * n_layer) so its variance does not grow with depth.
        The logits of a fresh model are then near zero and its loss near ln(vocab_size)."""
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(param, std=0.02)

    def hidden_states(self, idx, kv_cache=None, input_pos=None):
        """The final normed hidden states (B, T, n_embd) of the tokens idx (B, T).

        With a kv_cache, idx continues the cached sequence: its positions start at kv_cache.pos, it
        attends to the cached prefix, and it is appended to the cache.
        With a kv_cache and input_pos, the positions (T,) of idx as a tensor, the static-shape path for
        torch.compile (gpt-fast's): k and v are written at input_pos and every query attends over the
        whole cache, masked. No shape or Python number changes from step to step, so a compiled decode
        step compiles once. kv_cache.pos is neither read nor advanced: the caller keeps count.
        """
        B, T = idx.shape
        if kv_cache is not None:
            if input_pos is None and kv_cache.pos + T > kv_cache.max_len:
                raise ValueError(f"KV cache overflow: {kv_cache.pos} cached + {T} new tokens > max_len {kv_cache.max_len}; "
                                 f"make the cache larger with new_kv_cache(batch_size, max_len)")
            if kv_cache.k.size(1) != B:
                raise ValueError(f"KV cache was made for batch size {kv_cache.k.size(1)}, got a batch of {B}")
        elif input_pos is not None:
            raise ValueError("input_pos needs a kv_cache to write the keys and values to")
        elif T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        if input_pos is None:  # the positions follow the cached ones
            start = kv_cache.pos if kv_cache is not None else 0
            rope_cos, rope_sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]  # (T, hd)
        else:
            rope_cos, rope_sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # (T, hd)
        x = self.dropout(self.embed_tokens(idx))  # (B, T, C)
        for block in self.layers:
            x = block(x, rope_cos, rope_sin, kv_cache, input_pos)
        if kv_cache is not None and input_pos is None:
            kv_cache.pos += T  # every layer has appended its keys and values
        return self.norm(x)

    def forward(self, idx, targets=None, kv_cache=None, input_pos=None):
        """Logits (B, T, vocab_size) for the tokens idx (B, T), and the mean cross-entropy against
        targets (B, T) when given (target -1 is ignored), else None. input_pos: see hidden_states."""
        logits = self.lm_head(self.hidden_states(idx, kv_cache, input_pos))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss

    def new_kv_cache(self, batch_size, max_len, dtype=None, device=None):
        """An empty KV cache for batch_size sequences of up to max_len tokens. Under bf16 autocast,
        pass dtype=torch.bfloat16 (the dtype k and v are computed in)."""
        if not 1 <= max_len <= self.config.block_size:
            raise ValueError(f"KV cache max_len must be in [1, block_size={self.config.block_size}], got {max_len}")
        if batch_size < 1:
            raise ValueError(f"KV cache batch_size must be at least 1, got {batch_size}")
        param = self.lm_head.weight
        return KVCache(self.config.n_layer, batch_size, self.config.n_kv_head, max_len, self.config.head_dim,
                       device=device or param.device, dtype=dtype or param.dtype)

    @torch.inference_mode()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None):
        """Extend idx (B, T) by max_new_tokens sampled tokens; temperature 0 is greedy.

        The prompt goes through the model once (prefill), then each step feeds only the newest token
        against the KV cache, and only the last position goes through the output head.
        Call model.eval() first if the model has dropout.
        """
        B, T = idx.shape
        if max_new_tokens < 1 or T < 1:
            raise ValueError(f"generate needs a non-empty prompt and max_new_tokens >= 1, got {T} and {max_new_tokens}")
        if T + max_new_tokens > self.config.block_size:
            raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds block_size {self.config.block_size}")
        kv_cache = self.new_kv_cache(B, T + max_new_tokens - 1)  # the last token sampled is never fed back
        tokens = [idx]
        next_input = idx
        for _ in range(max_new_tokens):
            logits = self.lm_head(self.hidden_states(next_input, kv_cache)[:, -1])  # (B, vocab_size)
            next_input = sample_next_token(logits, temperature, top_k, top_p, generator)  # (B, 1)
            tokens.append(next_input)
        return torch.cat(tokens, dim=1)

    # ------------------------------------------------------------------------------------------------
    # Size and speed accounting

    def num_params(self):
        """Number of parameters, the tied embedding and output head counted once."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len=None):
        """Training FLOPs (forward + backward) per token, as in the PaLM paper (appendix B): 6 per weight
        of every matmul, plus 12 * n_layer * n_head * head_dim * seq_len for the attention scores and
        their use (counted as if unmasked, as is the convention)."""
        seq_len = seq_len or self.config.block_size
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        cfg = self.config
        return 6 * matmul_weights + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len

    def estimate_mfu(self, tokens_per_second, peak_flops, seq_len=None):
        """Model FLOPs utilization: achieved training FLOP/s over the hardware's peak_flops
        (e.g. 989e12 for an H100's dense bf16)."""
        return self.flops_per_token(seq_len) * tokens_per_second / peak_flops


def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """Next-token probabilities (B, V) from logits (B, V): divided by temperature, then restricted to
    the top_k most likely tokens and to the smallest set whose probability reaches top_p. temperature>0."""
    if temperature <= 0:
        raise ValueError(f"sampling_probs needs temperature > 0, got {temperature}")
    logits = logits.float() / temperature
    if top_k is not None:
        kth_largest = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens more likely than it already reach top_p (the first always stays).
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token id per row of logits (B, V), as (B, 1); temperature 0 takes the most likely."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator)
