"""A plain Llama: RMSNorm, rotary embeddings (with Llama-3.1 scaling), grouped-query attention,
SwiGLU MLP, optional tied embeddings, and a static KV cache for decoding.

The model knows nothing of how it is parallelized: parallel/ swaps its layers and attention function.
Rotary embeddings rotate interleaved pairs (x[2i], x[2i+1]) as in Meta's reference code; Hugging Face
checkpoints store q/k rows permuted for rotate-half, which model/hf.py undoes at load.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.args import ModelArgs, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [B, S, H, D] by rope [S, D / 2, 2] (or [B, S, D / 2, 2])."""
    pairs = x.float().unflatten(-1, (-1, 2))
    if rope.dim() == 3:
        rope = rope.unsqueeze(0)
    cos, sin = rope[..., 0].unsqueeze(2), rope[..., 1].unsqueeze(2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of the rotary pairs, [head_dim / 2], with Llama-3.1 scaling if given:
    long wavelengths are divided by `factor`, short ones kept, the band between interpolated."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return freqs.float()
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, interpolated)
    scaled = torch.where(wavelen < high_freq_wavelen, freqs, scaled)
    return scaled.float()


def rope_table(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin of every position's rotation angles: [max_seq_len, head_dim / 2, 2], fp32."""
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling).to(device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention over [B, H, S, D] tensors; causal when `mask` is None, else the boolean mask
    (True = attend). Key/value heads may be fewer than query heads (grouped-query attention)."""
    grouped = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)


class KVCache(nn.Module):
    """Static key/value cache [B, H_kv, max_len, D], written in place at the decode positions."""

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # Heads of this module (a tensor-parallel plan that splits the projections updates them).
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Replaceable by parallel/ (e.g. Ulysses) without touching this module.
        self.attention_fn: AttentionFn = sdpa_attention
        # Decode steps on kernels.decode_attention (model.decode_kernels) where it runs (_fused_decode).
        self.fused_decode = args.decode_kernels
        self.kv_cache: KVCache | None = None

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as flat [B, S, heads * D] tensors; a tensor-parallel plan swaps this for one gather
        feeding all three weights."""
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, input_pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.wo(self.attend(*self.project_qkv(x), rope, input_pos))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: torch.Tensor,
        input_pos: torch.Tensor | None,
        fp8_output: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Rotary embeddings, the KV cache and attention for projected q, k, v [B, S, heads * D], with
        `rope` the model's whole rotary table; returns [B, S, n_heads * D], the input of the output
        projection, or with `fp8_output` that quantized for an FP8 output projection: e4m3 [B, S,
        n_heads * D] with fp32 scales per token [B * S], or from the fused decode kernel per token and
        kv head [B, n_kv_heads] (kernels.decode_attention)."""
        bsz, seqlen = q.shape[:2]
        if self._fused_decode(q, seqlen):
            from kernels.decode_attention import decode_attention

            # One new token over the cache: rotary, cache write, attention (and quantize) in one op.
            return decode_attention(q, k, v, rope, input_pos, self.kv_cache.k, self.kv_cache.v, fp8_output)
        rope = rope[:seqlen] if input_pos is None else rope[input_pos]
        # Head counts come from the projections, so a tensor-parallel shard runs the same code.
        q = apply_rope(q.view(bsz, seqlen, -1, self.head_dim), rope)
        k = apply_rope(k.view(bsz, seqlen, -1, self.head_dim), rope)
        v = v.view(bsz, seqlen, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = None
        if self.kv_cache is not None:
            assert input_pos is not None, "a model with a KV cache needs input_pos"
            k, v = self.kv_cache.update(input_pos, k, v)
            mask = torch.arange(k.shape[2], device=q.device)[None, :] <= input_pos[:, None]
        out = self.attention_fn(q, k, v, mask).transpose(1, 2).reshape(bsz, seqlen, -1)
        if not fp8_output:
            return out
        from kernels.fp8 import quantize_per_token

        values, scales = quantize_per_token(out.view(bsz * seqlen, -1))
        return values.view(out.shape), scales

    def _fused_decode(self, q: torch.Tensor, seqlen: int) -> bool:
        """Whether this call takes kernels.decode_attention: one token per sequence over a KV cache, the
        stock attention function (parallel/ may have replaced it), a device and shapes the kernel runs.
        Only decode imports the kernels (and Triton): training runs where Triton is not installed."""
        if not (self.fused_decode and self.kv_cache is not None and seqlen == 1):
            return False
        from kernels.decode_attention import fused_decode_supported

        return self.attention_fn is sdpa_attention and fused_decode_supported(
            q.device, self.kv_cache.k.dtype, self.head_dim
        )


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, input_pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


def init_plan(args: ModelArgs) -> list[tuple[str, Callable[[torch.Tensor], object]]]:
    """(parameter name, in-place initialiser) of every weight, in the order the random ones are drawn:
    (truncated) normal, with the projections that write into the residual stream (wo, w2) scaled down
    with depth so the residual's variance stays put as layers are added. A parallelized model follows
    the same plan on full-shape tensors and keeps its slices (parallel/checkpoint.py), so it starts
    from the weights of the unsharded model."""
    std = args.init_std
    depth_std = std / math.sqrt(2 * args.n_layers)

    def trunc_normal(s: float) -> Callable[[torch.Tensor], object]:
        return lambda t: nn.init.trunc_normal_(t, std=s, a=-3 * s, b=3 * s)

    embedding_std = std if args.tie_embeddings else 1.0
    plan = [("tok_embeddings.weight", lambda t: nn.init.normal_(t, std=embedding_std))]
    for i in range(args.n_layers):
        for name, s in [
            ("attention.wq", std),
            ("attention.wk", std),
            ("attention.wv", std),
            ("attention.wo", depth_std),
            ("feed_forward.w1", std),
            ("feed_forward.w3", std),
            ("feed_forward.w2", depth_std),
        ]:
            plan.append((f"layers.{i}.{name}.weight", trunc_normal(s)))
        plan += [(f"layers.{i}.{norm}.weight", nn.init.ones_) for norm in ("attention_norm", "ffn_norm")]
    plan.append(("norm.weight", nn.init.ones_))
    if not args.tie_embeddings:
        plan.append(("output.weight", trunc_normal(args.dim**-0.5)))
    return plan


class Llama(nn.Module):
    """tokens [B, S] -> logits [B, S, vocab]. Build on the meta device and call `init_weights()` after
    `to_empty(device=...)`, or load a checkpoint into it."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_table(args), persistent=False)

    def init_weights(self) -> None:
        """Rebuild the rotary table and draw every weight by `init_plan` (after `to_empty`)."""
        self.rope = rope_table(self.args, device=self.rope.device)
        if self.args.tie_embeddings:
            # to_empty() gives each module its own new parameter, which unties a shared one.
            self.output.weight = self.tok_embeddings.weight
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, init in init_plan(self.args):
                init(params[name])

    def setup_caches(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> None:
        """Allocate a static KV cache per layer for decoding up to `max_len` positions."""
        if max_len > self.args.max_seq_len:
            raise ValueError(
                f"cache length {max_len} exceeds model.max_seq_len={self.args.max_seq_len}: "
                "shorten the prompt plus new tokens or raise model.max_seq_len"
            )
        embedding = self.tok_embeddings.weight
        dtype, device = dtype or embedding.dtype, embedding.device
        for layer in self.layers:
            attn = layer.attention
            attn.kv_cache = KVCache(batch, max_len, attn.n_kv_heads, attn.head_dim, dtype).to(device)

    def clear_caches(self) -> None:
        for layer in self.layers:
            layer.attention.kv_cache = None

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """With a KV cache, `input_pos` [S] gives the positions of `tokens` in the cache."""
        seqlen = tokens.shape[1]
        if input_pos is None and seqlen > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seqlen} exceeds model.max_seq_len={self.args.max_seq_len}: "
                "use shorter sequences or raise model.max_seq_len"
            )
        h = self.tok_embeddings(tokens)
        # Each layer takes the whole rotary table and reads the rows of its positions (attend).
        for layer in self.layers:
            h = layer(h, self.rope, input_pos)
        return self.output(self.norm(h))
