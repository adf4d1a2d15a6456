"""
A decoder-only transformer (GPT) and its KV cache, in one file small enough to read in one sitting.

The architecture, and the GPTConfig switch for each choice:
- Token embedding; positions enter only through rotary embeddings (RoPE) on q and k (rope_base).
- Pre-norm residual blocks, x + attn(norm(x)) then x + mlp(norm(x)); every norm an RMSNorm (norm_eps).
- Grouped-query attention: n_head query heads share n_kv_head key/value heads (n_kv_head == n_head is
  multi-head, 1 multi-query); optional RMSNorm of q and k per head (qk_norm, Qwen3); optional sliding window.
- MLP: "swiglu" (Llama), "gelu" (GPT-2) or "relu2" (squared ReLU); biases, dropout, tied head optional.
Which keys a query may see is one rule, can_attend, used by every attention path: a whole sequence
(training), one new token against the KV cache (decoding), a chunk after a cached prefix (chunked prefill,
speculative verification); it is told the layer and the tokens (per-layer windows, document masking). bias=False,
mlp="swiglu", window=0 is exactly a Llama (qk_norm=False) or a Qwen3 (qk_norm=True), with Hugging Face's module
names (embed_tokens, layers.N.self_attn.q_proj, ...).
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
    block_size: int = 1024  # the longest sequence the model reads (and the largest KV cache)
    n_layer: int = 12
    n_head: int = 12  # query heads
    n_kv_head: int = 4  # key/value heads, each shared by n_head // n_kv_head query heads
    n_embd: int = 768
    head_dim: int = 0  # width of each attention head; 0 means n_embd // n_head (Qwen3 sets it apart)
    dropout: float = 0.0
    bias: bool = False  # biases in the linear layers (GPT-2 has them, Llama and Qwen3 do not)
    mlp: str = "swiglu"  # one of MLP_KINDS
    mlp_hidden: int = 0  # MLP width; 0 picks 4 * n_embd, or about 8/3 * n_embd for swiglu (same parameters)
    qk_norm: bool = True  # RMSNorm on q and k per head before RoPE (Qwen3); steadies training
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # the output head reuses the token embedding matrix
    window: int = 0  # sliding-window attention: a query sees the last `window` positions, itself included; 0: all

    def __post_init__(self):
        def require(ok, field, what):
            if not ok:
                raise ValueError(f"GPTConfig.{field} {what}, got {getattr(self, field)!r}")

        lowest = dict(vocab_size=1, block_size=1, n_layer=1, n_head=1, n_kv_head=1, n_embd=1, head_dim=0, mlp_hidden=0,
                      window=0)  # the integer fields; head_dim and mlp_hidden 0: the default, window 0: none
        for name, low in lowest.items():
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= low, name, f"must be an int >= {low}")
        if self.head_dim == 0:
            require(self.n_embd % self.n_head == 0, "n_embd", f"must be a multiple of n_head ({self.n_head}) or set head_dim")
            self.head_dim = self.n_embd // self.n_head
        require(self.n_head % self.n_kv_head == 0, "n_head", f"must be divisible by n_kv_head ({self.n_kv_head})")
        require(self.head_dim % 2 == 0, "head_dim", "must be even for RoPE")
        require(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        require(self.mlp in MLP_KINDS, "mlp", f"must be one of {MLP_KINDS}")
        for name in ("rope_base", "norm_eps"):
            require(getattr(self, name) > 0, name, "must be positive")

    @property
    def mlp_width(self):
        if self.mlp_hidden:
            return self.mlp_hidden
        if self.mlp == "swiglu":  # three matrices instead of two: 2/3 of 4x keeps the parameter count
            return 64 * math.ceil(8 * self.n_embd / 3 / 64)
        return 4 * self.n_embd


def norm(dim, config):  # every norm of the model is made here: RMSNorm with a learned scale (Llama, Qwen3)
    return RMSNorm(dim, eps=config.norm_eps)


class RMSNorm(nn.RMSNorm):
    def forward(self, x):
        # Its scale in x's dtype, as autocast casts a Linear's weight: else bf16 q and k from their projections meet
        # an fp32 scale, and torch skips CUDA's fused kernel for 8 ops, warning every run. Statistics stay in fp32.
        return F.rms_norm(x, self.normalized_shape, in_dtype(self.weight, x.dtype), self.eps)


def in_dtype(x, dtype):  # x in dtype: no op dispatched where it is already (each costs a decode step microseconds)
    return x if x.dtype == dtype else x.to(dtype)


def dropout(config):  # no dropout, no module that dispatches an op doing nothing
    return nn.Dropout(config.dropout) if config.dropout else nn.Identity()


# ----------------------------------------------------------------------------------------------------
# Positions (RoPE and the mask rule), attention and the KV cache


class Positions:
    """Where a forward pass's tokens are: ids (T,), RoPE's cos and sin there (T, 1, hd) for all layers (from table, a
    KV cache's, if given); key_tokens (B, S), the ids at the positions attention reads; newest: whether the tokens are
    the last keys it reads (a growing cache's, or no cache); mask: the one all layers share, once attention made it."""

    def __init__(self, ids, head_dim, base, key_tokens=None, newest=False, table=None):
        self.ids, self.key_tokens, self.newest, self.mask = ids, key_tokens, newest, None
        self.cos, self.sin = rotary_table(ids, head_dim, base) if table is None else (table[0][ids], table[1][ids])


def rotary_table(ids, head_dim, base):
    """RoPE's cos and sin (T, 1, hd) at positions ids (T,): pair i's angle p * base^(-2i/hd) at i and i + hd/2, the
    sin's first half negated for rope. The angles in fp32 whatever the model's dtype: long contexts need it."""
    inv_freq = base ** (torch.arange(0, head_dim, 2, device=ids.device) / -head_dim)  # (hd/2,)
    angles = (ids[:, None] * inv_freq)[:, None, :]  # (T, 1, hd/2)
    sin = angles.sin()
    return angles.cos().repeat(1, 1, 2), torch.cat((-sin, sin), dim=-1)


def rope(x, positions):
    """x (B, T, h, hd) with each pair (x[i], x[i + hd/2]) turned by the angle p * rope_base^(-2i/hd), p its token's
    position: x cos + (x[i + hd/2], x[i]) (-sin, sin), in x's dtype (cos, sin rounded to it: Llama's bf16 rope)."""
    if positions.cos.dtype != x.dtype:  # under autocast: cast once a forward, for all layers
        positions.cos, positions.sin = positions.cos.to(x.dtype), positions.sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, h, hd/2) each
    return torch.addcmul(x * positions.cos, torch.cat((x2, x1), dim=-1), positions.sin)


def can_attend(query_pos, key_pos, config, layer, tokens):
    """The mask rule, for every attention path: True where the query at query_pos may see the key at key_pos
    (tensors that broadcast) in layer `layer`, tokens (B, S) being the ids at key positions 0 .. S-1. Causal: no key
    after the query; with a window, none window or more before it. (T, S), or (B, 1, T, S) from a rule of the tokens."""
    visible = key_pos <= query_pos
    if config.window:
        visible = visible & (key_pos > query_pos - config.window)
    return visible


def attention(q, k, v, positions, module, dropout_p=0.0):
    """softmax(q k^T / sqrt(hd) + can_attend's mask) v, grouped-query: q (B, nh, T, hd) at positions.ids (T,), k and
    v (B, n_kv, S, hd) at 0 .. S-1, for module, the CausalSelfAttention calling (its config, its layer_idx, and any
    parameter an edit gives it: a learned term reads it here). With no window the rule is key <= query: no mask to
    build for a whole sequence (S == T, is_causal) or for one new token after its cache (it sees every key)."""
    config, layer = module.config, module.layer_idx
    B, n_head, T, head_dim = q.shape
    n_kv_head, S = k.size(1), k.size(2)
    plain_causal = config.window == 0  # the rule of can_attend here: a rule edited to hide more joins this condition
    causal = plain_causal and T == S  # a whole sequence: is_causal
    sees_all = plain_causal and T == 1 and positions.newest  # one token after its growing cache
    mask = positions.mask if plain_causal else None  # key <= query in every layer: the first layer's mask, if made
    if mask is None and not (causal or sees_all):
        mask = can_attend(positions.ids[:, None], torch.arange(S, device=q.device), config, layer,
                          positions.key_tokens)  # (T, S), or (B, 1, T, S)
        if plain_causal:  # kept for the other layers, in the form SDPA adds it
            mask = positions.mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(~mask, -math.inf)
    if T == 1 and not causal:  # one token: a kv group's query heads (one position, one mask row) become the rows of one
        y = F.scaled_dot_product_attention(q.view(B, n_kv_head, n_head // n_kv_head, head_dim), k, v,
                                           attn_mask=mask, dropout_p=dropout_p)  # query block: each kv head read once
        # equal heads, no enable_gqa; only (B, nh, 1, S) scores, fused or not. A per-head term in the scores (a bias,
        # ALiBi's slopes) must follow the regrouping: here query head h is row h % group of kv group h // group.
        return y.reshape(B, n_head, 1, head_dim)  # a copy only where a kernel's output has other strides
    gqa = n_head != n_kv_head
    if gqa:
        from gpt import sdpa  # which of SDPA's kernels take grouped-query attention on which card
    if gqa and not sdpa.takes_gqa(q, masked=mask is not None):  # else SDPA's math kernel would hold every score
        group = n_head // n_kv_head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, S, hd): head h reads
        gqa = False  # kv head h // group, as enable_gqa does
    if causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


class KVCache:
    """Keys and values of every layer (n_kv_head heads only), and RoPE's cos and sin (rotary), for max_len positions,
    position p in slot p. A growing cache counts its positions (pos); a static one is written at input_pos, read all."""

    def __init__(self, n_layer, batch_size, n_kv_head, max_len, head_dim, device=None, dtype=None, static=False,
                 rope_base=10000.0):
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)
        self.k, self.v = torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
        self.tokens = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)  # each slot's token id
        self.layer_ids = torch.arange(n_layer, device=device)  # indices as a tensor: see update
        self.rotary = tuple(t.to(self.k.dtype) for t in rotary_table(torch.arange(max_len, device=device), head_dim,
                                                                     rope_base))  # (max_len, 1, hd) each, as k
        self.max_len, self.static = max_len, static
        self.pos = 0  # how many positions are filled; the next token goes here

    def update(self, layer, k, v, positions):
        """Write this layer's k, v (B, n_kv, T, hd) of the tokens at positions (T,) into their slots; return the
        keys and values attention reads (B, n_kv, S, hd): slots 0 .. pos + T - 1, or every slot if static."""
        if not self.static:  # positions are pos .. pos + T - 1: a slice, the cheapest write
            end = self.pos + k.size(2)
            self.k[layer, :, :, self.pos:end], self.v[layer, :, :, self.pos:end] = k, v
            return self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        # One index_put_ on the whole buffer, not on the view self.k[layer]: compiled, a write into a view of an
        # input becomes a copy of the whole input (every layer's cache, every step); this one stays in place.
        index = (self.layer_ids[layer:layer + 1], slice(None), slice(None), positions)
        self.k[index], self.v[index] = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)  # indexed dims first: (T, B, n_kv, hd)
        return self.k[layer], self.v[layer]

    def update_tokens(self, idx, positions):  # ids idx (B, T) into their slots; those attention reads (B, S), as update
        self.tokens[:, positions] = idx
        return self.tokens if self.static else self.tokens[:, :self.pos + idx.size(1)]

    def truncate(self, length):  # forget every position from `length` on (e.g. rejected speculated tokens)
        if not 0 <= length <= self.pos:
            raise ValueError(f"KVCache.truncate: length must be in [0, {self.pos}] (the filled length), got {length}")
        self.pos = length


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx  # layer_idx: which slice of the KV cache is ours
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=config.bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=config.bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=config.bias)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.resid_dropout = dropout(config)
        self.q_norm = norm(self.head_dim, config) if config.qk_norm else nn.Identity()  # one for all heads (Qwen3)
        self.k_norm = norm(self.head_dim, config) if config.qk_norm else nn.Identity()

    def queries_and_keys(self, x, positions):  # x (B, T, C) -> q (B, nh, T, hd), k (B, n_kv, T, hd), as attended
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim))  # (B, T, nh, hd)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim))  # (B, T, n_kv, hd)
        return rope(q, positions).transpose(1, 2), rope(k, positions).transpose(1, 2)  # heads first

    def forward(self, x, positions, kv_cache=None):  # x (B, T, C) of the tokens at Positions positions
        B, T, _ = x.shape
        q, k = self.queries_and_keys(x, positions)  # attention.py draws its maps from these too
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v, positions.ids)  # (B, n_kv, S, hd): the cached keys too
        y = attention(q, k, v, positions, self, self.config.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, nh, T, hd) -> (B, T, nh * hd)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.kind, width = config.mlp, config.mlp_width
        if self.kind == "swiglu":  # silu(gate) * up: a learned gate on each hidden unit
            self.gate_proj = nn.Linear(config.n_embd, width, bias=config.bias)
        self.up_proj = nn.Linear(config.n_embd, width, bias=config.bias)
        self.down_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.dropout = dropout(config)

    def forward(self, x):
        if self.kind == "swiglu":
            hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        elif self.kind == "gelu":
            hidden = F.gelu(self.up_proj(x), approximate="tanh")
        elif self.kind == "relu2":  # a kind with no branch here leaves hidden unset: an error, not a silent fallback
            hidden = F.relu(self.up_proj(x)).square()
        return self.dropout(self.down_proj(hidden))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = norm(config.n_embd, config)
        self.self_attn = CausalSelfAttention(config, layer_idx)
        self.post_attention_layernorm = norm(config.n_embd, config)
        self.mlp = MLP(config)

    def forward(self, x, positions, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.dropout = dropout(config)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = norm(config.n_embd, config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2's init by module and role: N(0, 0.02) weights, zero biases, norms by their own init, and the
        linears that write into the residual stream scaled by 1/sqrt(2 * n_layer), so it does not grow with depth."""
        writes_residual = {m for block in self.layers for m in (block.self_attn.o_proj, block.mlp.down_proj)}
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and self.config.tie_embeddings:
                    continue  # its weight is the embedding's, initialized already
                scale = 1 / math.sqrt(2 * self.config.n_layer) if module in writes_residual else 1.0
                nn.init.normal_(module.weight, std=0.02 * scale)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()  # norms: scale 1 (and bias 0)

    def hidden_states(self, idx, kv_cache=None, input_pos=None):
        """Final normed hidden states (B, T, n_embd) of idx (B, T), after the cache's positions if one is given."""
        positions = self.positions(idx, kv_cache, input_pos)
        x = self.dropout(self.embed_tokens(idx))  # (B, T, C)
        for block in self.layers:
            x = block(x, positions, kv_cache)
        if kv_cache is not None and not kv_cache.static:  # every layer has written its keys and values
            kv_cache.pos += idx.size(1)
        return self.norm(x)

    def positions(self, idx, kv_cache, input_pos):
        """The Positions of the tokens idx (B, T), after checking that they fit where they go (into the cache, if
        one is given: their ids are written there)."""
        B, T = idx.shape
        start, end = (0, self.config.block_size) if kv_cache is None else (kv_cache.pos, kv_cache.max_len)
        if (input_pos is not None) != (kv_cache is not None and kv_cache.static):
            raise ValueError("input_pos goes with a static KV cache (new_kv_cache(..., static=True)), which needs it")
        if kv_cache is not None and kv_cache.k.size(1) != B:
            raise ValueError(f"KV cache was made for batch size {kv_cache.k.size(1)}, got a batch of {B}")
        if input_pos is None and start + T > end:
            raise ValueError(f"sequence length {T} exceeds block_size {end}" if kv_cache is None else f"KV cache "
                             f"overflow: {start} cached + {T} new tokens > max_len {end}; make a larger new_kv_cache")
        ids = torch.arange(start, start + T, device=idx.device) if input_pos is None else input_pos
        key_tokens = idx if kv_cache is None else kv_cache.update_tokens(idx, ids)  # (B, S)
        return Positions(ids, self.config.head_dim, self.config.rope_base, key_tokens, newest=input_pos is None,
                         table=None if kv_cache is None else kv_cache.rotary)

    def forward(self, idx, targets=None, kv_cache=None, input_pos=None, loss_chunk=0):
        """Logits (B, T, vocab_size) of the tokens idx (B, T), and their mean cross-entropy against targets (B, T;
        -1 is ignored) or None. input_pos: see hidden_states. loss_chunk: see chunked_loss (logits are then None)."""
        hidden = self.hidden_states(idx, kv_cache, input_pos)
        if targets is not None and loss_chunk:
            return None, self.chunked_loss(hidden.flatten(0, 1), targets.flatten(), loss_chunk)
        logits = self.logits(hidden)  # the loss in fp32 whatever their dtype (FSDP's bf16 policy: no autocast)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def logits(self, hidden):
        """Logits (..., vocab_size) of final hidden states (..., n_embd): the one way from hidden states to logits,
        for forward, generate, the chunked loss and every command (sample.py, eval.py, the experiments): an edit here
        (a soft cap, a temperature) reaches them all, and a quantized head keeps it."""
        return self.lm_head(hidden)

    def chunked_loss(self, hidden, targets, chunk):  # hidden (N, C), targets (N,): the same loss in less memory
        from gpt.loss import chunked_cross_entropy  # runs with loss_chunk only: the head's logits a chunk at a time
        return chunked_cross_entropy(self.logits, hidden, targets, chunk, [p for p in self.parameters() if p.requires_grad])

    def new_kv_cache(self, batch_size, max_len, dtype=None, device=None, static=False):
        """An empty KV cache for batch_size sequences of max_len tokens (static: see KVCache); bf16 autocast: dtype=bf16."""
        if not 1 <= max_len <= self.config.block_size or batch_size < 1:
            raise ValueError(f"KV cache max_len must be in [1, block_size={self.config.block_size}] and batch_size "
                             f">= 1, got {max_len} and {batch_size}")
        param = self.embed_tokens.weight  # the head may be quantized (gpt/quantize.py) and hold no .weight
        return KVCache(self.config.n_layer, batch_size, self.config.n_kv_head, max_len, self.config.head_dim,
                       device=device or param.device, dtype=dtype or param.dtype, static=static,
                       rope_base=self.config.rope_base)

    @torch.inference_mode()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None):
        """Extend idx (B, T) by max_new_tokens sampled tokens (temperature 0: greedy), prompt prefilled once, then
        one token per step against the KV cache. Call model.eval() first if the model has dropout."""
        B, T = idx.shape
        if max_new_tokens < 1 or T < 1 or T + max_new_tokens > self.config.block_size:
            raise ValueError(f"generate needs a prompt, max_new_tokens >= 1 and their sum <= block_size "
                             f"({self.config.block_size}); got {T} and {max_new_tokens}")
        from gpt.engine import last_logits  # one decode step, as sample.py takes it
        from gpt.sampling import sample_next_token  # choosing a token from logits (temperature, top-k, top-p)
        kv_cache = self.new_kv_cache(B, T + max_new_tokens - 1)  # the last token sampled is never fed back
        tokens = [idx]
        for step in range(1, max_new_tokens + 1):
            logits = last_logits(self, tokens[-1], kv_cache)  # (B, vocab_size)
            tokens.append(sample_next_token(logits, temperature, top_k, top_p, generator))  # (B, 1)
            if (tokens[-1] == logits.size(-1)).any():  # sampling's V, no token: a row of NaN or inf logits
                raise RuntimeError(f"generate: the logits for new token {step} hold NaN or inf (broken weights, an "
                                   "edit of model.py, or 16-bit overflow: try float32)")
        return torch.cat(tokens, dim=1)

    def num_params(self):  # the tied embedding and output head counted once
        return sum(p.numel() for p in self.parameters())
