"""One-shot and two-shot all-reduce (sum) over symmetric memory, in Triton, and the reference.

Both kernels sum in fp32 over ranks 0, 1, ..., W-1 in that order on every rank, so every rank gets
bit-identical results. Data moves as 16-byte vectors (bf16/fp16: 8 elements, fp32: 4); the element
count must make whole vectors (numel * itemsize % 16 == 0). Barriers follow kernels/symm_mem.py's
epoch protocol: no host state, CUDA-graph replayable, bounded waits.

Each kernel's work between two barriers or waits is a @triton.jit helper (`copy_in`, `one_shot_sum`,
`copy_chunks`, `two_shot_reduce`, `*_push_send`, ...), so that tests/test_all_reduce_sim.py can run the
data path phase by phase on W simulated ranks under Triton's interpreter.

The symmetric buffer of a call holds three regions of `slot_bytes` each:

    [ slot 0 | slot 1 | direct ]

* Copy-in calls (`direct=False`, the eager path): the kernel itself copies the caller's tensor into
  slot `epoch & 1`, then meets its peers once, then reads. No exit barrier: call k+2 reuses call k's
  slot only after this rank has passed call k+1's barrier, which every peer reached after finishing
  call k (launches on a stream run in order).
* Direct calls (`direct=True`): a producer (a row-parallel matmul) already wrote its partial sums into
  the `direct` region, so no copy. The producer of the next call writes there again as soon as this
  kernel ends, so the one-shot kernel adds an exit barrier (peers done reading). The two-shot kernel
  needs none: a peer's last access to this rank's buffer comes before its second barrier. Neither
  kernel writes the direct region: two-shot gathers its reduced chunks in slot `epoch & 1`.

one-shot: barrier; every rank reads all W inputs and sums. Latency: one barrier, W-1 remote reads of
    the whole message per rank.
two-shot: barrier; rank r reduces chunk r of all W inputs and pushes the sum into chunk r of every
    rank's gather slot (remote stores); barrier; each rank copies the W reduced chunks out. Two barriers,
    but each rank moves 2 (W-1)/W of the message instead of W-1 times it.

Push ("Lamport") kernels: no barrier, no signal pad, the data is its own flag
-------------------------------------------------------------------------------
They use a second symmetric buffer (`PushLayout`), every 32-bit word of which holds SENTINEL
(0x80000000: fp32 -0.0; for bf16/fp16 the element pair (+0.0, -0.0)) whenever no call is using it.
Senders replace every -0.0 element by +0.0, so no word of real data equals SENTINEL; a receiver spins
with volatile loads on its own buffer until no word of its share holds SENTINEL, consumes, and writes
SENTINEL back. Checks are per 32-bit word (stores of aligned words are never seen half-done), so a
16-byte store that becomes visible piecewise is harmless. The sentinel is a 32-bit word for every dtype
so that calls of different dtypes can share the buffer.

one_shot_push: each rank stores its (sanitized) input into slot [RANK] of the current set on every rank
    (remote stores, fire-and-forget over NVLink), waits for its own W slots, sums them in fp32 in rank
    order, resets them. One one-way NVLink latency.
two_shot_push: rank j's chunk of every input goes to reduce slot [sender] of rank j; rank j sums its W
    reduce slots in rank order and stores the reduced chunk into gather slot [j] of every rank; every
    rank waits for its W gather slots and copies them out. Each receiver resets the slots it consumed.

Push buffer layout (bytes; P = `slot_bytes` >= the largest message, C = P / W rounded up to 16 bytes):

    [ one-shot set 0: slot 0 .. slot W-1 | set 1 | set 2 ]                      3 W P
    [ two-shot set 0: reduce 0 .. W-1, gather 0 .. W-1 | set 1 | set 2 ]        3 2W C

A call uses set `e % 3`, e counting the calls on the buffer (the buffer's epoch slots hold e % 3 so
that int32 wrap-around cannot break the rotation). Why the sets never collide: a peer writes call e+3
into set e % 3 of my buffer only while running its call e+3, so after finishing its call e+2, which
needed my call e+2 data (one-shot: every rank's input; two-shot: every reduced chunk, each of which
needed every rank's input), which I pushed only inside my call e+2 kernel, which my stream started only
after my call e kernel, sentinel resets included, had completed. The same chain with call e+2 in
place of e+3 already ends after my call e completed, so two sets would do; the third is slack. Inside
one call each slot word is written once, by one rank, and reset only by its receiver after reading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels.launch import launch
from kernels.symm_mem import (
    MAX_BLOCKS,
    MAX_PROGRAMS,
    SymmBuffer,
    advance_epoch,
    barrier,
    load_epoch,
    op_id,
    record_timeout,
)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VECTOR_BYTES = 16
ONE_SHOT_OP = op_id("all_reduce one-shot")
TWO_SHOT_OP = op_id("all_reduce two-shot")
ONE_SHOT_PUSH_OP = op_id("all_reduce one-shot push")
TWO_SHOT_PUSH_OP = op_id("all_reduce two-shot push")
PUSH_ALGORITHMS = ("one_shot_push", "two_shot_push")
SENTINEL = tl.constexpr(-(1 << 31))  # int32 0x80000000
PUSH_SETS = tl.constexpr(3)
WORDS_PER_VECTOR = tl.constexpr(VECTOR_BYTES // 4)
TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _peer_base(buf_ptrs, r, region, DT: tl.constexpr):
    """Rank r's buffer base + region, as a 16-byte aligned pointer to DT."""
    base = tl.load(buf_ptrs.to(tl.pointer_type(tl.uint64)) + r).to(tl.int64) + region
    return tl.multiple_of(base.to(tl.pointer_type(DT)), 16)


@triton.jit
def call_regions(epoch, base_off, slot_bytes, DIRECT: tl.constexpr):
    """(gather, inputs): byte offsets of this call's slot (`epoch & 1`: copy-in and, two-shot, the
    reduced chunks) and of the region the inputs are read from (the direct region if DIRECT)."""
    gather = base_off + (epoch & 1).to(tl.int64) * slot_bytes
    region = base_off + 2 * slot_bytes if DIRECT else gather
    return gather, region


@triton.jit
def copy_in(inp_ptr, dst, n_vec, pid, nprog, BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """One-shot copy-in: this program's blocks (pid, pid + nprog, ...) of the n_vec input vectors to
    `dst`, this rank's slot."""
    rows = tl.arange(0, BLOCK_V)
    cols = tl.arange(0, VEC)
    for start in range(pid * BLOCK_V, n_vec, nprog * BLOCK_V):
        v = start + rows
        offs = v[:, None] * VEC + cols[None, :]
        mask = (v < n_vec)[:, None]
        tl.store(dst + offs, tl.load(inp_ptr + offs, mask=mask), mask=mask)


@triton.jit
def one_shot_sum(
    out_ptr, buf_ptrs, region, n_vec, pid, nprog,
    WORLD: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """out = the sum of every rank's `region` over this program's blocks, in fp32 in rank order."""
    DT: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_V)
    cols = tl.arange(0, VEC)
    for start in range(pid * BLOCK_V, n_vec, nprog * BLOCK_V):
        v = start + rows
        offs = v[:, None] * VEC + cols[None, :]
        mask = (v < n_vec)[:, None]
        acc = tl.zeros([BLOCK_V, VEC], tl.float32)
        for r in tl.static_range(WORLD):
            acc += tl.load(_peer_base(buf_ptrs, r, region, DT) + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(DT), mask=mask)


@triton.jit
def copy_chunks(
    src, dst, n_vec, pid, nprog, WORLD: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr
):  # fmt: skip
    """Two-shot copy-in (input -> gather slot) and copy-out (gather slot -> output): positions
    [pid * BLOCK_V, ...) of every rank's chunk, from `src` to `dst`."""
    rows = tl.arange(0, BLOCK_V)
    cols = tl.arange(0, VEC)
    chunk = (n_vec + WORLD - 1) // WORLD  # vectors per rank's chunk; the last may be short
    for start in range(pid * BLOCK_V, chunk, nprog * BLOCK_V):
        i = start + rows
        for c in tl.static_range(WORLD):
            v = c * chunk + i
            offs = v[:, None] * VEC + cols[None, :]
            mask = ((i < chunk) & (v < n_vec))[:, None]
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def two_shot_reduce(
    buf_ptrs, region, gather, n_vec, pid, nprog,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """Reduce-scatter: this program's positions of chunk RANK of every rank's `region`, summed in fp32
    in rank order, pushed into chunk RANK of every rank's `gather` slot."""
    rows = tl.arange(0, BLOCK_V)
    cols = tl.arange(0, VEC)
    chunk = (n_vec + WORLD - 1) // WORLD
    for start in range(pid * BLOCK_V, chunk, nprog * BLOCK_V):
        i = start + rows
        v = RANK * chunk + i
        offs = v[:, None] * VEC + cols[None, :]
        mask = ((i < chunk) & (v < n_vec))[:, None]
        acc = tl.zeros([BLOCK_V, VEC], tl.float32)
        for r in tl.static_range(WORLD):
            acc += tl.load(_peer_base(buf_ptrs, r, region, DT) + offs, mask=mask).to(tl.float32)
        y = acc.to(DT)
        for r in tl.static_range(WORLD):
            tl.store(_peer_base(buf_ptrs, r, gather, DT) + offs, y, mask=mask)


@triton.jit
def _one_shot_kernel(
    inp_ptr, out_ptr, buf_ptrs, pad_ptrs, epoch_ptr, status_ptr,
    n_vec, base_off, slot_bytes, timeout_ns,
    RANK: tl.constexpr, WORLD: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, OP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = load_epoch(epoch_ptr, pid)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    _, region = call_regions(epoch, base_off, slot_bytes, DIRECT)
    if not DIRECT:
        copy_in(inp_ptr, _peer_base(buf_ptrs, RANK, region, DT), n_vec, pid, nprog, BLOCK_V, VEC)
    barrier(pad_ptrs, 0, pid, epoch + 1, status_ptr, OP, timeout_ns, RANK, WORLD)
    one_shot_sum(out_ptr, buf_ptrs, region, n_vec, pid, nprog, WORLD, BLOCK_V, VEC)
    if DIRECT:
        barrier(pad_ptrs, 1, pid, epoch + 1, status_ptr, OP, timeout_ns, RANK, WORLD)
    advance_epoch(epoch_ptr, pid, epoch)


@triton.jit
def _two_shot_kernel(
    inp_ptr, out_ptr, buf_ptrs, pad_ptrs, epoch_ptr, status_ptr,
    n_vec, base_off, slot_bytes, timeout_ns,
    RANK: tl.constexpr, WORLD: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, OP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = load_epoch(epoch_ptr, pid)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    # Reduced chunks gather in slot epoch & 1; inputs are read there too unless DIRECT.
    gather, region = call_regions(epoch, base_off, slot_bytes, DIRECT)
    mine = _peer_base(buf_ptrs, RANK, gather, DT)
    # Program pid owns positions [pid * BLOCK_V, ...) of every chunk, the same on every rank.
    if not DIRECT:
        copy_chunks(inp_ptr, mine, n_vec, pid, nprog, WORLD, BLOCK_V, VEC)
    barrier(pad_ptrs, 0, pid, epoch + 1, status_ptr, OP, timeout_ns, RANK, WORLD)
    # In place when not DIRECT: only this program of this rank reads chunk RANK's positions.
    two_shot_reduce(buf_ptrs, region, gather, n_vec, pid, nprog, RANK, WORLD, BLOCK_V, VEC, DT)
    barrier(pad_ptrs, 1, pid, epoch + 1, status_ptr, OP, timeout_ns, RANK, WORLD)
    # All-gather: the W reduced chunks are now in this rank's gather slot.
    copy_chunks(mine, out_ptr, n_vec, pid, nprog, WORLD, BLOCK_V, VEC)
    advance_epoch(epoch_ptr, pid, epoch)


def vector_elems(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector."""
    return VECTOR_BYTES // torch.empty((), dtype=dtype).element_size()


def region_offset(region: int, slot_bytes: int) -> int:
    """Byte offset of region 0/1 (copy-in slots) or 2 (direct) inside the all-reduce buffer."""
    return region * slot_bytes


def launch_all_reduce(
    buf: SymmBuffer,
    inp: torch.Tensor,
    out: torch.Tensor,
    algo: str,
    slot_bytes: int,
    direct: bool,
    num_warps: int,
    num_blocks: int,
    timeout_ns: int,
) -> torch.Tensor:
    """Sum `inp` over `buf`'s group into `out` with the one-shot or two-shot kernel.

    `direct`: `inp` is already this rank's direct region (`buf` bytes [2 slot, 3 slot)); otherwise the
    kernel copies `inp` into a slot. `out` must not alias the buffer."""
    if algo not in ("one_shot", "two_shot"):
        raise ValueError(f"algo must be one_shot or two_shot, got {algo!r}")
    if inp.dtype not in SUPPORTED_DTYPES or out.dtype != inp.dtype:
        raise ValueError(f"dtype {inp.dtype} (out {out.dtype}) not in {SUPPORTED_DTYPES}")
    if not (inp.is_contiguous() and out.is_contiguous()) or out.numel() != inp.numel():
        raise ValueError("inp and out must be contiguous with the same number of elements")
    nbytes = inp.numel() * inp.element_size()
    if nbytes % VECTOR_BYTES or nbytes > slot_bytes or 3 * slot_bytes > buf.nbytes:
        raise ValueError(f"{nbytes} bytes: need a multiple of 16 of at most {slot_bytes}")
    if direct and inp.data_ptr() != buf.tensor.data_ptr() + region_offset(2, slot_bytes):
        raise ValueError("direct=True needs inp to start at the buffer's direct region")
    if inp.data_ptr() % 16 or out.data_ptr() % 16:
        raise ValueError("inp and out must be 16-byte aligned")
    if not 1 <= num_blocks <= MAX_BLOCKS.value:
        raise ValueError(f"num_blocks must be in 1..{MAX_BLOCKS.value}, got {num_blocks}")
    if nbytes == 0:
        return out
    vec = vector_elems(inp.dtype)
    kernel = _one_shot_kernel if algo == "one_shot" else _two_shot_kernel
    launch(
        kernel,
        (num_blocks,),
        inp,
        out,
        buf.buffer_ptrs_dev,
        buf.signal_pad_ptrs_dev,
        buf.epoch,
        buf.status,
        inp.numel() // vec,
        buf.base_offset,
        slot_bytes,
        timeout_ns,
        RANK=buf.rank,
        WORLD=buf.world_size,
        DIRECT=direct,
        BLOCK_V=num_warps * 32,
        VEC=vec,
        OP=ONE_SHOT_OP if algo == "one_shot" else TWO_SHOT_OP,
        num_warps=num_warps,
    )
    return out


# ------------------------------------------------------------------------------------ push kernels


@dataclass(frozen=True)
class PushLayout:
    """Byte offsets inside the push buffer (module docstring): one-shot slots, then two-shot slots."""

    world_size: int
    slot_bytes: int  # one-shot slot: the largest message the push kernels take

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0 or self.slot_bytes % VECTOR_BYTES:
            raise ValueError(f"push slot of {self.slot_bytes} bytes: need a positive multiple of 16")
        if self.world_size < 2:
            raise ValueError(f"push kernels need at least 2 ranks, got {self.world_size}")

    @property
    def chunk_bytes(self) -> int:
        """Two-shot slot: one rank's chunk of the largest message, whole 16-byte vectors."""
        vectors = self.slot_bytes // VECTOR_BYTES
        return -(-vectors // self.world_size) * VECTOR_BYTES

    def one_shot_slot(self, set_: int, rank: int) -> int:
        return (set_ * self.world_size + rank) * self.slot_bytes

    def reduce_slot(self, set_: int, rank: int) -> int:
        two_shot = PUSH_SETS.value * self.world_size * self.slot_bytes
        return two_shot + (set_ * 2 * self.world_size + rank) * self.chunk_bytes

    def gather_slot(self, set_: int, rank: int) -> int:
        return self.reduce_slot(set_, rank) + self.world_size * self.chunk_bytes

    @property
    def total_bytes(self) -> int:
        return self.reduce_slot(PUSH_SETS.value, 0)


# Slot offsets in int32 words (PushLayout's bytes / 4); sizes come in 16-byte vectors, so the
# compiler sees every slot start 16-byte aligned and emits vector loads and stores.


@triton.jit
def one_shot_slot(set_, r, WORLD: tl.constexpr, slot_vecs):
    """Word offset of one-shot slot [r] of set `set_`."""
    return (set_.to(tl.int64) * WORLD + r) * slot_vecs * WORDS_PER_VECTOR


@triton.jit
def reduce_slot(set_, r, WORLD: tl.constexpr, slot_vecs, chunk_vecs):
    """Word offset of two-shot reduce slot [r] of set `set_`."""
    two_shot = PUSH_SETS * WORLD * slot_vecs.to(tl.int64)
    return (two_shot + (set_.to(tl.int64) * 2 * WORLD + r) * chunk_vecs) * WORDS_PER_VECTOR


@triton.jit
def gather_slot(set_, r, WORLD: tl.constexpr, slot_vecs, chunk_vecs):
    """Word offset of two-shot gather slot [r] of set `set_`."""
    return reduce_slot(set_, r, WORLD, slot_vecs, chunk_vecs) + WORLD * chunk_vecs * WORDS_PER_VECTOR


@triton.jit
def sanitize(words, DT: tl.constexpr):
    """`words` (int32) with every packed -0.0 element replaced by +0.0: real data never equals SENTINEL."""
    if DT.primitive_bitwidth == 32:
        clean = tl.where(words == SENTINEL, 0, words)
    else:
        low = words & 0xFFFF
        high = words & -65536  # 0xFFFF0000
        clean = tl.where(low == 0x8000, 0, low) | tl.where(high == SENTINEL, 0, high)
    return clean


@triton.jit
def _halves_to_f32(words, DT: tl.constexpr):
    """The two 16-bit DT elements packed in each int32 word, as (low, high) fp32 blocks."""
    low = (words & 0xFFFF).to(tl.int16).to(DT, bitcast=True).to(tl.float32)
    high = (words >> 16).to(tl.int16).to(DT, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _pick_row(x, rows, r):
    """Row r of x [W, ...], exactly: x + (-0.0) == x for every x, and the compiler folds those adds
    away when the row axis lives in one thread's registers."""
    return tl.sum(tl.where(rows == r, x, -0.0), axis=0)


@triton.jit
def sum_rows(words, WORLD: tl.constexpr, DT: tl.constexpr):
    """words [WORLD, B] (row r: rank r's data) -> words [B] holding the DT elements' sums,
    accumulated in fp32 in the order row 0, 1, ..., WORLD-1 and rounded once: bit-identical on every
    rank."""
    rows = tl.arange(0, WORLD)[:, None]
    if DT.primitive_bitwidth == 32:
        values = words.to(tl.float32, bitcast=True)
        acc = _pick_row(values, rows, 0)
        for r in tl.static_range(1, WORLD):
            acc += _pick_row(values, rows, r)
        summed = acc.to(tl.int32, bitcast=True)
    else:
        low, high = _halves_to_f32(words, DT)
        acc_low = _pick_row(low, rows, 0)
        acc_high = _pick_row(high, rows, 0)
        for r in tl.static_range(1, WORLD):
            acc_low += _pick_row(low, rows, r)
            acc_high += _pick_row(high, rows, r)
        packed_low = acc_low.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        packed_high = acc_high.to(DT).to(tl.int16, bitcast=True).to(tl.int32) << 16
        summed = packed_low | packed_high
    return summed


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _globaltimer_ns(like):
    """%globaltimer (ns), read by every thread (inline asm wants a block argument: `like`)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def wait_for_words(ptrs, mask, give_up, timeout_ns, WORLD: tl.constexpr):
    """Volatile-load the int32 words at `ptrs` [WORLD, B] (row r: what rank r sends) until none
    holds SENTINEL, `timeout_ns` passed, or at once if `give_up` (an earlier wait timed out). Returns
    (words, pending): bit r of pending is set if row r still held SENTINEL. The loop condition is a
    reduction over the whole program, so every thread leaves the loop together."""
    row_bit = (1 << tl.arange(0, WORLD))[:, None]
    late_bit = 1 << WORLD
    one = tl.zeros([1, 1], tl.int32)
    start = _globaltimer_ns(one)
    words = tl.load(ptrs, mask=mask, other=0, volatile=True)
    state = tl.reduce(tl.where(words == SENTINEL, row_bit, 0), None, _bit_or)
    while (state != 0) & ((state & late_bit) == 0) & (give_up == 0):
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
        late = tl.where(_globaltimer_ns(one) - start >= timeout_ns, late_bit, 0)
        state = tl.reduce(tl.where(words == SENTINEL, row_bit, 0) | late, None, _bit_or)
    return words, state & (late_bit - 1)


@triton.jit
def _note_timeout(pending, give_up, status_ptr, op: tl.constexpr, where: tl.constexpr, WORLD: tl.constexpr):
    """Record the first timeout of this program (naming a rank whose data never came); returns the
    updated give_up flag."""
    if (pending != 0) & (give_up == 0):
        missing = -1
        for r in tl.static_range(WORLD):
            missing = tl.where(((pending >> r) & 1) != 0, r, missing)
        record_timeout(status_ptr, op, where, missing)
    return give_up | (pending != 0).to(tl.int32)


@triton.jit
def _timed_out_before(status_ptr):
    """Whether a wait on this buffer already timed out, as one value for the whole program: threads
    load the status word at different moments, and the wait loops need every thread to agree."""
    return tl.max(tl.load(status_ptr + tl.zeros([2], tl.int32), volatile=True), axis=0)


@triton.jit
def _rank_words(buf_ptrs, ranks, base_vecs):
    """Rank(s) `ranks`' push buffer as int32 pointer(s)."""
    base = tl.load(buf_ptrs.to(tl.pointer_type(tl.uint64)) + ranks).to(tl.pointer_type(tl.int32))
    return tl.multiple_of(base, 16) + base_vecs * WORDS_PER_VECTOR


@triton.jit
def _next_set(epoch_ptr, pid, set_):
    """advance_epoch stores its argument + 1: hand it so that every epoch slot becomes (set + 1) % 3."""
    advance_epoch(epoch_ptr, pid, tl.where(set_ == PUSH_SETS - 1, -1, set_))


@triton.jit
def one_shot_push_ptrs(buf_ptrs, set_, base_vecs, slot_vecs, RANK: tl.constexpr, WORLD: tl.constexpr):
    """(outbox, inbox) [WORLD, 1] int32 pointers, row r: slot [RANK] on rank r (where this rank's input
    goes) / this rank's slot [r] (what it sums)."""
    ranks = tl.arange(0, WORLD)
    outbox = (_rank_words(buf_ptrs, ranks, base_vecs) + one_shot_slot(set_, RANK, WORLD, slot_vecs))[:, None]
    inbox = (_rank_words(buf_ptrs, RANK, base_vecs) + one_shot_slot(set_, ranks, WORLD, slot_vecs))[:, None]
    return outbox, inbox


@triton.jit
def one_shot_push_send(
    inp_ptr, outbox, n_vec, pid, nprog, WORLD: tl.constexpr, DT: tl.constexpr, BLOCK_V: tl.constexpr
):  # fmt: skip
    """Store this program's blocks of the input, sanitized, through `outbox` (to every rank)."""
    ranks = tl.arange(0, WORLD)
    BLOCK_W: tl.constexpr = BLOCK_V * WORDS_PER_VECTOR
    lanes = tl.arange(0, BLOCK_W)[None, :]
    n_words = n_vec * WORDS_PER_VECTOR
    for start in range(pid * BLOCK_V, n_vec, nprog * BLOCK_V):
        offs = start * WORDS_PER_VECTOR + lanes
        mask = (offs < n_words) & (ranks[:, None] >= 0)
        words = sanitize(tl.load(inp_ptr + offs, mask=offs < n_words), DT)
        tl.store(outbox + offs, tl.broadcast_to(words, [WORLD, BLOCK_W]), mask=mask)


@triton.jit
def one_shot_push_sum(
    out_ptr, inbox, status_ptr, give_up, n_vec, timeout_ns, pid, nprog,
    WORLD: tl.constexpr, DT: tl.constexpr, BLOCK_V: tl.constexpr, OP: tl.constexpr,
):  # fmt: skip
    """Per block of this program: wait for the W slots of `inbox`, store their sum in rank order to
    out, reset them to SENTINEL."""
    ranks = tl.arange(0, WORLD)
    BLOCK_W: tl.constexpr = BLOCK_V * WORDS_PER_VECTOR
    lanes = tl.arange(0, BLOCK_W)[None, :]
    n_words = n_vec * WORDS_PER_VECTOR
    for start in range(pid * BLOCK_V, n_vec, nprog * BLOCK_V):
        offs = start * WORDS_PER_VECTOR + lanes
        mask = (offs < n_words) & (ranks[:, None] >= 0)
        words, pending = wait_for_words(inbox + offs, mask, give_up, timeout_ns, WORLD)
        give_up = _note_timeout(pending, give_up, status_ptr, OP, 0, WORLD)
        tl.store(out_ptr + offs, sum_rows(words, WORLD, DT)[None, :], mask=offs < n_words)
        tl.store(inbox + offs, tl.full([WORLD, BLOCK_W], SENTINEL, tl.int32), mask=mask)


@triton.jit
def _one_shot_push_kernel(
    inp_ptr, out_ptr, buf_ptrs, epoch_ptr, status_ptr,
    n_vec, base_vecs, slot_vecs, timeout_ns,
    RANK: tl.constexpr, WORLD: tl.constexpr, DT: tl.constexpr, BLOCK_V: tl.constexpr, OP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    set_ = load_epoch(epoch_ptr, pid)
    outbox, inbox = one_shot_push_ptrs(buf_ptrs, set_, base_vecs, slot_vecs, RANK, WORLD)
    # All stores first, then all waits: no wait of any program depends on a store queued after it.
    one_shot_push_send(inp_ptr, outbox, n_vec, pid, nprog, WORLD, DT, BLOCK_V)
    give_up = _timed_out_before(status_ptr)
    one_shot_push_sum(
        out_ptr, inbox, status_ptr, give_up, n_vec, timeout_ns, pid, nprog, WORLD, DT, BLOCK_V, OP
    )
    _next_set(epoch_ptr, pid, set_)


@triton.jit
def two_shot_push_ptrs(
    buf_ptrs, set_, base_vecs, slot_vecs, chunk_vecs, RANK: tl.constexpr, WORLD: tl.constexpr
):  # fmt: skip
    """(to_reduce, to_gather, reduce_in, gather_in) [WORLD, 1] int32 pointers. Row r: rank r's reduce
    slot [RANK] (where chunk r of this input goes) / gather slot [RANK]; this rank's reduce slot [r]
    (rank r's part of chunk RANK) / gather slot [r] (chunk r)."""
    ranks = tl.arange(0, WORLD)
    peers = _rank_words(buf_ptrs, ranks, base_vecs)
    mine = _rank_words(buf_ptrs, RANK, base_vecs)
    to_reduce = (peers + reduce_slot(set_, RANK, WORLD, slot_vecs, chunk_vecs))[:, None]
    to_gather = (peers + gather_slot(set_, RANK, WORLD, slot_vecs, chunk_vecs))[:, None]
    reduce_in = (mine + reduce_slot(set_, ranks, WORLD, slot_vecs, chunk_vecs))[:, None]
    gather_in = (mine + gather_slot(set_, ranks, WORLD, slot_vecs, chunk_vecs))[:, None]
    return to_reduce, to_gather, reduce_in, gather_in


# Word k of a chunk: word k of a slot, word r * chunk_words + k of the message for chunk r.


@triton.jit
def two_shot_push_send(
    inp_ptr, to_reduce, n_vec, pid, nprog, WORLD: tl.constexpr, DT: tl.constexpr, BLOCK_V: tl.constexpr
):  # fmt: skip
    """Store this program's positions of chunk r of the input, sanitized, through row r of `to_reduce`."""
    rows = tl.arange(0, WORLD)[:, None]
    BLOCK_W: tl.constexpr = BLOCK_V * WORDS_PER_VECTOR
    lanes = tl.arange(0, BLOCK_W)[None, :]
    n_words = n_vec * WORDS_PER_VECTOR
    chunk = (n_vec + WORLD - 1) // WORLD  # vectors per rank's chunk; the last may be short
    chunk_words = chunk * WORDS_PER_VECTOR
    for start in range(pid * BLOCK_V, chunk, nprog * BLOCK_V):
        k = start * WORDS_PER_VECTOR + lanes
        mask = (k < chunk_words) & (rows * chunk_words + k < n_words)
        words = sanitize(tl.load(inp_ptr + rows * chunk_words + k, mask=mask), DT)
        tl.store(to_reduce + k, words, mask=mask)


@triton.jit
def two_shot_push_reduce(
    to_gather, reduce_in, status_ptr, give_up, n_vec, timeout_ns, pid, nprog,
    RANK: tl.constexpr, WORLD: tl.constexpr, DT: tl.constexpr, BLOCK_V: tl.constexpr, OP: tl.constexpr,
):  # fmt: skip
    """Per block of this program's positions of chunk RANK: wait for the W reduce slots of `reduce_in`,
    store their sum in rank order through `to_gather` (to every rank), reset them to SENTINEL. Returns
    the updated give_up flag."""
    rows = tl.arange(0, WORLD)[:, None]
    BLOCK_W: tl.constexpr = BLOCK_V * WORDS_PER_VECTOR
    lanes = tl.arange(0, BLOCK_W)[None, :]
    n_words = n_vec * WORDS_PER_VECTOR
    chunk = (n_vec + WORLD - 1) // WORLD
    chunk_words = chunk * WORDS_PER_VECTOR
    sentinels = tl.full([WORLD, BLOCK_W], SENTINEL, tl.int32)
    for start in range(pid * BLOCK_V, chunk, nprog * BLOCK_V):
        k = start * WORDS_PER_VECTOR + lanes
        mask = (k < chunk_words) & (RANK * chunk_words + k < n_words) & (rows >= 0)
        words, pending = wait_for_words(reduce_in + k, mask, give_up, timeout_ns, WORLD)
        give_up = _note_timeout(pending, give_up, status_ptr, OP, 0, WORLD)
        # sanitize: a guard, so that nothing this kernel pushes can equal SENTINEL by construction
        reduced = sanitize(sum_rows(words, WORLD, DT), DT)
        tl.store(to_gather + k, tl.broadcast_to(reduced[None, :], [WORLD, BLOCK_W]), mask=mask)
        tl.store(reduce_in + k, sentinels, mask=mask)
    return give_up


@triton.jit
def two_shot_push_gather(
    out_ptr, gather_in, status_ptr, give_up, n_vec, timeout_ns, pid, nprog,
    WORLD: tl.constexpr, BLOCK_V: tl.constexpr, OP: tl.constexpr,
):  # fmt: skip
    """Per block of this program's positions of every chunk: wait for the W gather slots of
    `gather_in`, copy chunk r to out, reset them to SENTINEL."""
    rows = tl.arange(0, WORLD)[:, None]
    BLOCK_W: tl.constexpr = BLOCK_V * WORDS_PER_VECTOR
    lanes = tl.arange(0, BLOCK_W)[None, :]
    n_words = n_vec * WORDS_PER_VECTOR
    chunk = (n_vec + WORLD - 1) // WORLD
    chunk_words = chunk * WORDS_PER_VECTOR
    sentinels = tl.full([WORLD, BLOCK_W], SENTINEL, tl.int32)
    for start in range(pid * BLOCK_V, chunk, nprog * BLOCK_V):
        k = start * WORDS_PER_VECTOR + lanes
        mask = (k < chunk_words) & (rows * chunk_words + k < n_words)
        words, pending = wait_for_words(gather_in + k, mask, give_up, timeout_ns, WORLD)
        give_up = _note_timeout(pending, give_up, status_ptr, OP, 1, WORLD)
        tl.store(out_ptr + rows * chunk_words + k, words, mask=mask)
        tl.store(gather_in + k, sentinels, mask=mask)


@triton.jit
def _two_shot_push_kernel(
    inp_ptr, out_ptr, buf_ptrs, epoch_ptr, status_ptr,
    n_vec, base_vecs, slot_vecs, chunk_vecs, timeout_ns,
    RANK: tl.constexpr, WORLD: tl.constexpr, DT: tl.constexpr, BLOCK_V: tl.constexpr, OP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    set_ = load_epoch(epoch_ptr, pid)
    to_reduce, to_gather, reduce_in, gather_in = two_shot_push_ptrs(
        buf_ptrs, set_, base_vecs, slot_vecs, chunk_vecs, RANK, WORLD
    )
    two_shot_push_send(inp_ptr, to_reduce, n_vec, pid, nprog, WORLD, DT, BLOCK_V)
    give_up = _timed_out_before(status_ptr)
    give_up = two_shot_push_reduce(
        to_gather, reduce_in, status_ptr, give_up, n_vec, timeout_ns, pid, nprog, RANK, WORLD, DT, BLOCK_V, OP
    )
    two_shot_push_gather(
        out_ptr, gather_in, status_ptr, give_up, n_vec, timeout_ns, pid, nprog, WORLD, BLOCK_V, OP
    )
    _next_set(epoch_ptr, pid, set_)


def launch_push_all_reduce(
    buf: SymmBuffer,
    layout: PushLayout,
    inp: torch.Tensor,
    out: torch.Tensor,
    algo: str,
    num_warps: int,
    num_blocks: int,
    timeout_ns: int,
) -> torch.Tensor:
    """Sum `inp` over `buf`'s group into `out` with the one-shot or two-shot push kernel. `buf` is the
    push buffer laid out by `layout`, every word SENTINEL outside calls (CustomAllReduce fills it)."""
    if algo not in PUSH_ALGORITHMS:
        raise ValueError(f"algo must be one of {PUSH_ALGORITHMS}, got {algo!r}")
    if inp.dtype not in SUPPORTED_DTYPES or out.dtype != inp.dtype:
        raise ValueError(f"dtype {inp.dtype} (out {out.dtype}) not in {SUPPORTED_DTYPES}")
    if not (inp.is_contiguous() and out.is_contiguous()) or out.numel() != inp.numel():
        raise ValueError("inp and out must be contiguous with the same number of elements")
    nbytes = inp.numel() * inp.element_size()
    if nbytes % VECTOR_BYTES or nbytes > layout.slot_bytes:
        raise ValueError(
            f"{nbytes} bytes: the push kernels take multiples of 16 bytes up to {layout.slot_bytes} "
            "(raise push_max_size, or use one_shot / two_shot)"
        )
    if layout.world_size != buf.world_size or layout.total_bytes > buf.nbytes:
        raise ValueError(
            f"push layout for {layout.world_size} ranks, {layout.total_bytes} bytes does not fit the "
            f"buffer of {buf.world_size} ranks, {buf.nbytes} bytes"
        )
    if inp.data_ptr() % 16 or out.data_ptr() % 16 or buf.base_offset % 16:
        raise ValueError("inp, out and the push buffer must be 16-byte aligned")
    if not 1 <= num_blocks <= MAX_PROGRAMS.value:
        raise ValueError(f"num_blocks must be in 1..{MAX_PROGRAMS.value}, got {num_blocks}")
    if nbytes == 0:
        return out
    common = (
        inp.reshape(-1).view(torch.int32),
        out.view(-1).view(torch.int32),
        buf.buffer_ptrs_dev,
        buf.epoch,
        buf.status,
        nbytes // VECTOR_BYTES,
        buf.base_offset // VECTOR_BYTES,
        layout.slot_bytes // VECTOR_BYTES,
    )
    meta = dict(RANK=buf.rank, WORLD=buf.world_size, DT=TRITON_DTYPES[inp.dtype], BLOCK_V=num_warps * 32)
    if algo == "one_shot_push":
        launch(
            _one_shot_push_kernel,
            (num_blocks,),
            *common,
            timeout_ns,
            **meta,
            OP=ONE_SHOT_PUSH_OP,
            num_warps=num_warps,
        )
    else:
        launch(
            _two_shot_push_kernel,
            (num_blocks,),
            *common,
            layout.chunk_bytes // VECTOR_BYTES,
            timeout_ns,
            **meta,
            OP=TWO_SHOT_PUSH_OP,
            num_warps=num_warps,
        )
    return out


def all_reduce_reference(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The stock path: a copy of `x` summed with `dist.all_reduce` (NCCL on GPU, gloo on CPU)."""
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out
