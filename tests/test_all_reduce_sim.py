"""The all-reduce kernels' data path (kernels/all_reduce.py) on W simulated ranks, CPU only.

Each kernel's work between its barriers or waits is a @triton.jit helper; the test kernels here call
those helpers one phase at a time, and `simulate` / `simulate_push` run phase 1 on every rank, then
phase 2 on every rank, ... under Triton's interpreter (a single interpreted program cannot wait for
another), with CPU tensors as every rank's symmetric buffer through a pointer table like the real one.
Outputs and copy-in slots start as NaN; push buffers start as SENTINEL, as CustomAllReduce fills them.
Every rank's output must be the fp32 sum over ranks 0, 1, ..., W-1 (from +0.0, as the kernels start)
cast once, bit for bit (bf16: the interpreter casts fp32 -> bf16 by truncation, the GPU to nearest;
either is accepted). W = 2, 4, 8; bf16, fp16, fp32; ragged sizes (short and empty last chunks),
several programs with small blocks so that the strided loops run more than once; one-shot and
two-shot with and without DIRECT; buffer regions a call must not touch are checked untouched, push
slots reset to SENTINEL, and -0.0 inputs (including the bf16 pair that would equal SENTINEL) summed
without a wait ever finding SENTINEL. The barriers, the bounded spin's clock (inline PTX: replaced by
a frozen clock here) and the multi-GPU ordering are tested on GPUs (tests/test_all_reduce_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

import kernels.all_reduce as ar
from kernels.all_reduce import (
    ONE_SHOT_PUSH_OP,
    SENTINEL,
    TRITON_DTYPES,
    TWO_SHOT_PUSH_OP,
    PushLayout,
    _peer_base,
    _timed_out_before,
    call_regions,
    copy_chunks,
    copy_in,
    one_shot_push_ptrs,
    one_shot_push_send,
    one_shot_push_sum,
    one_shot_sum,
    two_shot_push_gather,
    two_shot_push_ptrs,
    two_shot_push_reduce,
    two_shot_push_send,
    two_shot_reduce,
    vector_elems,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="simulates ranks under Triton's interpreter"
)

NAN = float("nan")


# ------------------------------------------------------------------------------- test-only kernels


@triton.jit
def _barrier_phase(
    inp_ptr, out_ptr, buf_ptrs, n_vec, epoch, base_off, slot_bytes,
    ONE_SHOT: tl.constexpr, PHASE: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
    DIRECT: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """One phase of _one_shot_kernel (0: copy-in, before the barrier; 1: the sum) or of _two_shot_kernel
    (0: copy-in; 1: reduce chunk RANK and push it; 2: copy-out)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    gather, region = call_regions(epoch, base_off, slot_bytes, DIRECT)
    if ONE_SHOT:
        if PHASE == 0:
            if not DIRECT:
                copy_in(inp_ptr, _peer_base(buf_ptrs, RANK, region, DT), n_vec, pid, nprog, BLOCK_V, VEC)
        else:
            one_shot_sum(out_ptr, buf_ptrs, region, n_vec, pid, nprog, WORLD, BLOCK_V, VEC)
    else:
        mine = _peer_base(buf_ptrs, RANK, gather, DT)
        if PHASE == 0:
            if not DIRECT:
                copy_chunks(inp_ptr, mine, n_vec, pid, nprog, WORLD, BLOCK_V, VEC)
        elif PHASE == 1:
            two_shot_reduce(buf_ptrs, region, gather, n_vec, pid, nprog, RANK, WORLD, BLOCK_V, VEC, DT)
        else:
            copy_chunks(mine, out_ptr, n_vec, pid, nprog, WORLD, BLOCK_V, VEC)


@triton.jit
def _push_phase(
    inp_ptr, out_ptr, buf_ptrs, status_ptr, n_vec, base_vecs, slot_vecs, chunk_vecs, set_,
    ONE_SHOT: tl.constexpr, PHASE: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, DT: tl.constexpr,
    BLOCK_V: tl.constexpr, OP: tl.constexpr,
):  # fmt: skip
    """One phase of _one_shot_push_kernel (0: push; 1: wait, sum, reset) or of _two_shot_push_kernel (0:
    push chunks; 1: wait, reduce, push the sum, reset; 2: wait, copy out, reset); timeout 0 (a frozen
    clock)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    give_up = _timed_out_before(status_ptr)
    if ONE_SHOT:
        outbox, inbox = one_shot_push_ptrs(buf_ptrs, set_, base_vecs, slot_vecs, RANK, WORLD)
        if PHASE == 0:
            one_shot_push_send(inp_ptr, outbox, n_vec, pid, nprog, WORLD, DT, BLOCK_V)
        else:
            one_shot_push_sum(
                out_ptr, inbox, status_ptr, give_up, n_vec, 0, pid, nprog, WORLD, DT, BLOCK_V, OP
            )
    else:
        to_reduce, to_gather, reduce_in, gather_in = two_shot_push_ptrs(
            buf_ptrs, set_, base_vecs, slot_vecs, chunk_vecs, RANK, WORLD
        )
        if PHASE == 0:
            two_shot_push_send(inp_ptr, to_reduce, n_vec, pid, nprog, WORLD, DT, BLOCK_V)
        elif PHASE == 1:
            two_shot_push_reduce(
                to_gather, reduce_in, status_ptr, give_up, n_vec, 0, pid, nprog, RANK, WORLD, DT, BLOCK_V, OP
            )
        else:
            two_shot_push_gather(
                out_ptr, gather_in, status_ptr, give_up, n_vec, 0, pid, nprog, WORLD, BLOCK_V, OP
            )


@triton.jit
def _frozen_clock(like):
    """Stands in for %globaltimer (inline PTX, which the interpreter cannot run): with timeout_ns = 0, a
    wait that finds SENTINEL looks once more, then records a timeout instead of spinning forever."""
    return tl.zeros_like(like).to(tl.int64)


@pytest.fixture(autouse=True)
def _no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ar, "_globaltimer_ns", _frozen_clock)  # looked up at call time by wait_for_words


# ------------------------------------------------------------------------------------- simulation


def simulate(
    algo: str, xs: list[torch.Tensor], direct: bool, block_v: int, programs: int, epoch: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int, int]:
    """One call of the one-shot or two-shot kernel on len(xs) ranks, phase by phase. Returns (outputs,
    buffers after, buffers before, base_off, slot_bytes); DIRECT inputs are placed in the direct region."""
    world, dtype, esize = len(xs), xs[0].dtype, xs[0].element_size()
    vec = vector_elems(dtype)
    n_vec = xs[0].numel() // vec
    base_off, slot_bytes = 48, n_vec * 16 + 32  # slack after each message: must stay untouched
    bufs = [torch.full(((base_off + 3 * slot_bytes) // esize,), NAN, dtype=dtype) for _ in range(world)]
    if direct:
        for buf, x in zip(bufs, xs, strict=True):
            region(buf, 2, base_off, slot_bytes)[: x.numel()].copy_(x)
    before = [b.clone() for b in bufs]
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    outs = [torch.full_like(x, NAN) for x in xs]
    one_shot = algo == "one_shot"
    for phase in range(2 if one_shot else 3):
        for rank in range(world):
            _barrier_phase[(programs,)](
                xs[rank], outs[rank], table.data_ptr(), n_vec, epoch, base_off, slot_bytes,
                ONE_SHOT=one_shot, PHASE=phase, RANK=rank, WORLD=world, DIRECT=direct, BLOCK_V=block_v,
                VEC=vec,
            )  # fmt: skip
    return outs, bufs, before, base_off, slot_bytes


def simulate_push(
    algo: str, xs: list[torch.Tensor], block_v: int, programs: int, set_: int, spare_vecs: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]:
    """One call of the one-shot or two-shot push kernel on len(xs) ranks, phase by phase, on push
    buffers of `spare_vecs` vectors more than the message per slot, all SENTINEL but a prefix before
    the buffer's base. Returns (outputs, buffers after, status words, prefix words)."""
    world, dtype = len(xs), xs[0].dtype
    n_vec = xs[0].numel() * xs[0].element_size() // 16
    layout = PushLayout(world, (n_vec + spare_vecs) * 16)
    base_vecs = 3
    prefix = base_vecs * 4
    bufs = [torch.full((prefix + layout.total_bytes // 4,), SENTINEL.value, dtype=torch.int32) for _ in xs]
    for buf in bufs:
        buf[:prefix] = 7
    status = [torch.zeros(4, dtype=torch.int32) for _ in xs]
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    outs = [torch.full_like(x, NAN) for x in xs]
    one_shot = algo == "one_shot_push"
    for phase in range(2 if one_shot else 3):
        for rank in range(world):
            _push_phase[(programs,)](
                xs[rank].view(-1).view(torch.int32), outs[rank].view(-1).view(torch.int32), table.data_ptr(),
                status[rank], n_vec, base_vecs, layout.slot_bytes // 16, layout.chunk_bytes // 16, set_,
                ONE_SHOT=one_shot, PHASE=phase, RANK=rank, WORLD=world, DT=TRITON_DTYPES[dtype],
                BLOCK_V=block_v, OP=ONE_SHOT_PUSH_OP if one_shot else TWO_SHOT_PUSH_OP,
            )  # fmt: skip
    return outs, bufs, status, prefix


# ---------------------------------------------------------------------------------------- checks


def region(buf: torch.Tensor, k: int, base_off: int, slot_bytes: int) -> torch.Tensor:
    """Region k (0, 1: slots; 2: direct) of an all-reduce buffer."""
    esize = buf.element_size()
    return buf[(base_off + k * slot_bytes) // esize :][: slot_bytes // esize]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def inputs(world: int, n_vec: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per rank: magnitudes 2^-8 .. 2^8 (fp32 sums depend on the order), -0.0 at every 7th element on
    every rank, and elements 8k, 8k + 1 = (+0.0, -0.0) on every rank: the bf16/fp16 pair whose word is
    SENTINEL (fp32: the -0.0 alone is)."""
    n = n_vec * vector_elems(dtype)
    xs = []
    for _ in range(world):
        x = torch.randn(n) * torch.exp2(torch.randint(-8, 9, (n,)).float())
        x[::7] = -0.0
        x[0::8] = 0.0
        x[1::8] = -0.0
        xs.append(x.to(dtype))
    return xs


def check_sum(got: torch.Tensor, xs: list[torch.Tensor], what: str) -> None:
    """`got` is the fp32 sum of `xs` in rank order, from +0.0, rounded once to the dtype."""
    acc = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        acc += x.float()
    ok = bits(got) == bits(acc.to(got.dtype))
    if got.dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest)
        ok |= bits(got) == bits((acc.view(torch.int32) & -65536).view(torch.float32).to(got.dtype))
    bad = (~ok).nonzero().flatten()
    assert not len(bad), f"{what}: {len(bad)} of {got.numel()} elements differ, first {bad[:8].tolist()}"
    assert not torch.signbit(got[1::8]).any(), f"{what}: -0.0 + ... + -0.0 must come out +0.0"


# (world, dtype, vectors, BLOCK_V, programs); chunk = ceil(vectors / world). Chunks that are not a
# multiple of BLOCK_V: a block reaching past its chunk must be masked (i < chunk).
CASES = [
    (2, torch.float32, 37, 4, 3),  # last chunk short (18 + 19 -> 19, 18), 4 blocks of 4 per chunk
    (4, torch.bfloat16, 5, 2, 2),  # chunks of 2: rank 2's has 1, rank 3's none
    (4, torch.float32, 61, 4, 3),  # chunks of 16, the last 13
    (4, torch.float16, 34, 2, 3),  # chunks of 9, the last 7
    (8, torch.bfloat16, 9, 4, 3),  # chunks of 2: ranks 5-7 get none; programs 1, 2 have no block
    (8, torch.float32, 203, 4, 3),  # chunks of 26, the last 21
]
IDS = [f"w{w}-{str(d)[6:]}-{n}v-b{b}x{p}" for w, d, n, b, p in CASES]


@pytest.mark.parametrize("direct", [False, True], ids=["copy-in", "direct"])
@pytest.mark.parametrize("algo", ["one_shot", "two_shot"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_barrier_kernels_sum_in_rank_order(case, algo: str, direct: bool) -> None:
    world, dtype, n_vec, block_v, programs = case
    epoch = n_vec % 2  # both copy-in slots over the cases
    xs = inputs(world, n_vec, dtype)
    outs, bufs, before, base_off, slot_bytes = simulate(algo, xs, direct, block_v, programs, epoch)
    for rank in range(world):
        check_sum(outs[rank], xs, f"{algo} rank {rank}")
        # What the call may write: the message's part of slot epoch & 1 (copy-in: the input; two-shot:
        # the reduced chunks). Never the direct region, the other slot, or past the message.
        want = before[rank].clone()
        slot = region(want, epoch & 1, base_off, slot_bytes)[: xs[rank].numel()]
        if algo == "two_shot":
            slot.copy_(outs[rank])
        elif not direct:
            slot.copy_(xs[rank])
        assert torch.equal(bits(bufs[rank]), bits(want)), f"{algo} rank {rank}: buffer"


# (world, dtype, vectors, BLOCK_V, programs, set, spare vectors per slot)
PUSH_CASES = [
    (2, torch.float32, 37, 2, 3, 0, 0),
    (4, torch.bfloat16, 5, 2, 2, 1, 3),  # chunk 2 of slots of 2 (chunk_vecs = 2)
    (4, torch.float16, 61, 4, 3, 2, 9),  # chunk 16 of slots of 18
    (8, torch.bfloat16, 9, 2, 3, 2, 0),  # ranks 5-7 get no chunk
    (8, torch.float32, 203, 4, 3, 1, 21),  # chunk 26 of slots of 28
]
PUSH_IDS = [f"w{w}-{str(d)[6:]}-{n}v-b{b}x{p}-set{s}" for w, d, n, b, p, s, _ in PUSH_CASES]


@pytest.mark.parametrize("algo", ["one_shot_push", "two_shot_push"])
@pytest.mark.parametrize("case", PUSH_CASES, ids=PUSH_IDS)
def test_push_kernels_sum_in_rank_order_and_reset_their_slots(case, algo: str) -> None:
    world, dtype, n_vec, block_v, programs, set_, spare = case
    xs = inputs(world, n_vec, dtype)
    outs, bufs, status, prefix = simulate_push(algo, xs, block_v, programs, set_, spare)
    for rank in range(world):
        # a wait that found SENTINEL (data missing, or a -0.0 sent unsanitized) records a timeout
        assert status[rank].tolist() == [0, 0, 0, 0], f"{algo} rank {rank}: a wait timed out"
        check_sum(outs[rank], xs, f"{algo} rank {rank}")
        assert (bufs[rank][:prefix] == 7).all(), f"{algo} rank {rank}: wrote before the buffer's base"
        left = (bufs[rank][prefix:] != SENTINEL.value).nonzero().flatten()
        assert not len(left), f"{algo} rank {rank}: {len(left)} words not reset, first {left[:8].tolist()}"
