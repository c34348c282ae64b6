"""The training loss, fused: mean cross-entropy of the logits [N, V] (or this rank's vocabulary shard
[N, V / tp] under tensor parallelism) in two Triton kernels that each read the logits once.

    loss = fused_cross_entropy(logits, targets, group, vocab_start)   # differentiable in logits

Forward: a program per row streams its logits once, keeping a running max and a running sum of
exp(x - max) in fp32 (the online softmax), and picks the target's logit where this rank's range holds
it. With a group (vocabulary-parallel), the ranks' rows combine through two all-reduces of [N]
vectors: the max, then the rescaled sums together with the picked logits. Backward: a program per
(row, block of the vocabulary) writes (exp(x - lse) - [j == target]) * grad / count in the logits'
dtype.

Why: the stock path (parallel/loss.py's vocab_parallel_cross_entropy, or F.cross_entropy of the logits
cast to fp32) makes fp32 copies of the whole logits (the cast, the shifted values, their exp), each
written and read again, forward and backward, and autograd keeps some for the backward. At Llama-3-8B
width, tp = 4 and 8192 tokens a rank's logits are 263M elements: a few GB of traffic a step, and GBs
held. Here the forward reads the bf16 logits once, the backward reads them once and writes the
gradient once, and only the logits, the [N] log-sum-exps and the targets are kept.

Targets equal to `ignore_index` count for nothing (as in F.cross_entropy). The reductions run in
fp32 and in a fixed order: the result is deterministic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels.launch import launch

BLOCK = 4096  # vocabulary entries a program handles at once
NUM_WARPS = 8


@triton.jit
def _cross_entropy_forward_kernel(
    logits_ptr, row_stride, targets_ptr, vocab_start, vocab, max_ptr, sum_ptr, picked_ptr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    target = tl.load(targets_ptr + row) - vocab_start
    mine = (target >= 0) & (target < vocab)
    picked = tl.load(base + target, mask=mine, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, running_max)
    tl.store(sum_ptr + row, running_sum)
    tl.store(picked_ptr + row, picked)


@triton.jit
def _cross_entropy_backward_kernel(
    logits_ptr,
    row_stride,
    grad_ptr,
    grad_stride,
    targets_ptr,
    vocab_start,
    vocab,
    lse_ptr,
    scale_ptr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    target = tl.load(targets_ptr + row) - vocab_start
    grad = (tl.exp(x - lse) - (cols == target).to(tl.float32)) * scale
    tl.store(grad_ptr + row * grad_stride + cols, grad.to(grad_ptr.dtype.element_ty), mask=inside)


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        ignore_index: int,
    ) -> torch.Tensor:
        rows, vocab = logits.shape
        stats = torch.empty(3, rows, dtype=torch.float32, device=logits.device)  # max, sum, picked
        if rows:
            launch(
                _cross_entropy_forward_kernel,
                (rows,),
                logits,
                logits.stride(0),
                targets,
                vocab_start,
                vocab,
                stats[0],
                stats[1],
                stats[2],
                BLOCK=BLOCK,
                num_warps=NUM_WARPS,
            )
        row_max, sums = stats[0], stats[1:]  # (sums: the exp sums and the picked logits, reduced together)
        if group is not None:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            sums[0] *= torch.exp(row_max - global_max)
            dist.all_reduce(sums, group=group)
            row_max = global_max
        lse = row_max + sums[0].log()
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(logits, targets, lse, valid, count)
        ctx.vocab_start = vocab_start
        loss = ((lse - sums[1]) * valid).sum() / count
        # A target outside the vocabulary (and not ignore_index) would count as a logit of 0 and give a
        # plausible loss: NaN instead, without a host sync (F.cross_entropy raises). Shards are equal.
        vocab_total = vocab * (dist.get_world_size(group) if group is not None else 1)
        outside = valid & ((targets < 0) | (targets >= vocab_total))
        return torch.where(outside.any(), torch.nan, loss)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, targets, lse, valid, count = ctx.saved_tensors
        rows, vocab = logits.shape
        scale = (grad_loss * valid / count).float()
        grad = torch.empty_like(logits)
        if rows:
            launch(
                _cross_entropy_backward_kernel,
                (rows, triton.cdiv(vocab, BLOCK)),
                logits,
                logits.stride(0),
                grad,
                grad.stride(0),
                targets,
                ctx.vocab_start,
                vocab,
                lse,
                scale,
                BLOCK=BLOCK,
                num_warps=NUM_WARPS,
            )
        return grad, None, None, None, None


def fused_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of `targets` [...] (ids of the whole vocabulary) under `logits` [..., V]: the
    whole vocabulary, or with `group` this rank's shard [vocab_start, vocab_start + V) of a vocabulary
    split over the group's ranks (every rank then gets the same loss, and its shard's gradient)."""
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class ids, got {targets.dtype}")
    # Checked before flattening: targets of the right count in another layout (transposed [T, B]
    # for logits [B, T, V]) would otherwise pair each row with another position's target.
    if logits.dim() == 0:
        raise ValueError("logits must have a last (vocabulary) dim, got a 0-dim tensor")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have the shape of logits without its last (vocabulary) dim, "
            f"{tuple(logits.shape[:-1])}; got targets {tuple(targets.shape)} for logits {tuple(logits.shape)}"
        )
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.reshape(-1).contiguous()
    return _FusedCrossEntropy.apply(logits, targets, group, vocab_start, ignore_index)
