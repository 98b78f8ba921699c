"""The planner's counts of the config's model: parameters per block and root, and the bytes a
block saves for backward per token (what rayllm.model.Llama builds and autograd keeps)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """Parameter counts from the config's model section (what rayllm.model.Llama builds)."""

    d: int
    layers: int
    heads: int
    q: int  # query width: heads x head_dim
    kv: int  # key/value width: kv_heads x head_dim
    hidden: int
    vocab: int
    block: int  # parameters of one transformer block
    root: int  # embedding, output head (unless tied) and final norm
    tied: bool  # embedding and head share one weight

    @property
    def total(self) -> int:
        return self.layers * self.block + self.root

    @property
    def held_root(self) -> int:
        """What FSDP keeps gathered beside the blocks (rayllm.parallel.fsdp.forward_units): tied, the
        whole root for the whole step; untied, the final norm and head, from their forward to their
        backward (the embedding is a unit of its own, gathered only while it computes)."""
        return self.root if self.tied else self.vocab * self.d + self.d


def model_shape(m) -> Shape:
    hd = m.dim // m.n_heads
    hidden = m.ffn_hidden or m.ffn_multiple_of * math.ceil(int(8 * m.dim / 3) / m.ffn_multiple_of)
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    block = 2 * m.dim * q + 2 * m.dim * kv + 3 * m.dim * hidden + 2 * m.dim  # wq wo, wk wv, w1 w2 w3, 2 norms
    root = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim
    return Shape(m.dim, m.n_layers, m.n_heads, q, kv, hidden, m.vocab_size, block, root, m.tie_embeddings)


def norm_bytes_per_token(s: Shape, e: int, tp: int) -> float:
    """RMSNorm saves its input upcast to fp32 (in fp32: the input itself), the rsqrt, and the normalised
    value before the weight, all on the sequence shard under sequence parallelism; and its output as
    the next matmuls see it: gathered to the full sequence under TP."""
    return (4 * s.d + 4 + e * s.d) / tp + e * s.d


def loss_bytes_per_token(s: Shape, e: int, tp: int) -> float:
    """The loss's peak for one token: its logits (vocab / tp) upcast to fp32 for cross-entropy,
    whose backward holds the saved log-softmax, its gradient and the logits' gradient at once,
    3 x 4 bytes each; plus the final norm."""
    return s.vocab / tp * 12 + norm_bytes_per_token(s, e, tp)


def held_loss_bytes_per_token(s: Shape, e: int, tp: int) -> float:
    """What a micro-batch waiting for its backward keeps of the loss, per token: its logits (a
    pipeline stage's output, in compute dtype), the fp32 log-softmax and the final norm's tensors."""
    return s.vocab / tp * (e + 4) + norm_bytes_per_token(s, e, tp)


def block_bytes_per_token(s: Shape, e: int, tp: int) -> float:
    """What one block saves for backward, per token, in compute dtype ``e`` bytes: two norms; q and k
    after rotary, v, SDPA's output and its fp32 logsumexp (flash: no T x T matrix), wo's input; w1's
    output, SiLU's, w3's and their product. TP splits heads and the feed-forward width."""
    attention = e * s.q + 2 * e * s.kv + 4 * s.heads + e * s.q + e * s.q
    return 2 * norm_bytes_per_token(s, e, tp) + (attention + 4 * e * s.hidden) / tp


def selective_block_bytes_per_token(s: Shape, e: int, tp: int) -> float:
    """What one block keeps per token under selective checkpointing (rayllm.parallel.checkpointing):
    its input (on the sequence shard), every matmul's output (wq, wk, wv, w1, w3 split by TP; wo's and
    w2's local outputs over the whole sequence before their reduce-scatter, and those reduce-scatters'
    outputs under TP), and attention's output with its fp32 logsumexp."""
    matmuls = e * (s.q + 2 * s.kv + 2 * s.hidden) / tp + 2 * e * s.d
    scattered = 2 * e * s.d / tp if tp > 1 else 0
    return e * s.d / tp + matmuls + scattered + (e * s.q + 4 * s.heads) / tp


def flops_per_token(s: Shape, seq: int) -> float:
    """As rayllm.model.flops_per_token: 6 per matmul weight, plus attention's scores and values."""
    return 6.0 * (s.layers * (s.block - 2 * s.d) + s.d * s.vocab) + 12.0 * s.layers * s.d * seq
