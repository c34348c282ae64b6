"""Ulysses attention on gloo at world sizes 2 and 4: outputs and input gradients equal single-process
attention within 1e-5 (fp32), with and without grouped-query attention, on the stock exchange and
through the comm dispatch's torch path. On 2 and 4 GPUs: the triton path (kernels/all_to_all.py)
equals the torch path, forward and backward, in bf16."""

import pytest
import torch
import torch.distributed as dist

from model.llama import sdpa_attention
from parallel.comm import make_comm
from parallel.ulysses import check_ulysses_heads, ulysses_attention
from tests.multiprocess import GPU_WORLDS, run_ranks

# (query heads, key/value heads): equal heads, GQA with kv heads split, GQA with kv heads replicated.
HEAD_CASES = [(8, 8), (8, 4), (8, 2), (4, 1)]


def compare_on_rank(rank: int, world: int) -> None:
    for comm in (None, make_comm("torch", dist.group.WORLD)):
        compare_heads(rank, world, comm)


def compare_heads(rank: int, world: int, comm) -> None:
    for n_heads, n_kv_heads in HEAD_CASES:
        if n_heads % world or (n_kv_heads % world and world % n_kv_heads):
            continue
        torch.manual_seed(n_heads * 10 + n_kv_heads)  # the same full tensors on every rank
        bsz, seq, dim = 2, 8 * world, 16
        q = torch.randn(bsz, n_heads, seq, dim).requires_grad_()
        k = torch.randn(bsz, n_kv_heads, seq, dim).requires_grad_()
        v = torch.randn(bsz, n_kv_heads, seq, dim).requires_grad_()
        grad_out = torch.randn(bsz, n_heads, seq, dim)
        expected = sdpa_attention(q, k, v, None)
        expected.backward(grad_out)

        chunk = slice(rank * seq // world, (rank + 1) * seq // world)
        local = [t.detach()[:, :, chunk].clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(sdpa_attention, dist.group.WORLD, comm)(*local, None)
        out.backward(grad_out[:, :, chunk])
        torch.testing.assert_close(out, expected[:, :, chunk], rtol=1e-5, atol=1e-5)
        for mine, full in zip(local, (q, k, v), strict=True):
            torch.testing.assert_close(mine.grad, full.grad[:, :, chunk], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_single_process(world: int) -> None:
    run_ranks(compare_on_rank, world)


def test_heads_that_cannot_spread_fail_clearly() -> None:
    with pytest.raises(ValueError, match=r"parallel\.cp=4"):
        check_ulysses_heads(6, 2, 4)
    with pytest.raises(ValueError, match=r"parallel\.cp=4"):
        check_ulysses_heads(8, 6, 4)
    check_ulysses_heads(8, 2, 4)


def triton_path_on_rank(rank: int, world: int) -> None:
    """Ulysses attention in bf16 on the triton path (kernels/all_to_all.py) against the torch path:
    the exchanges move data exactly, so outputs and input gradients agree to bf16 attention noise."""
    from kernels.all_to_all import check

    group = dist.group.WORLD
    dev = torch.device("cuda", torch.cuda.current_device())
    paths = {name: make_comm(name, group) for name in ("torch", "triton")}
    for n_heads, n_kv_heads in [(8, 8), (8, 2), (16, 4)]:
        torch.manual_seed(rank * 100 + n_kv_heads)  # each rank its own sequence chunk
        bsz, seq_local, dim = 2, 384, 128
        # As the model hands them over: transpose views of [B, S/W, heads, D] projections.
        base = [
            torch.randn(bsz, seq_local, h, dim, device=dev, dtype=torch.bfloat16)
            for h in (n_heads, n_kv_heads, n_kv_heads)
        ]
        grad_out = torch.randn(bsz, n_heads, seq_local, dim, device=dev, dtype=torch.bfloat16)
        results = {}
        for name, comm in paths.items():
            leaves = [b.clone().requires_grad_() for b in base]
            out = ulysses_attention(sdpa_attention, group, comm)(*(t.transpose(1, 2) for t in leaves), None)
            out.backward(grad_out)
            results[name] = (out.detach(), *(t.grad for t in leaves))
        torch.cuda.synchronize()
        check(group)
        for what, mine, ref in zip(
            ("out", "dq", "dk", "dv"), results["triton"], results["torch"], strict=True
        ):
            assert not torch.isnan(mine).any(), f"{what}: NaN on the triton path"
            torch.testing.assert_close(
                mine.float(),
                ref.float(),
                rtol=2e-2,
                atol=2e-2,
                msg=lambda m, label=f"{what} ({n_heads}, {n_kv_heads})": f"{label}: {m}",
            )


@pytest.mark.parametrize("world", GPU_WORLDS)
def test_ulysses_triton_path_matches_torch_path(world: int) -> None:
    run_ranks(triton_path_on_rank, world, backend="nccl")
