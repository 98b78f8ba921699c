"""The model's shape, defined once: the config's model section (config.sections.ModelSettings)
and the model's own arguments (ModelArgs) both extend it. Plain Python, no torch: loading a
config imports no tensor library."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ModelShape:
    """A Llama-style decoder's shape."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 4096
    ffn_hidden: int | None = None  # default: 8/3 * dim rounded up to ffn_multiple_of
    ffn_multiple_of: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1-style rotary scaling (transformers' rope_type "llama3"): 1.0 is none. Long
    # wavelengths are slowed by the factor, short ones kept, those between blended.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        hidden = int(8 * self.dim / 3)
        return self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)


@dataclass
class ModelArgs(ModelShape):
    """The shape plus the longest sequence the model is built for (the run's data.seq_len)."""

    max_seq_len: int = 2048
