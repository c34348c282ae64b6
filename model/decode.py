"""Decode on weft's kernels (serve.py): each block's projections that read the same input fused into one
weight, every linear layer on weft's skinny GEMM (kernels/fp8_gemm.py) at decode batch sizes, and the
glue between them in fused kernels:

    (previous MLP output, residual) -> residual add + RMSNorm -> [wq|wk|wv] GEMM -> attention
      -> wo GEMM -> residual add + RMSNorm -> [w1|w3] GEMM -> SwiGLU -> w2 GEMM
      -> (MLP output, residual) to the next block

and after the last block: residual add + RMSNorm -> output GEMM -> logits. wo and w2 hand the add +
RMSNorm after them their split-K partials, which it sums (kernels.fp8_gemm.fp8_gemm_partials), unless
tensor parallelism sums their outputs over the ranks in between.

The structure is the same in bf16 (`model.decode_kernels`, Bf16Kernels here) and in FP8 (`model.fp8`,
model/fp8.py's Fp8Kernels). What differs is the form activations travel in between the kernels, bf16
tensors or e4m3 values with one scale per token (per token and kv head out of the attention), quantized
inside the norm, SwiGLU and attention kernels, and the GEMM the weights run on: a DecodeKernels object
names those kernels and builds the weights.

A tensor-parallel model (parallel/ planned it; each rank holds its shards) converts the same way, given
hooks from parallel/ (`decode_hooks`): `reduce` sums the partial outputs of the row-parallel wo and w2 over
the ranks, and `gather_logits` joins the vocabulary shards of the output projection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from kernels.fp8_gemm import bf16_gemm, bf16_gemm_partials, partial_count
from kernels.fp8_norm import add_rmsnorm, rmsnorm
from kernels.fp8_swiglu import swiglu
from model.args import ModelArgs
from model.llama import Attention, Llama, RMSNorm, TransformerBlock

Hook = Callable[[torch.Tensor], torch.Tensor]
# An activation between the kernels: bf16 [..., K], or e4m3 [..., K] with fp32 scales, one per token (the
# decode attention's output: one per token and kv head).
Activation = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
# Between blocks the residual stream travels as (pending [B, S, dim], residual [B * S, dim]): the last
# block's MLP output has not been added yet, so that the next fused add + RMSNorm kernel does the add
# (one launch less per layer than adding it here). Without tensor parallelism `pending` is the w2 GEMM's
# split-K partials [slices, B, S, dim] in fp32, which that kernel sums (kernels.fp8_gemm.fp8_gemm_partials).
ResidualStream = tuple[torch.Tensor, torch.Tensor]


def identity(x: torch.Tensor) -> torch.Tensor:
    """The hooks' default: a model without tensor parallelism has nothing to reduce or gather."""
    return x


class DecodeKernels(Protocol):
    """The kernels of one decode path, by the form of its activations."""

    def weight(self, *weights: torch.Tensor, row_parallel: bool = False, partials: bool = False) -> nn.Module:
        """Linear weights [N_i, K] fused into one module: Activation [..., K] -> bf16 [..., sum N_i].
        `row_parallel`: the weights are shards of K (tensor parallelism). `partials`: the output is the
        GEMM's fp32 split-K partials [slices, ..., N] for `add_norm` to sum."""
        ...

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Activation:
        """RMSNorm(x) * weight of bf16 rows."""
        ...

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[Activation, torch.Tensor]:
        """(RMSNorm(residual + x) * weight, residual + x) in one kernel; x [rows, dim] in bf16, or a
        weight's split-K partials [slices, rows, dim]."""
        ...

    def swiglu(self, gate_up: torch.Tensor) -> Activation:
        """silu(gate) * up of bf16 rows [gate | up]."""
        ...

    def attend(
        self,
        attention: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: torch.Tensor,
        input_pos: torch.Tensor | None,
    ) -> Activation:
        """`attention.attend` of projected q, k, v [B, S, heads * D], its output [B, S, K] in the form
        the output projection takes."""
        ...


class Bf16Weight(nn.Module):
    """One or more linear weights [N_i, K] as one bf16 [sum N_i, K] (a single weight is kept, not copied:
    a tied output projection stays the embedding's parameter); `partials` as DecodeKernels.weight."""

    def __init__(self, *weights: torch.Tensor, partials: bool = False) -> None:
        super().__init__()
        if len(weights) == 1:
            self.weight = weights[0]
        else:
            self.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=False)
        self.partials = partials

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.partials:
            out = bf16_gemm_partials(rows, self.weight, partial_count(rows, None, self.weight))
            return out.view(out.shape[0], *x.shape[:-1], -1)
        return bf16_gemm(rows, self.weight).view(*x.shape[:-1], -1)


class Bf16Kernels:
    """The bf16 decode path's kernels (DecodeKernels): activations stay bf16 tensors."""

    def weight(
        self, *weights: torch.Tensor, row_parallel: bool = False, partials: bool = False
    ) -> Bf16Weight:
        return Bf16Weight(*weights, partials=partials)  # a shard of K needs nothing of its own in bf16

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm(x, weight, eps)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rmsnorm(x, residual, weight, eps)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate_up)

    def attend(
        self,
        attention: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: torch.Tensor,
        input_pos: torch.Tensor | None,
    ) -> torch.Tensor:
        return attention.attend(q, k, v, rope, input_pos)


def runs_bf16_decode_kernels(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether serve.py decodes on Bf16Kernels: `model.decode_kernels` on a bf16 model (not FP8) on a
    CUDA GPU with bf16 tensor cores (compute capability 8.0+). Elsewhere the stock modules run."""
    return (
        args.decode_kernels
        and not args.fp8
        and dtype == torch.bfloat16
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


class DecodeBlock(nn.Module):
    """A TransformerBlock on a decode path's kernels (module docstring)."""

    def __init__(self, block: TransformerBlock, kernels: DecodeKernels, reduce: Hook = identity) -> None:
        super().__init__()
        self.kernels = kernels
        # Sums the outputs of wo and w2 over the ranks when they are row-parallel shards.
        self.reduce = reduce
        attn, ffn = block.attention, block.feed_forward
        self.attention = attn  # rotary embeddings, KV cache and attention function stay as they are
        self.qkv = kernels.weight(attn.wq.weight, attn.wk.weight, attn.wv.weight)
        self.qkv_sizes = [attn.wq.weight.shape[0], attn.wk.weight.shape[0], attn.wv.weight.shape[0]]
        # wo's and w2's outputs go straight into an add + RMSNorm kernel, unless summed over the ranks
        # first: there they stay split-K partials, which that kernel sums as it loads them. One H200,
        # Llama-3-8B, eager CUDA graphs, two alternating rounds: bf16 4.139 / 4.496 -> 4.117 / 4.479 ms
        # a step at batch 1 / 8, FP8 2.440 / 2.754 -> 2.418 / 2.743.
        partials = reduce is identity
        self.wo = kernels.weight(attn.wo.weight, row_parallel=True, partials=partials)
        self.w13 = kernels.weight(ffn.w1.weight, ffn.w3.weight)
        self.w2 = kernels.weight(ffn.w2.weight, row_parallel=True, partials=partials)
        self.attention_norm, self.ffn_norm = block.attention_norm, block.ffn_norm
        del attn.wq, attn.wk, attn.wv, attn.wo  # the unfused weights are no longer needed

    def forward(
        self, x: torch.Tensor | ResidualStream, rope: torch.Tensor, input_pos: torch.Tensor | None = None
    ) -> ResidualStream:
        """The residual stream after this block, its MLP output still pending (ResidualStream); `x`
        is the embedding output for the first block, the previous block's stream after that."""
        kernels, norm = self.kernels, self.attention_norm
        if isinstance(x, tuple):
            pending, residual = x
            bsz, seqlen, dim = pending.shape[-3:]
            # residual + the previous block's MLP output, and its norm, in one kernel.
            h, residual = kernels.add_norm(rows_of(pending), residual, norm.weight, norm.eps)
        else:
            bsz, seqlen, dim = x.shape
            residual = x.reshape(-1, dim)
            h = kernels.norm(residual, norm.weight, norm.eps)
        q, k, v = self.qkv(h).view(bsz, seqlen, -1).split(self.qkv_sizes, dim=-1)
        attended = kernels.attend(self.attention, q, k, v, rope, input_pos)
        attn_out = self.reduce(rows_of(self.wo(attended)))
        # residual + attention output; its norm feeds the MLP.
        h, residual = kernels.add_norm(attn_out, residual, self.ffn_norm.weight, self.ffn_norm.eps)
        mlp_out = self.reduce(self.w2(kernels.swiglu(self.w13(h))))
        return mlp_out.unflatten(-2, (bsz, seqlen)), residual


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """[B, S, N] as [B * S, N]; split-K partials [slices, B, S, N] as [slices, B * S, N]."""
    return x.flatten(-3, -2)


class DecodeFinalNorm(nn.Module):
    """The final RMSNorm of the last block's residual stream: the pending add and the norm in one
    kernel, its output in the kernels' form for the output projection."""

    def __init__(self, norm: RMSNorm, kernels: DecodeKernels) -> None:
        super().__init__()
        self.weight, self.eps, self.kernels = norm.weight, norm.eps, kernels

    def forward(self, x: ResidualStream) -> Activation:
        pending, residual = x
        h, _ = self.kernels.add_norm(rows_of(pending), residual, self.weight, self.eps)
        # Values as [B, S, dim], so that the logits come out [B, S, vocab] (scales stay one per token).
        shape = pending.shape[-3:]
        return (h[0].view(shape), h[1]) if isinstance(h, tuple) else h.view(shape)


class DecodeLinear(nn.Module):
    """A bias-free linear layer on a decode path's GEMM; `after` is applied to its output (the gather of
    vocabulary shards under tensor parallelism)."""

    def __init__(self, weight: torch.Tensor, kernels: DecodeKernels, after: Hook = identity) -> None:
        super().__init__()
        self.proj = kernels.weight(weight)
        self.after = after

    def forward(self, x: Activation) -> torch.Tensor:
        return self.after(self.proj(x))


@torch.no_grad()
def convert_block(model: Llama, index: int, kernels: DecodeKernels, reduce: Hook = identity) -> None:
    """Replace block `index` by its DecodeBlock on `kernels` (its unfused weights are then freed)."""
    model.layers[index] = DecodeBlock(model.layers[index], kernels, reduce)


@torch.no_grad()
def convert_head(model: Llama, kernels: DecodeKernels, gather_logits: Hook = identity) -> None:
    """The final norm and the output projection on `kernels` (the embedding's weight when tied)."""
    model.norm = DecodeFinalNorm(model.norm, kernels)
    model.output = DecodeLinear(model.output.weight, kernels, gather_logits)


@torch.no_grad()
def convert_for_decode(
    model: Llama, kernels: DecodeKernels, reduce: Hook = identity, gather_logits: Hook = identity
) -> Llama:
    """Run the model's blocks, final norm and output projection on `kernels` (in place; the embedding
    stays as it is); the hooks are a tensor-parallel model's (module docstring). The model serves
    inference only from then on: weft's kernels have no backward."""
    model.requires_grad_(False)
    for index in range(len(model.layers)):
        convert_block(model, index, kernels, reduce)
    convert_head(model, kernels, gather_logits)
    if model.tok_embeddings.weight.is_cuda:
        torch.cuda.empty_cache()
    return model
