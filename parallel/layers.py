"""Tensor-parallel layers with sequence parallelism, on the comm dispatch (parallel/comm.py).

Layout. Activations are [B, S, D], the model's own layout; the sequence dimension is 1 (SEQ_DIM), so
for B > 1 a gathered or scattered chunk is strided (the torch path permutes around its collective, the
fused symm_mem ops copy once into their preferred order; at B = 1, the long-sequence case, neither
does). With sequence parallelism (training) the residual stream between blocks is sharded on the
sequence: each tp rank holds [B, S/tp, D] and the norms run on that shard. A column-parallel group
(QKV, W1|W3, the output projection) all-gathers the shard and multiplies by its slice of the output
features; a row-parallel linear (Wo, W2) multiplies its slice of the input features and
reduce-scatters the partial sums back onto the sequence shards. Without sequence parallelism (decode)
activations are replicated, column layers need no communication and row layers all-reduce.

Autograd mirrors each op:
  AG-matmul  forward  y_i = AG(x) @ W_i^T
             backward dx = matmul-RS(cat(dy_i), cat(W_i))   dW_i = dy_i^T @ AG(x)
  matmul-RS  forward  y = RS(x @ W^T)
             backward (AG(dy), dx) = AG-matmul(dy, W)       dW = AG(dy)^T @ x
For AG-matmul's weight gradient the gathered input is SAVED from the forward by default
(`save_gathered=True`: one [B, S, D] activation per column group per block); with
`save_gathered=False` only the shard is kept and the backward re-gathers it (tp times less activation
memory for one more all-gather per group). matmul-RS saves its (local, ungathered) input and
obtains AG(dy) from the AG-matmul of its input gradient, so it never gathers twice.

Under autocast the inputs and weights are cast to the autocast dtype before the communication (the
collectives then move bf16, not fp32) and the ops run as their own dtype; the casts' own backward
returns fp32 weight gradients, as nn.Linear under autocast does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.llama import RMSNorm
from parallel.comm import Comm

SEQ_DIM = 1


@dataclass
class TPContext:
    """What every tensor-parallel layer of one model shares."""

    comm: Comm
    # Shard activations between blocks on the sequence (training). False: replicated (decode).
    sequence_parallel: bool = True
    # AG-matmul keeps its gathered input for the weight gradient (True) or re-gathers it (False).
    save_gathered: bool = True

    @property
    def size(self) -> int:
        return self.comm.world

    @property
    def rank(self) -> int:
        return self.comm.rank


def _autocast(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Cast to the active autocast dtype (if any) of the tensors' device."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return list(tensors)
    dtype = torch.get_autocast_dtype(device)
    return [t.to(dtype) for t in tensors]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class AllGatherMatmul(torch.autograd.Function):
    """(x_shard, W_0, W_1, ...) -> (AG(x) @ W_0^T, AG(x) @ W_1^T, ...): one gather feeds all weights."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, dim: int, save_gathered: bool, *weights: torch.Tensor):
        gathered, outs = comm.all_gather_matmul(x, [w.t() for w in weights], dim)
        ctx.comm, ctx.dim, ctx.save_gathered = comm, dim, save_gathered
        ctx.splits = [w.shape[0] for w in weights]
        ctx.save_for_backward(gathered if save_gathered else x, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        saved, *weights = ctx.saved_tensors
        comm, dim = ctx.comm, ctx.dim
        grads = [g.to(w.dtype).contiguous() for g, w in zip(grads, weights, strict=True)]
        grad_cat = grads[0] if len(grads) == 1 else torch.cat(grads, dim=-1)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # Input gradient: the mirror matmul-RS, one matmul over the concatenated weights.
            weight_cat = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
            grad_x = comm.matmul_reduce_scatter(grad_cat, weight_cat, dim)
        # Weight gradients read the gathered input: saved, or gathered again here.
        gathered = saved if ctx.save_gathered else comm.all_gather(saved, dim)
        a = _flat(gathered)
        grad_ws = [
            _flat(g).t() @ a if needs else None
            for g, needs in zip(grads, ctx.needs_input_grad[4:], strict=True)
        ]
        return (grad_x, None, None, None, *grad_ws)


class MatmulReduceScatter(torch.autograd.Function):
    """(x, W) -> RS(x @ W^T) on `dim`: partial sums of a row-parallel linear, scattered on the sequence."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        ctx.save_for_backward(x, weight)
        return comm.matmul_reduce_scatter(x, weight.t(), dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        # Input gradient: the mirror AG-matmul, whose gathered gradient also feeds the weight gradient.
        grad = grad.to(weight.dtype).contiguous()  # the fused kernels need one dtype for both operands
        grad_full, (grad_x,) = ctx.comm.all_gather_matmul(grad, [weight], ctx.dim)
        grad_w = _flat(grad_full).t() @ _flat(x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_reduce_forward(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum over the group forward, identity backward (row-parallel output without SP). Without
    autograd (decode) it is the registered op, so a compiled decode step keeps one graph."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _AllReduceForward.apply(x, comm)
    return torch.ops.weft.tp_all_reduce(x, comm.group_name)


class AllReduceBackward(torch.autograd.Function):
    """Identity forward, sum of the gradients over the group backward: a tensor used by every rank on
    different data (a replicated input to column-parallel layers, a sequence-parallel norm weight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_reduce(grad.contiguous()), None


class ReduceScatter(torch.autograd.Function):
    """Sum over the group and keep this rank's chunk of `dim`; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return comm.reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_gather(grad.contiguous(), ctx.dim), None, None


class AllGather(torch.autograd.Function):
    """Concatenate the ranks' chunks along `dim`; backward keeps this rank's chunk of the gradient
    (every rank computes the same loss from the gathered tensor, so no sum is needed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.size = comm, dim, x.shape[dim]
        return comm.all_gather(x, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.comm.rank * ctx.size
        return grad.narrow(ctx.dim, start, ctx.size), None, None


def column_parallel(x: torch.Tensor, weights: Sequence[torch.Tensor], ctx: TPContext) -> list[torch.Tensor]:
    """x @ W_i^T for column-parallel weights W_i [N_i / tp, K] fed by one input: with SP, x is the
    sequence shard and one all-gather feeds every weight; without, x is replicated."""
    x, *weights = _autocast(x, *weights)
    if ctx.sequence_parallel:
        return list(AllGatherMatmul.apply(x, ctx.comm, SEQ_DIM, ctx.save_gathered, *weights))
    x = AllReduceBackward.apply(x, ctx.comm) if torch.is_grad_enabled() else x
    return [F.linear(x, w) for w in weights]


class ColumnParallelLinear(nn.Module):
    """The rows [rank * N / tp, (rank + 1) * N / tp) of a linear's weight [N, K]; output features split."""

    def __init__(self, weight: nn.Parameter, ctx: TPContext) -> None:
        super().__init__()
        self.weight = weight
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel(x, [self.weight], self.ctx)[0]


class RowParallelLinear(nn.Module):
    """The columns [rank * K / tp, (rank + 1) * K / tp) of a linear's weight [N, K]; input features split,
    partial sums reduce-scattered onto the sequence shards (SP) or all-reduced (no SP)."""

    def __init__(self, weight: nn.Parameter, ctx: TPContext) -> None:
        super().__init__()
        self.weight = weight
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight = _autocast(x, self.weight)
        if self.ctx.sequence_parallel:
            return MatmulReduceScatter.apply(x, weight, self.ctx.comm, SEQ_DIM)
        return all_reduce_forward(F.linear(x, weight), self.ctx.comm)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V / tp) of the embedding table. Each rank looks up the tokens of its vocabulary
    range (zero elsewhere); the partial embeddings are reduce-scattered onto the sequence shards (SP)
    or all-reduced."""

    def __init__(self, weight: nn.Parameter, ctx: TPContext) -> None:
        super().__init__()
        self.weight = weight
        self.ctx = ctx
        self.vocab_start = ctx.rank * weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.ctx.sequence_parallel:
            return ReduceScatter.apply(out, self.ctx.comm, SEQ_DIM)
        return all_reduce_forward(out, self.ctx.comm)


class VocabParallelOutput(nn.Module):
    """The output projection with the vocabulary split: logits [B, S, V / tp] for the vocabulary range of
    this rank (`gather_output=False`, the input of parallel/loss.py's cross-entropy) or all-gathered to
    [B, S, V] (`gather_output=True`, decode: sampling needs every logit)."""

    def __init__(self, weight: nn.Parameter, ctx: TPContext, gather_output: bool) -> None:
        super().__init__()
        self.weight = weight
        self.ctx = ctx
        self.gather_output = gather_output
        self.vocab_start = ctx.rank * weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = column_parallel(x, [self.weight], self.ctx)[0]
        if self.gather_output:
            if torch.is_grad_enabled() and logits.requires_grad:
                logits = AllGather.apply(logits, self.ctx.comm, -1)
            else:  # decode: the registered op (one graph under torch.compile)
                logits = torch.ops.weft.tp_all_gather(logits, logits.dim() - 1, self.ctx.comm.group_name)
        return logits


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm over a sequence shard: the same weight on every tp rank sees different tokens, so its
    gradient is summed over the tp group."""

    def __init__(self, norm: RMSNorm, ctx: TPContext) -> None:
        nn.Module.__init__(self)
        self.eps = norm.eps
        self.weight = norm.weight
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * AllReduceBackward.apply(self.weight, self.ctx.comm)


class ParallelFeedForward(nn.Module):
    """SwiGLU with W1 | W3 column-parallel (one gather feeding both) and W2 row-parallel."""

    def __init__(self, w1: ColumnParallelLinear, w2: RowParallelLinear, w3: ColumnParallelLinear) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = w1, w2, w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1, h3 = column_parallel(x, [self.w1.weight, self.w3.weight], self.w1.ctx)
        return self.w2(F.silu(h1) * h3)


class ParallelQKV:
    """Attention.project_qkv for column-parallel wq, wk, wv: one gather feeding the three weights."""

    def __init__(self, attention: nn.Module, ctx: TPContext) -> None:
        self.attention = attention
        self.ctx = ctx

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.attention
        q, k, v = column_parallel(x, [a.wq.weight, a.wk.weight, a.wv.weight], self.ctx)
        return q, k, v
