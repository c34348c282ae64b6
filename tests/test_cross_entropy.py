"""The fused cross-entropy (kernels/cross_entropy.py) against the stock loss: F.cross_entropy of the fp32
logits, and the vocabulary-parallel loss over ranks each holding a shard. Fresh random inputs, ragged
vocabularies (not multiples of the kernel's block), ignored targets, poisoned gradients; the loss and
the logits' gradient compared by relative error. On CPU through Triton's interpreter, on a GPU natively."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.cross_entropy import BLOCK, fused_cross_entropy
from tests.multiprocess import run_ranks
from tests.test_fp8_kernels import poisoned, rel_err  # noqa: F401 (poisoned is a fixture)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=generator)).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[4::5] = -100  # ignored
    return logits.to(DEVICE), targets.to(DEVICE)


def reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.detach().requires_grad_()
    loss = F.cross_entropy(logits.float(), targets)
    loss.backward()
    return loss.detach(), logits.grad


def fused(logits: torch.Tensor, targets: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.detach().requires_grad_()
    loss = fused_cross_entropy(logits, targets, **kwargs)
    (2 * loss).backward()  # a gradient other than 1 reaches the kernel
    return loss.detach(), logits.grad / 2


@pytest.mark.parametrize(("rows", "vocab"), [(1, 7), (6, 258), (11, BLOCK + 133)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("poisoned")
def test_fused_loss_and_gradient(rows: int, vocab: int, dtype: torch.dtype) -> None:
    logits, targets = case(rows, vocab, dtype, seed=rows * vocab)
    loss, grad = fused(logits, targets)
    ref_loss, ref_grad = reference(logits, targets)
    assert grad.dtype == dtype
    assert rel_err(loss, ref_loss) < 1e-6
    assert rel_err(grad, ref_grad) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_a_target_outside_the_vocabulary_gives_nan() -> None:
    """A target outside [0, V) that is not ignore_index (padding as -1, an id off by one) would count as
    a logit of 0 and give a plausible loss: it gives NaN instead (F.cross_entropy raises), so training
    stops on it. Float targets are refused."""
    logits, targets = case(4, 50, torch.float32, seed=2)
    for bad in (-1, 50):
        wrong = targets.clone()
        wrong[1] = bad
        assert fused(logits, wrong)[0].isnan()
    assert not fused(logits, targets)[0].isnan()
    with pytest.raises(ValueError, match=r"targets must be integer class ids, got torch\.float32"):
        fused_cross_entropy(logits, targets.float())


def test_targets_of_another_shape_are_refused() -> None:
    """Targets are checked against logits[..., V] before either is flattened: transposed targets
    [T, B] for logits [B, T, V] hold the right number of ids but would pair each logit row with another
    position's target, a plausible wrong loss."""
    logits = torch.randn(2, 3, 50, device=DEVICE)
    targets = torch.randint(0, 50, (2, 3), device=DEVICE)
    for wrong in (targets.t().contiguous(), targets.reshape(-1)):
        message = f"got targets {tuple(wrong.shape)} for logits (2, 3, 50)"
        with pytest.raises(ValueError, match=re.escape(message)):
            fused_cross_entropy(logits, wrong)
    flat = fused_cross_entropy(logits.reshape(6, 50), targets.reshape(-1))
    assert rel_err(fused_cross_entropy(logits, targets), flat) == 0


def test_every_target_ignored_gives_zero() -> None:
    """As the vocabulary-parallel loss gives (F.cross_entropy gives NaN: a mean over no tokens)."""
    logits, targets = case(3, 40, torch.float32, seed=1)
    loss, grad = fused(logits, torch.full_like(targets, -100))
    assert loss.item() == 0 and not grad.any()


def _vocab_parallel(rank: int, world: int, vocab: int) -> None:
    logits, targets = case(9, vocab, torch.float32, seed=vocab)  # the same on every rank
    shard = vocab // world
    mine = logits[:, rank * shard : (rank + 1) * shard]
    loss, grad = fused(mine, targets, group=dist.group.WORLD, vocab_start=rank * shard)
    ref_loss, ref_grad = reference(logits, targets)
    assert rel_err(loss, ref_loss) < 1e-6
    assert rel_err(grad, ref_grad[:, rank * shard : (rank + 1) * shard]) < 1e-6


@pytest.mark.parametrize("vocab", [258, 2 * BLOCK + 6])
def test_vocab_parallel_matches_the_whole_vocabulary(vocab: int) -> None:
    run_ranks(_vocab_parallel, 2, vocab)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "vocab"), [(4096, 32064), (1000, 128256), (8192, 32000)])
def test_fused_loss_at_model_sizes(rows: int, vocab: int) -> None:
    """Llama-3's vocabulary, whole and split four ways, in bf16 as autocast gives it."""
    logits, targets = case(rows, vocab, torch.bfloat16, seed=rows)
    loss, grad = fused(logits, targets)
    ref_loss, ref_grad = reference(logits, targets)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grad, ref_grad) < 1e-2
