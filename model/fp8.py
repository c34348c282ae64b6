"""FP8 decode (`model.fp8=true`): the plain model's linear weights quantized to e4m3 with one scale
per output channel, and each block run on weft's fused FP8 kernels:

    (previous MLP output, residual) -> residual add + RMSNorm + quantize -> [wq|wk|wv] FP8 GEMM
      -> attention -> quantize -> wo FP8 GEMM -> residual add + RMSNorm + quantize -> [w1|w3] FP8 GEMM
      -> SwiGLU + quantize -> w2 FP8 GEMM -> (MLP output, residual) to the next block

and after the last block: residual add + RMSNorm + quantize -> output FP8 GEMM -> logits.

Activations get one scale per token, computed inside the norm and SwiGLU kernels. The projections
that read the same input are fused into one weight, so each reads its input once and launches once.

serve.py quantizes each block as soon as it has its weights (`convert_block_to_fp8`, parallel/'s
`materialize` calling it block by block), so that the model never exists whole in bf16: Llama-3-70B in
FP8 (about 70 GB) builds and runs on one H200, whose memory its 141 GB of bf16 weights all but fill.

A tensor-parallel model (parallel/ planned it; each rank holds its shards) converts the same way, given
three hooks from parallel/ (`fp8_decode_hooks`): `reduce` sums the partial outputs of the row-parallel wo
and w2 over the ranks, `gather_logits` joins the vocabulary shards of the output projection, and
`channel_amax` takes the largest magnitude of each output channel over the row-parallel shards, so
that they carry the scales (and e4m3 values) of the unsplit weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.fp8 import FP8, quantize_per_token, quantize_weight_per_channel
from kernels.fp8_gemm import fp8_gemm
from kernels.fp8_norm import add_rmsnorm_fp8, rmsnorm_fp8
from kernels.fp8_swiglu import swiglu_fp8
from model.llama import Llama, RMSNorm, TransformerBlock


def check_fp8_device(device: torch.device) -> None:
    """FP8 tensor-core kernels need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper)."""
    if device.type != "cuda":
        raise ValueError("model.fp8=true runs on CUDA GPUs only: use model.fp8=false on the CPU")
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores: use model.fp8=false")


Hook = Callable[[torch.Tensor], torch.Tensor]


# Weights are quantized this many elements (whole rows) at a time: each row has its own scale, so the
# result is the same, and the fp32 copies quantizing takes stay small (Llama-3-70B's output projection
# in one piece would need 13 GB of them).
QUANTIZE_SLICE_ELEMENTS = 2**26
# Bytes per element of a slice while it is quantized: its fp32 copy, the quotient by the scales and
# their clamped copy (kernels.fp8.quantize_reference), and the e4m3 result.
QUANTIZE_BYTES_PER_ELEMENT = 13


def row_slices(weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The weights' rows, in order, in slices of at most QUANTIZE_SLICE_ELEMENTS (at least one row)."""
    rows = max(1, QUANTIZE_SLICE_ELEMENTS // weights[0].shape[1])
    return [w.detach()[start : start + rows] for w in weights for start in range(0, w.shape[0], rows)]


class Fp8Weight(nn.Module):
    """One or more linear weights [N_i, K] concatenated and quantized: e4m3 [sum N_i, K] + fp32 [sum N_i]."""

    def __init__(self, *weights: torch.Tensor, full_amax: Hook | None = None) -> None:
        super().__init__()
        slices = row_slices(weights)
        rows, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
        q = torch.empty((rows, k), dtype=FP8, device=weights[0].device)
        scale = torch.empty(rows, dtype=torch.float32, device=weights[0].device)
        amax = None
        if full_amax is not None:  # the row-parallel shards' amax over the ranks, for all rows at once
            amax = full_amax(torch.cat([part.float().abs().amax(dim=-1) for part in slices]))
        start = 0
        for part in slices:
            end = start + part.shape[0]
            q[start:end], scale[start:end] = quantize_weight_per_channel(
                part, None if amax is None else amax[start:end]
            )
            start = end
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)

    def forward(self, x_fp8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        return fp8_gemm(x_fp8, x_scale, self.weight, self.scale)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


# Between FP8 blocks the residual stream travels as (pending [B, S, dim], residual [B * S, dim]): the
# last block's MLP output has not been added yet, so that the next fused add + RMSNorm kernel does the
# add (one launch less per layer than adding it here).
ResidualStream = tuple[torch.Tensor, torch.Tensor]
# An activation already in FP8: e4m3 [B, S, K] and its fp32 scales, one per token [B * S].
Fp8Activation = tuple[torch.Tensor, torch.Tensor]


class Fp8Linear(nn.Module):
    """A bias-free linear layer on an FP8 copy of `weight` [N, K], for an activation already in FP8;
    `after` is applied to its output (the gather of vocabulary shards under tensor parallelism)."""

    def __init__(self, weight: torch.Tensor, after: Hook = _identity) -> None:
        super().__init__()
        self.fp8 = Fp8Weight(weight)
        self.after = after

    def forward(self, x: Fp8Activation) -> torch.Tensor:
        q, scale = x
        return self.after(self.fp8(q.reshape(-1, q.shape[-1]), scale).view(*q.shape[:-1], -1))


class Fp8FinalNorm(nn.Module):
    """The final RMSNorm of the last block's residual stream, quantized per token for the FP8 output
    projection: the pending add, the norm and the quantize in one kernel."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: ResidualStream) -> Fp8Activation:
        pending, residual = x
        q, scale, _ = add_rmsnorm_fp8(pending.reshape(residual.shape), residual, self.weight, self.eps, None)
        return q.view_as(pending), scale


class Fp8Block(nn.Module):
    """A TransformerBlock's weights in FP8, its forward on the fused kernels (module docstring)."""

    def __init__(
        self, block: TransformerBlock, reduce: Hook = _identity, channel_amax: Hook | None = None
    ) -> None:
        super().__init__()
        # Sums the outputs of wo and w2 over the ranks when they are row-parallel shards.
        self.reduce = reduce
        attn, ffn = block.attention, block.feed_forward
        self.attention = attn  # rotary embeddings, KV cache and attention function stay as they are
        self.qkv = Fp8Weight(attn.wq.weight, attn.wk.weight, attn.wv.weight)
        self.qkv_sizes = [attn.wq.weight.shape[0], attn.wk.weight.shape[0], attn.wv.weight.shape[0]]
        self.wo = Fp8Weight(attn.wo.weight, full_amax=channel_amax)
        self.w13 = Fp8Weight(ffn.w1.weight, ffn.w3.weight)
        self.w2 = Fp8Weight(ffn.w2.weight, full_amax=channel_amax)
        self.attention_norm, self.ffn_norm = block.attention_norm, block.ffn_norm
        del attn.wq, attn.wk, attn.wv, attn.wo  # the bf16 copies are no longer needed

    def forward(
        self, x: torch.Tensor | ResidualStream, rope: torch.Tensor, input_pos: torch.Tensor | None = None
    ) -> ResidualStream:
        """The residual stream after this block, its MLP output still pending (ResidualStream); `x`
        is the embedding output for the first block, the previous block's stream after that."""
        norm = self.attention_norm
        if isinstance(x, tuple):
            pending, residual = x
            bsz, seqlen, dim = pending.shape
            # residual + the previous block's MLP output, and its norm quantized, in one kernel.
            xq, xs, residual = add_rmsnorm_fp8(
                pending.reshape(-1, dim), residual, norm.weight, norm.eps, None
            )
        else:
            bsz, seqlen, dim = x.shape
            residual = x.reshape(-1, dim)
            xq, xs = rmsnorm_fp8(residual, norm.weight, norm.eps, None)
        q, k, v = self.qkv(xq, xs).view(bsz, seqlen, -1).split(self.qkv_sizes, dim=-1)
        attended = self.attention.attend(q, k, v, rope, input_pos).reshape(bsz * seqlen, -1)
        attn_out = self.reduce(self.wo(*quantize_per_token(attended)))
        # residual + attention output; its norm, quantized, feeds the MLP.
        hq, hs, residual = add_rmsnorm_fp8(attn_out, residual, self.ffn_norm.weight, self.ffn_norm.eps, None)
        mlp_out = self.reduce(self.w2(*swiglu_fp8(self.w13(hq, hs), None)))
        return mlp_out.view(bsz, seqlen, dim), residual


@torch.no_grad()
def convert_block_to_fp8(
    model: Llama, index: int, reduce: Hook | None = None, channel_amax: Hook | None = None
) -> None:
    """Replace block `index` by its FP8 form, whose bf16 weights are then freed: a model materialised
    block by block (serve.py) is quantized as it goes, never holding more than one block in bf16."""
    model.layers[index] = Fp8Block(model.layers[index], reduce or _identity, channel_amax)


@torch.no_grad()
def convert_head_to_fp8(model: Llama, gather_logits: Hook | None = None) -> None:
    """The final norm and the output projection in FP8 (the embedding's weight when tied)."""
    model.norm = Fp8FinalNorm(model.norm)
    model.output = Fp8Linear(model.output.weight, gather_logits or _identity)


@torch.no_grad()
def convert_to_fp8(
    model: Llama,
    reduce: Hook | None = None,
    gather_logits: Hook | None = None,
    channel_amax: Hook | None = None,
) -> Llama:
    """Quantize the model's linear layers in place for FP8 decoding (the embedding stays bf16); the
    hooks are a tensor-parallel model's (module docstring)."""
    for index in range(len(model.layers)):
        convert_block_to_fp8(model, index, reduce, channel_amax)
    convert_head_to_fp8(model, gather_logits)
    if model.tok_embeddings.weight.is_cuda:
        torch.cuda.empty_cache()
    return model
