"""Cross-entropy over vocabulary-sharded logits: no rank ever holds the full-vocabulary logits.

Each tp rank holds logits [N, V / tp] for its vocabulary range [start, start + V / tp). The log-sum-exp
is assembled from a max (all-reduce MAX, no gradient: it only shifts for stability) and a sum of
exponentials (all-reduce SUM); the target's logit comes from the one rank whose range holds it
(all-reduce SUM of a masked pick). Every rank then holds the same loss. The all-reduces have an
identity backward: every rank differentiates the same loss, so the gradient reaching each rank's sum
is already the gradient of the total (Megatron's vocab-parallel cross-entropy, in autograd form).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.layers import VocabParallelOutput


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup,
    vocab_start: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of `targets` [...] under vocabulary-sharded `logits` [..., V / tp] (fp32 math);
    targets equal to `ignore_index` are left out of the mean."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    targets = targets.reshape(-1)
    with torch.no_grad():
        shift = logits.max(dim=-1).values
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - shift.unsqueeze(-1)
    sum_exp = _AllReduceSum.apply(shifted.exp().sum(dim=-1), group)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _AllReduceSum.apply(picked * mine, group)
    per_token = sum_exp.log() - target_logit
    valid = targets != ignore_index
    return (per_token * valid).sum() / valid.sum().clamp(min=1)


def cross_entropy(model: torch.nn.Module, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The model's training loss: vocab-parallel when its output projection leaves logits sharded,
    else the plain cross-entropy, in fp32. On GPUs weft's fused kernels (kernels/cross_entropy.py)
    compute it, reading the logits once each way; elsewhere the stock ops."""
    output = getattr(model, "output", None)
    sharded = isinstance(output, VocabParallelOutput) and not output.gather_output
    group, vocab_start = (output.ctx.comm.group, output.vocab_start) if sharded else (None, 0)
    if logits.is_cuda:
        from kernels.cross_entropy import fused_cross_entropy  # (Triton, loaded on GPUs only)

        return fused_cross_entropy(logits, targets, group, vocab_start)
    if sharded:
        return vocab_parallel_cross_entropy(logits, targets, group, vocab_start)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
