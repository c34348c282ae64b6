"""CPU tests of the push all-reduce's building blocks: the sentinel replacement, the fp32 rank-order
sum over packed words, and the push buffer's slot offsets (Triton interpreter), plus the two push
kernels compiled for sm_90 (Triton's own compiler, no GPU needed) so that a frontend error shows here
rather than on the lead's H200s."""

import itertools

import pytest
import torch
import triton
import triton.language as tl

from kernels.all_reduce import (
    PUSH_SETS,
    SENTINEL,
    TRITON_DTYPES,
    PushLayout,
    _one_shot_push_kernel,
    _two_shot_push_kernel,
    gather_slot,
    one_shot_slot,
    reduce_slot,
    sanitize,
    sum_rows,
)
from tests.sm90 import compile_ptx, run_without_interpreter

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@triton.jit
def _sanitize_kernel(x_ptr, y_ptr, n, DT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, sanitize(tl.load(x_ptr + offs, mask=offs < n), DT), mask=offs < n)


@triton.jit
def _sum_rows_kernel(x_ptr, y_ptr, WORLD: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, WORLD)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(y_ptr + tl.arange(0, BLOCK), sum_rows(tl.load(x_ptr + offs), WORLD, DT))


@triton.jit
def _slots_kernel(out_ptr, slot_vecs, chunk_vecs, WORLD: tl.constexpr):
    """out[set, r, :] = (one-shot, reduce, gather) word offsets of slot r of set `set`."""
    r = tl.arange(0, WORLD)
    for set_ in tl.static_range(PUSH_SETS):
        base = out_ptr + (set_ * WORLD + r) * 3
        s = tl.full([WORLD], set_, tl.int32)
        tl.store(base, one_shot_slot(s, r, WORLD, slot_vecs))
        tl.store(base + 1, reduce_slot(s, r, WORLD, slot_vecs, chunk_vecs))
        tl.store(base + 2, gather_slot(s, r, WORLD, slot_vecs, chunk_vecs))


def as_words(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sanitize_replaces_negative_zero_only(dtype: torch.dtype) -> None:
    x = torch.randn(64, dtype=dtype)
    x[::5] = -0.0
    x[1::7] = 0.0
    x[2] = float("nan")
    x[3] = float("-inf")
    words = as_words(x)
    out = torch.empty_like(words)
    _sanitize_kernel[(1,)](words, out, words.numel(), DT=TRITON_DTYPES[dtype], BLOCK=64)
    y = out.view(dtype)
    assert not (y == 0).logical_and(torch.signbit(y)).any(), "a -0.0 survived"
    assert (out != SENTINEL.value).all(), "a word still equals the sentinel"
    keep = x != 0
    assert torch.equal(y[keep].view(torch.int16 if dtype != torch.float32 else torch.int32),
                       x[keep].view(torch.int16 if dtype != torch.float32 else torch.int32))  # fmt: skip
    assert torch.isnan(y[2]) and y[3] == float("-inf")


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_rows_is_the_fp32_sum_in_rank_order_rounded_once(world: int, dtype: torch.dtype) -> None:
    block = 32  # words per rank
    x = torch.randn(world, block * 4 // torch.empty((), dtype=dtype).element_size(), dtype=dtype) * 100
    x[0, :3] = torch.tensor([1e-3, 5.0, 0.0])
    x[1:, 1] = -5.0 / (world - 1)  # cancellation: an exact 0 in the middle of the row
    out = torch.full((block,), -1, dtype=torch.int32)
    _sum_rows_kernel[(1,)](as_words(x), out, WORLD=world, DT=TRITON_DTYPES[dtype], BLOCK=block)
    acc = torch.zeros(x.shape[1], dtype=torch.float32)
    for r in range(world):
        acc += x[r].float()
    got = out.view(dtype)
    if dtype == torch.bfloat16:  # Triton's interpreter casts fp32 -> bf16 by truncation (GPU: to nearest)
        truncated = (acc.view(torch.int32) & -65536).view(torch.float32).to(dtype)
        assert ((got == acc.to(dtype)) | (got == truncated)).all(), "not the rank-order fp32 sum"
    else:
        assert torch.equal(got, acc.to(dtype)), "not the rank-order fp32 sum rounded once"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_slot_offsets_match_the_host_layout(world: int) -> None:
    layout = PushLayout(world, 1000 * 16)
    out = torch.full((PUSH_SETS.value, world, 3), -1, dtype=torch.int64)
    _slots_kernel[(1,)](out, layout.slot_bytes // 16, layout.chunk_bytes // 16, WORLD=world)
    for s in range(PUSH_SETS.value):
        for r in range(world):
            host = (layout.one_shot_slot(s, r), layout.reduce_slot(s, r), layout.gather_slot(s, r))
            assert tuple(4 * int(v) for v in out[s, r]) == host


@pytest.mark.parametrize("world", [2, 4, 8])
def test_push_layout_regions_are_disjoint_and_fit(world: int) -> None:
    layout = PushLayout(world, 3 * 1024 * 16 + 16)  # a slot that does not split evenly into chunks
    assert layout.chunk_bytes * world >= layout.slot_bytes and layout.chunk_bytes % 16 == 0
    spans = []
    for s in range(PUSH_SETS.value):
        for r in range(world):
            spans.append((layout.one_shot_slot(s, r), layout.slot_bytes))
            spans.append((layout.reduce_slot(s, r), layout.chunk_bytes))
            spans.append((layout.gather_slot(s, r), layout.chunk_bytes))
    spans.sort()
    for (a, size), (b, _) in itertools.pairwise(spans):
        assert a + size <= b, "two slots overlap"
    assert spans[-1][0] + spans[-1][1] == layout.total_bytes
    assert layout.total_bytes == 3 * world * layout.slot_bytes + 6 * world * layout.chunk_bytes


def test_push_layout_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        PushLayout(4, 1000)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        PushLayout(1, 1024)


def _compile_sm90(kernel, two_shot: bool, world: int, dtype: torch.dtype, warps: int) -> str:
    sig = {"inp_ptr": "*i32", "out_ptr": "*i32", "buf_ptrs": "i64", "epoch_ptr": "*i32",
           "status_ptr": "*i32", "n_vec": "i32", "base_vecs": "i32", "slot_vecs": "i32"}  # fmt: skip
    if two_shot:
        sig["chunk_vecs"] = "i32"
    sig["timeout_ns"] = "i64"
    const = {"RANK": world - 1, "WORLD": world, "DT": TRITON_DTYPES[dtype], "BLOCK_V": warps * 32, "OP": 1}
    return compile_ptx(kernel, sig, const, num_warps=warps)


def check_sm90_ptx() -> None:
    """Compile both push kernels for a few (world, dtype, warps) and check the PTX has what the design
    relies on. Runs in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit)."""
    # 1 and 2 warps: the launch table's rows up to 1 MiB.
    cases = (
        (2, torch.float32, 4),
        (4, torch.bfloat16, 1),
        (4, torch.bfloat16, 2),
        (4, torch.bfloat16, 8),
        (8, torch.float16, 16),
    )
    for two_shot in (False, True):
        kernel = _two_shot_push_kernel if two_shot else _one_shot_push_kernel
        for world, dtype, warps in cases:
            ptx = _compile_sm90(kernel, two_shot, world, dtype, warps)
            what = f"{kernel.__name__} world {world} {dtype} {warps} warps"
            assert "ld.volatile.global" in ptx and "%globaltimer" in ptx, f"{what}: no bounded spin"
            assert "st.global.v4" in ptx, f"{what}: pushes must go out as 16-byte stores"


def test_push_kernels_compile_for_sm90() -> None:
    run_without_interpreter("tests.test_all_reduce_push")
