"""Model hyper-parameters: one dataclass, used as the Hydra `model` config group's schema."""

from __future__ import annotations

import math
from dataclasses import dataclass


def positive(value: float) -> bool:
    """A finite number above zero (a config's float may be inf or nan)."""
    return math.isfinite(value) and value > 0


@dataclass
class RopeScaling:
    """Llama-3.1 rotary frequency scaling (`rope_type: llama3` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass
class ModelArgs:
    """Shape of a Llama-style model. Every preset under configs/model/ fills these fields."""

    name: str = "debug"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    # Grouped-query attention: key/value heads, dividing n_heads.
    n_kv_heads: int = 4
    vocab_size: int = 264
    # Hidden size of the SwiGLU MLP.
    ffn_hidden: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # None: plain RoPE. Set for Llama-3.1 style long-context frequency scaling.
    rope_scaling: RopeScaling | None = None
    # Longest sequence the model accepts (rotary tables and the KV cache are sized from it).
    max_seq_len: int = 2048
    # Share the input embedding with the output projection.
    tie_embeddings: bool = False
    # Std of the random initial projections of the blocks (wo and w2 divided by sqrt(2 * n_layers);
    # model/llama.py's init_plan); a tied embedding starts with it too. An untied output projection
    # starts at dim ** -0.5 and an untied embedding at 1.
    init_std: float = 0.02
    # Decode only: run linear layers on FP8 weights (per-channel scales) with weft's FP8 kernels.
    fp8: bool = False
    # Decode only (serve.py): attention of each new token in one fused kernel (rotary, KV-cache write,
    # split-KV attention: kernels/decode_attention.py), and bf16 on a CUDA GPU every linear layer on
    # weft's skinny GEMM, the projections that read the same input fused (wq|wk|wv, w1|w3), and the
    # norms and SwiGLU on fused kernels (model/decode.py); false: the stock PyTorch modules (cuBLAS, SDPA).
    decode_kernels: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        """Raise a one-line ValueError naming the field to change when the shape is inconsistent."""
        sizes = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len")
        for name in sizes:  # first: the divisibility checks below divide by them
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be > 0")
        checks = [
            (
                self.dim % self.n_heads == 0,
                f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}",
            ),
            (
                self.head_dim % 2 == 0,
                f"head dim {self.head_dim} (model.dim / model.n_heads) must be even for rotary embeddings: "
                "change model.dim or model.n_heads",
            ),
            (
                self.n_heads % self.n_kv_heads == 0,
                f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}",
            ),
            # (inf passes > 0: norm_eps=inf zeroes every norm's output, init_std=inf fails in init)
            (positive(self.norm_eps), f"model.norm_eps={self.norm_eps} must be a finite number > 0"),
            (positive(self.rope_theta), f"model.rope_theta={self.rope_theta} must be a finite number > 0"),
            (positive(self.init_std), f"model.init_std={self.init_std} must be a finite number > 0"),
        ]
        scaling = self.rope_scaling
        if scaling is not None:  # rope_frequencies divides by each of these (factor 0 trains to NaN)
            checks += [
                (
                    positive(scaling.factor),
                    f"model.rope_scaling.factor={scaling.factor} must be a finite number > 0",
                ),
                (
                    scaling.original_max_position > 0,
                    f"model.rope_scaling.original_max_position={scaling.original_max_position} must be > 0",
                ),
                (
                    0 < scaling.low_freq_factor < scaling.high_freq_factor < math.inf,
                    f"model.rope_scaling.low_freq_factor={scaling.low_freq_factor} must be > 0 and below "
                    f"model.rope_scaling.high_freq_factor={scaling.high_freq_factor}",
                ),
            ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def num_params(self) -> int:
        """Parameters of the model (a tied output projection counted once)."""
        embed = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else embed
        return self.n_layers * (self.layer_matmul_params() + 2 * self.dim) + self.dim + embed + output

    def training_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token (forward + backward), as in the PaLM paper's MFU: 6 per weight
        of every matmul (the output projection included, the embedding lookup not) plus causal
        attention's score and value matmuls (12 * layers * dim * seq, halved by the mask)."""
        matmul_params = self.n_layers * self.layer_matmul_params() + self.vocab_size * self.dim
        return 6 * matmul_params + 6 * self.n_layers * self.dim * seq_len

    def layer_matmul_params(self) -> int:
        attention = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        return attention + 3 * self.dim * self.ffn_hidden
