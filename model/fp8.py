"""FP8 decode (`model.fp8=true`): the plain model's linear weights quantized to e4m3 with one scale
per output channel, and each block run on weft's fused FP8 kernels (model/decode.py's structure):

    (previous MLP output, residual) -> residual add + RMSNorm + quantize -> [wq|wk|wv] FP8 GEMM
      -> attention + quantize -> wo FP8 GEMM -> residual add + RMSNorm + quantize -> [w1|w3] FP8 GEMM
      -> SwiGLU + quantize -> w2 FP8 GEMM -> (MLP output, residual) to the next block

and after the last block: residual add + RMSNorm + quantize -> output FP8 GEMM -> logits.

Activations get one scale per token, computed inside the norm and SwiGLU kernels; the attention output
one per token and kv head, computed inside the decode attention kernel (the FP8 GEMM scales each kv
head's slice of K by its own). The projections that read the same input are fused into one weight, so
each reads its input once and launches once.

serve.py quantizes each block as soon as it has its weights (model/decode.py's `convert_block`, parallel/'s
`materialize` calling it block by block), so that the model never exists whole in bf16: Llama-3-70B in
FP8 (about 70 GB) builds and runs on one H200, whose memory its 141 GB of bf16 weights all but fill.

A tensor-parallel model converts the same way, given parallel/'s `fp8_decode_hooks`: model/decode.py's
`reduce` and `gather_logits`, and `channel_amax`, which takes the largest magnitude of each output
channel over the row-parallel shards, so that they carry the scales (and e4m3 values) of the unsplit
weights.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8 import FP8, quantize_weight_per_channel
from kernels.fp8_gemm import fp8_gemm, fp8_gemm_partials, partial_count
from kernels.fp8_norm import add_rmsnorm_fp8, rmsnorm_fp8
from kernels.fp8_swiglu import swiglu_fp8
from model.decode import Hook, convert_for_decode, identity
from model.llama import Attention, Llama


def check_fp8_device(device: torch.device) -> None:
    """FP8 tensor-core kernels need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper)."""
    if device.type != "cuda":
        raise ValueError("model.fp8=true runs on CUDA GPUs only: use model.fp8=false on the CPU")
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores: use model.fp8=false")


# An activation in FP8: e4m3 [..., K] and its fp32 scales, one per token (the decode attention's
# output: one per token and kv head).
Fp8Activation = tuple[torch.Tensor, torch.Tensor]

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

    def __init__(self, *weights: torch.Tensor, full_amax: Hook | None = None, partials: bool = False) -> None:
        super().__init__()
        self.partials = partials  # model/decode.py's DecodeKernels.weight
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

    def forward(self, x: Fp8Activation) -> torch.Tensor:
        q, scale = x
        rows = q.reshape(-1, q.shape[-1])
        if self.partials:
            out = fp8_gemm_partials(
                rows, scale, self.weight, self.scale, partial_count(rows, scale, self.weight)
            )
            return out.view(out.shape[0], *q.shape[:-1], -1)
        return fp8_gemm(rows, scale, self.weight, self.scale).view(*q.shape[:-1], -1)


class Fp8Kernels:
    """The FP8 decode path's kernels (model/decode.py's DecodeKernels): activations quantized per token
    inside the norm and SwiGLU kernels, weights per output channel (`channel_amax`: the row-parallel
    shards' hook, module docstring)."""

    def __init__(self, channel_amax: Hook | None = None) -> None:
        self.channel_amax = channel_amax

    def weight(self, *weights: torch.Tensor, row_parallel: bool = False, partials: bool = False) -> Fp8Weight:
        return Fp8Weight(*weights, full_amax=self.channel_amax if row_parallel else None, partials=partials)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Activation:
        return rmsnorm_fp8(x, weight, eps, None)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[Fp8Activation, torch.Tensor]:
        q, scale, residual = add_rmsnorm_fp8(x, residual, weight, eps, None)
        return (q, scale), residual

    def swiglu(self, gate_up: torch.Tensor) -> Fp8Activation:
        return swiglu_fp8(gate_up, None)

    def attend(
        self,
        attention: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: torch.Tensor,
        input_pos: torch.Tensor | None,
    ) -> Fp8Activation:
        # Quantized per token and kv head at decode, by the attention kernel itself
        # (kernels/decode_attention.py); per token otherwise.
        return attention.attend(q, k, v, rope, input_pos, fp8_output=True)


def convert_to_fp8(
    model: Llama,
    reduce: Hook = identity,
    gather_logits: Hook = identity,
    channel_amax: Hook | None = None,
) -> Llama:
    """Quantize the model's linear layers in place for FP8 decoding (the embedding stays bf16); the
    hooks are a tensor-parallel model's (module docstring)."""
    return convert_for_decode(model, Fp8Kernels(channel_amax), reduce, gather_logits)
