"""Ulysses context parallelism: attention over a sequence split across the `cp` ranks.

Each rank holds q, k, v for its S/W positions and all heads, [B, H, S/W, D]. One all-to-all turns
that into all S positions for H/W heads, [B, H/W, S, D]; any attention function runs unchanged on it
(every head sees the whole sequence); the inverse all-to-all brings the output back to
[B, H, S/W, D]. The backward of each all-to-all is the other one.

With grouped-query attention and fewer key/value heads than ranks, each key/value head is repeated so
that every rank receives the one head its query heads read.

The exchange is permute into a contiguous buffer, all-to-all, permute back. The all-to-all is the stock
`all_to_all_single` (gloo and NCCL alike) unless a comm path (parallel/comm.py, `parallel.comm`) is
given, whose `all_to_all` then runs it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.llama import AttentionFn
from parallel.comm import Comm


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup, comm: Comm | None) -> torch.Tensor:
    if comm is not None:
        return comm.all_to_all(send)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, comm: Comm | None = None) -> torch.Tensor:
    """[B, H, S/W, D] on each rank -> [B, H/W, S, D]: rank r gets heads [r*H/W, (r+1)*H/W)."""
    world = dist.get_world_size(group)
    bsz, heads, seq_local, dim = x.shape
    send = x.reshape(bsz, world, heads // world, seq_local, dim).transpose(0, 1).contiguous()
    recv = _all_to_all(send, group, comm)
    # recv[src] holds rank src's sequence chunk of our heads: chunks in rank order form the sequence.
    return recv.permute(1, 2, 0, 3, 4).reshape(bsz, heads // world, world * seq_local, dim)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, comm: Comm | None = None) -> torch.Tensor:
    """The inverse: [B, H/W, S, D] -> [B, H, S/W, D]."""
    world = dist.get_world_size(group)
    bsz, heads_local, seq, dim = x.shape
    send = x.reshape(bsz, heads_local, world, seq // world, dim).permute(2, 0, 1, 3, 4).contiguous()
    recv = _all_to_all(send, group, comm)
    # recv[src] holds our sequence chunk of rank src's heads: head groups in rank order.
    return recv.transpose(0, 1).reshape(bsz, world * heads_local, seq // world, dim)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, comm: Comm | None) -> torch.Tensor:
        ctx.group, ctx.comm = group, comm
        return seq_to_heads(x, group, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return heads_to_seq(grad.contiguous(), ctx.group, ctx.comm), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, comm: Comm | None) -> torch.Tensor:
        ctx.group, ctx.comm = group, comm
        return heads_to_seq(x, group, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return seq_to_heads(grad.contiguous(), ctx.group, ctx.comm), None, None


def check_ulysses_heads(n_heads: int, n_kv_heads: int, world: int) -> None:
    """Raise a one-line error when heads cannot be spread over `world` context-parallel ranks."""
    if n_heads % world != 0:
        raise ValueError(
            f"{n_heads} query heads (per tensor-parallel rank) are not divisible by parallel.cp={world}"
        )
    if n_kv_heads % world != 0 and world % n_kv_heads != 0:
        raise ValueError(
            f"{n_kv_heads} key/value heads (per tensor-parallel rank) neither divide nor are divisible by "
            f"parallel.cp={world}: choose another parallel.cp"
        )


def ulysses_attention(
    attention_fn: AttentionFn, group: dist.ProcessGroup, comm: Comm | None = None
) -> AttentionFn:
    """Wrap `attention_fn` (causal over [B, H, S, D]) into attention over a sequence sharded across
    `group`: q, k, v are the local [B, H, S/W, D] shards, in rank order along the sequence. `comm`:
    the comm path over `group` that runs the all-to-all (None: stock all_to_all_single)."""
    world = dist.get_world_size(group)

    def attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if mask is not None:
            raise ValueError(
                "Ulysses attention serves training (causal, no KV cache); decode with parallel.cp=1"
            )
        check_ulysses_heads(q.shape[1], k.shape[1], world)
        if k.shape[1] < world:
            repeats = world // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        q, k, v = (_SeqToHeads.apply(t, group, comm) for t in (q, k, v))
        return _HeadsToSeq.apply(attention_fn(q, k, v, None), group, comm)

    return attention
