"""A Llama-style decoder in plain PyTorch.

RMSNorm, rotary position embeddings, SwiGLU feed-forward and grouped-query attention
through ``scaled_dot_product_attention``. No distributed code lives here: parallelism is
applied to this plain module afterwards (see ``rayllm.parallel``).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from rayllm.model.shape import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # one fp32 copy of a bf16 x, not two (the memory planner counts one)
        norm = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return norm.type_as(x) * self.weight


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Rotation speed of each channel pair, (head_dim // 2,).

    With ``rope_scaling_factor`` != 1, Llama 3.1's scaling: pairs whose wavelength exceeds
    ``rope_original_max_len / rope_low_freq_factor`` turn ``factor`` times slower, those shorter
    than ``rope_original_max_len / rope_high_freq_factor`` keep their speed, and those between
    blend the two by where the wavelength falls.
    """
    hd = args.head_dim
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    factor = args.rope_scaling_factor
    if factor == 1.0:
        return inv_freq
    low, high, original = args.rope_low_freq_factor, args.rope_high_freq_factor, args.rope_original_max_len
    wavelength = 2 * math.pi / inv_freq
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: slowed, 1: kept
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    return torch.where(wavelength > original / low, inv_freq / factor, scaled)


def rope_tables(args: ModelArgs, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim // 2)."""
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), rope_frequencies(args))
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, H, T, hd) by position-dependent angles."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each (B, H, T, hd/2)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class LayerCache:
    """One layer's view of a ``KVCache``: where this forward's keys and values go."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, start: int):
        self.k, self.v, self.start = k, v, start

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, KV, T, hd) at the next positions; return all keys and values so far."""
        end = self.start + k.shape[2]
        self.k[:, :, self.start : end] = k
        self.v[:, :, self.start : end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer for the positions seen so far, preallocated to
    ``max_len``: decoding then costs one position's forward per new token, not the sequence's."""

    def __init__(self, args: ModelArgs, batch: int, device: torch.device, dtype: torch.dtype, max_len: int = 0):
        shape = (batch, args.n_kv_heads, max_len or args.max_seq_len, args.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.length = 0

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self.k[i], self.v[i], self.length)

    def reset(self) -> None:
        self.length = 0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerCache | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds H/tp query and KV/tp key/value heads.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = q.shape[1] != k.shape[1]
        if kv is None or kv.start == 0:
            if kv is not None:
                kv.write(k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:  # decoding: the new positions attend to every cached one and causally to each other
            k, v = kv.write(k, v)
            visible = torch.ones(T, kv.start + T, dtype=torch.bool, device=x.device).tril(diagonal=kv.start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerCache | None = None
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, kv)
        return x + self.feed_forward(self.ffn_norm(x))


def initial_weight(
    name: str, shape: tuple[int, ...], args: ModelArgs, seed: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The starting value of parameter ``name`` in full, from a generator of its own.

    GPT-2 style: norms 1, matrices N(0, 0.02), residual projections (wo, w2) scaled down by
    depth. One seed per parameter, not one stream for the model: a rank that holds a shard
    computes exactly the values a single process would, whatever the mesh, and in any order.
    """
    if len(shape) < 2:
        return torch.ones(shape, device=device)
    std = 0.02 / math.sqrt(2 * args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
    generator = torch.Generator(device).manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, vocab) against targets (B, T), in fp32. Compiled, the
    fp32 upcast fuses into the log-softmax: no fp32 copy of the logits is ever held."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


class Llama(nn.Module):
    """Built on the ``meta`` device, it allocates nothing: ``rayllm.parallel`` shards it, then
    materialises each rank's shards with ``initial_weight`` and ``reset_buffers``."""

    def __init__(self, args: ModelArgs, seed: int = 0):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by global index (the same names as a list's): a pipeline stage deletes the blocks it
        # does not hold and the rest keep the plain model's names (rayllm.parallel.pp).
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        shape = (args.max_seq_len, args.head_dim // 2)
        self.loss_fn = cross_entropy  # replaced by its compiled form under train.compile
        # Under sequence parallelism the hidden states between pipeline stages are split along the
        # sequence (rayllm.parallel.tp sets this to tp): a later stage sees T / sequence_shards of them.
        self.sequence_shards = 1
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        if not self.rope_cos.is_meta:
            self.reset_buffers()
            self.init_weights(seed)

    def reset_buffers(self) -> None:
        """The rotary tables (derived, never checkpointed): after materialising from ``meta`` too."""
        cos, sin = rope_tables(self.args, self.args.max_seq_len)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        for name, p in self.named_parameters():
            p.copy_(initial_weight(name, tuple(p.shape), self.args, seed, p.device))

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab); with targets (B, T), the mean cross-entropy instead.

        With a ``cache``, tokens continue the positions already in it (and are added to it). A
        pipeline stage (rayllm.parallel.pp) lacks some parts: without the embedding it takes the
        previous stage's hidden states (B, T, dim), without the head it returns its own."""
        T = tokens.shape[1] * (1 if self.tok_embeddings is not None else self.sequence_shards)
        start = cache.length if cache is not None else 0
        if start + T > self.args.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds the model's max_seq_len {self.args.max_seq_len}")
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, dim)
        for key, layer in self.layers.items():
            h = layer(h, cos, sin) if cache is None else layer(h, cos, sin, cache.layer(int(key)))
        if cache is not None:
            cache.length += T
        if self.output is None:
            return h  # (B, T, dim) for the next stage
        logits = self.output(self.norm(h))  # (B, T, vocab)
        # The norm and the head are an FSDP unit of their own (rayllm.parallel.fsdp), whose hooks
        # must stay outside compiled code: under train.compile only loss_fn is compiled.
        return logits if targets is None else self.loss_fn(logits, targets)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward).

    6 FLOPs per weight of every matmul (attention, feed-forward, output head; the embedding
    lookup is no matmul) plus the attention score and value matmuls, 12 * layers * dim * T,
    counted over the full T x T square as SDPA's kernels compute it.
    """
    d, h = args.dim, args.hidden_dim
    kv = args.n_kv_heads * args.head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * h  # wq, wo, wk, wv, w1, w2, w3
    matmul_weights = args.n_layers * per_layer + d * args.vocab_size
    return 6.0 * matmul_weights + 12.0 * args.n_layers * d * seq_len
