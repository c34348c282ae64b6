"""Ulysses context parallelism: attention over a sequence split across the `cp` ranks.

Each rank holds q, k, v for its S/W positions and all heads, [B, H, S/W, D]. One all-to-all turns
that into all S positions for H/W heads, [B, H/W, S, D]; any attention function runs unchanged on it
(every head sees the whole sequence); the inverse all-to-all brings the output back to
[B, H, S/W, D]. The backward of each all-to-all is the other one.

With grouped-query attention and fewer key/value heads than ranks, each key/value head is replicated
by the exchange itself (`seq_to_heads` gives every rank the one head its query heads read), so the
gradient of such a head is the sum over its replicas.

The exchanges are the comm path's `seq_to_heads` / `heads_to_seq` (parallel/comm.py, `parallel.comm`:
the stock permute + `all_to_all_single` + permute, or weft's kernel in kernels/all_to_all.py that
writes every tile straight to its final place); q, k and v travel in one call. Without a comm path
the stock exchange runs (gloo and NCCL alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from model.llama import AttentionFn
from parallel.comm import Comm

# The comm ops Ulysses calls (for Comm.require / check_ops).
ULYSSES_OPS = ("seq_to_heads", "heads_to_seq")


def seq_to_heads(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup, comm: Comm | None = None
) -> list[torch.Tensor]:
    """Each [B, H, S/W, D] -> [B, max(H, W)/W, S, D]: rank r gets heads [r*H/W, (r+1)*H/W)."""
    if comm is not None:
        return comm.seq_to_heads(xs)
    from kernels.all_to_all import seq_to_heads_reference

    return seq_to_heads_reference(xs, group)


def heads_to_seq(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup, comm: Comm | None = None
) -> list[torch.Tensor]:
    """The inverse: each [B, H/W, S, D] -> [B, H, S/W, D]."""
    if comm is not None:
        return comm.heads_to_seq(xs)
    from kernels.all_to_all import heads_to_seq_reference

    return heads_to_seq_reference(xs, group)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, group: dist.ProcessGroup, comm: Comm | None, *xs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.comm = group, comm
        ctx.heads = [x.shape[1] for x in xs]
        return tuple(seq_to_heads(xs, group, comm))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = heads_to_seq(grads, ctx.group, ctx.comm)
        # A head replicated to several ranks gets the sum of its replicas' gradients.
        back = [
            g if g.shape[1] == heads else g.unflatten(1, (heads, -1)).sum(2)
            for g, heads in zip(back, ctx.heads, strict=True)
        ]
        return None, None, *back


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, comm: Comm | None, x: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.comm = group, comm
        return heads_to_seq([x], group, comm)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        return None, None, seq_to_heads([grad], ctx.group, ctx.comm)[0]


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
    the comm path over `group` that runs the exchanges (None: the stock path)."""
    world = dist.get_world_size(group)

    def attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if mask is not None:
            raise ValueError(
                "Ulysses attention serves training (causal, no KV cache); decode with parallel.cp=1"
            )
        check_ulysses_heads(q.shape[1], k.shape[1], world)
        q, k, v = _SeqToHeads.apply(group, comm, q, k, v)
        return _HeadsToSeq.apply(group, comm, attention_fn(q, k, v, None))

    return attention
