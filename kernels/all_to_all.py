"""The Ulysses all-to-all over symmetric memory, in Triton, and the stock reference.

    q2, k2, v2 = seq_to_heads([q, k, v], group)   # each [B, H, S/W, D] -> [B, H/W, S, D], one launch
    [o] = heads_to_seq([o2], group)               # [B, H/W, S, D] -> [B, H, S/W, D]

`seq_to_heads` turns "every head, my S/W positions" into "my H/W heads, all S positions" (rank r gets
heads [r H/W, (r+1) H/W), positions in rank order); `heads_to_seq` is its inverse. A tensor with fewer
heads than ranks (grouped-query key/value heads) is replicated by `seq_to_heads`: rank r gets head
r H/W of the input (`repeat_interleave` semantics) and the kernel reads that source head once per
destination instead of materialising the repeat. `heads_to_seq` never sums: the gradient of a
replicated head is summed by the caller (parallel/ulysses.py).

Layouts. Inputs are read through their strides (the model's q is a [B, H, S/W, D] transpose view of a
[B, S/W, H, D] projection); only the head dim must be contiguous. Outputs are fresh tensors whose
memory is [B, S, H/W, D] (seq_to_heads) or [B, S/W, H, D] (heads_to_seq), returned as the
[B, heads, seq, D] transpose views the attention function and the model expect.

Index maps. Both directions are a list of rows on the sending rank: row i = (b, s) over B * S/W, and
for destination d its segment of HL * D elements (HL heads per rank on the heads side). The segment
lands contiguously at output row `dest_row(i, src)` of the destination's output viewed as
[rows, HL * D]:
    seq_to_heads: source x[b, (d HL + h) // rep, s, :]       -> row (b W + src) S/W + s  of [B S, HL D]
    heads_to_seq: source x[b, h, d S/W + s, :]               -> row i W + src            of [B S/W W, HL D]

One call (every rank runs the same grid; program p has the same rows on every rank):
    for each chunk k of program p's rows (blocks p, p + P, p + 2P, ... of `block_rows` rows):
        push: for each peer d (program p starting at rank+1+p%(W-1), `rotate_peers`; at rank+1 without
              it): load the segments, store them into d's symmetric buffer at their final output
              offset (remote 16-byte stores over NVLink); then this rank's own segments straight into
              its output
        copy-out of chunk k-1: wait for flag (p, src, k-1) of every peer src, copy what src pushed
              from this rank's buffer to the output (local HBM copy, overlapping the pushes of k)
        signal: flag (p, rank, k) = epoch + 1 in every peer's buffer (release, system scope)
    copy-out of the last chunk
So the layout change costs no pass of its own: the only copy besides the NVLink stores is the
destination's copy-out, pipelined one chunk behind the pushes.

Buffer: one symmetric allocation per (group, size class): [flags | image 0 | image 1], each image half
of the space after the flags. An image has the layout of the call's outputs; call n uses image n & 1
(the buffer's epoch parity), so no exit
barrier: a peer writes image n & 1 again in call n + 2, which it starts after its call n + 1 saw this
rank's flags of call n + 1, i.e. after this rank finished call n (every call waits on every peer).
Flags (int32, zeroed once) are written with epoch + 1 and only grow; the epoch, status word and
bounded waits are kernels/symm_mem.py's. The first call of a size class allocates (collective, not
capturable), and a new shape may compile the kernel: make one eager call of each shape before
capturing a CUDA graph (`prepare` allocates, but compiles nothing).

What runs where: the kernel for CUDA tensors of bf16/fp16/fp32 with 16-byte head rows on 2, 4 or 8
ranks; the reference for other well-formed inputs (`fallback_reason` says why); an error otherwise.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels.launch import launch
from kernels.symm_mem import (
    DEFAULT_TIMEOUT_S,
    MAX_PROGRAMS,
    MAX_WORLD,
    SymmBuffer,
    advance_epoch,
    check_status,
    eager_or_op,
    get_symm_buffer,
    load_epoch,
    op_id,
    resolve_group,
    size_class,
    sm_count,
    wait_flag,
    warn_fallback,
)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_WORLD_SIZES = (2, 4, 8)
MAX_TENSORS = 3  # q, k, v
VECTOR_BYTES = 16
MAX_CHUNKS = tl.constexpr(64)  # chunks per program: flags per (program, source rank)
FLAG_BYTES = tl.constexpr(MAX_PROGRAMS.value * MAX_WORLD.value * MAX_CHUNKS.value * 4)
IMAGE_ALIGN = 256
# The pipeline: a program's rows are cut into about TARGET_CHUNKS chunks (the last chunk's copy-out is
# the part not hidden behind pushes), each of at least MIN_CHUNK_BYTES (every chunk costs a release of
# its flags, which waits for its remote stores). On 4x H100 (earlier all_to_all-h100-x4.md, sweep of
# q/k/v at S = 32768) 8 chunks were fastest at H = 32 in two runs (0.333 ms against 0.406 at 16), and
# at H = 8, where 16 KiB chunks made 8 of them, one chunk of 126 KiB took 0.159 ms against 0.199.
TARGET_CHUNKS = 8
MIN_CHUNK_BYTES = 64 << 10
BUFFER_TAG = "all_to_all"
SEQ_TO_HEADS_OP = op_id("all_to_all seq_to_heads")
HEADS_TO_SEQ_OP = op_id("all_to_all heads_to_seq")


# ------------------------------------------------------------------------------------------ device


@triton.jit
def source_row_offsets(i, d, seq_local, strides, VEC: tl.constexpr, SEQ_TO_HEADS: tl.constexpr):
    """int64 element offset in the input of row i's segment bound for rank d, up to the head term.
    `strides` count 16-byte vectors, so the compiler sees every offset as a whole vector."""
    b = (i // seq_local).to(tl.int64)
    s = i % seq_local
    seq = s if SEQ_TO_HEADS else d * seq_local + s
    return (b * strides[0] + seq.to(tl.int64) * strides[2]) * VEC


@triton.jit
def source_col_offsets(
    x, d, strides, HEADS: tl.constexpr, REP: tl.constexpr, HEAD_DIM: tl.constexpr, VEC: tl.constexpr,
    SEQ_TO_HEADS: tl.constexpr,
):  # fmt: skip
    """int64 element offset of element x (of HEADS * HEAD_DIM) of a segment bound for rank d, relative to
    its row: seq_to_heads reads input head (d HEADS + h) // REP (REP > 1: a replicated head)."""
    h = x // HEAD_DIM
    head = (d * HEADS + h) // REP if SEQ_TO_HEADS else h
    return head.to(tl.int64) * strides[1] * VEC + x % HEAD_DIM


@triton.jit
def dest_row_offsets(
    i, src, seq_local, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, WORLD: tl.constexpr,
    SEQ_TO_HEADS: tl.constexpr,
):  # fmt: skip
    """int64 element offset in the output (and in the buffer image) of row i's segment from rank src:
    output row (b W + src) S/W + s of [B S, HEADS D] (seq_to_heads), i W + src of [B S/W W, HEADS D]."""
    row = (i // seq_local * WORLD + src) * seq_local + i % seq_local if SEQ_TO_HEADS else i * WORLD + src
    return row.to(tl.int64) * (HEADS * HEAD_DIM)


@triton.jit
def _image_base(buf_ptrs, r, byte_offset, DT: tl.constexpr):
    """Rank r's buffer base + byte_offset, as a 16-byte aligned pointer to DT."""
    base = tl.load(buf_ptrs.to(tl.pointer_type(tl.uint64)) + r).to(tl.int64) + byte_offset
    return tl.multiple_of(base.to(tl.pointer_type(DT)), 16)


@triton.jit
def push_tile(
    src_ptr, strides, dst_ptr, row0, r0, block_rows, n_rows, seq_local, d,
    RANK: tl.constexpr, HEADS: tl.constexpr, REP: tl.constexpr, HEAD_DIM: tl.constexpr, VEC: tl.constexpr,
    WORLD: tl.constexpr, SEQ_TO_HEADS: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """One tile of rows [row0 + r0, row0 + r0 + ROWS) of one tensor (inside the block of `block_rows`),
    the segments bound for rank d: from the input to their final offsets under `dst_ptr` (d's buffer
    image, or this rank's output when d == RANK). A tile is [TILE / COLS rows, COLS elements]; a
    segment's row is contiguous at the destination and HEAD_DIM-contiguous at the source, moved as
    16-byte vectors."""
    NCOLS: tl.constexpr = HEADS * HEAD_DIM
    COLS: tl.constexpr = triton.next_power_of_2(NCOLS)
    ROWS: tl.constexpr = max(1, TILE // COLS)
    x = tl.arange(0, COLS)
    src_cols = source_col_offsets(x, d, strides, HEADS, REP, HEAD_DIM, VEC, SEQ_TO_HEADS)
    col_ok = x < NCOLS
    r = r0 + tl.arange(0, ROWS)
    i = row0 + r
    row_ok = (r < block_rows) & (i < n_rows)
    src_rows = source_row_offsets(i, d, seq_local, strides, VEC, SEQ_TO_HEADS)
    dst_rows = dest_row_offsets(i, RANK, seq_local, HEADS, HEAD_DIM, WORLD, SEQ_TO_HEADS)
    mask = row_ok[:, None] & col_ok[None, :] if COLS != NCOLS else row_ok[:, None]
    v = tl.load(src_ptr + (src_rows[:, None] + src_cols[None, :]), mask=mask)
    tl.store(dst_ptr + (dst_rows[:, None] + x[None, :]), v, mask=mask)


@triton.jit
def push_block(
    ins, strides, outs, image_offsets, buf_ptrs, image, row0, block_rows, n_rows, seq_local,
    HEADS: tl.constexpr, REPS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
    HEAD_DIM: tl.constexpr, VEC: tl.constexpr, SEQ_TO_HEADS: tl.constexpr, TILE: tl.constexpr,
    ROTATE: tl.constexpr,
):  # fmt: skip
    """Rows [row0, row0 + block_rows) of every tensor, each segment to its destination: the peers' buffer
    images (rank d's: `image` bytes past the address at `buf_ptrs[d]`), then this rank's own segments,
    straight into `outs`. Peers in turn from rank + 1, so that at any moment the ranks push to different
    peers; with ROTATE, program p starts at peer rank + 1 + p % (W - 1), so that a rank's programs also
    push to all its peers at once (launch_all_to_all's `rotate_peers`)."""
    NT: tl.constexpr = len(ins)
    DT: tl.constexpr = outs[0].dtype.element_ty
    first = tl.program_id(0) % (WORLD - 1) if ROTATE else 0
    for t in tl.static_range(NT):
        tile_rows = max(1, TILE // triton.next_power_of_2(HEADS[t] * HEAD_DIM))
        for j in tl.static_range(1, WORLD + 1):
            if j == WORLD:
                d = RANK
                dst = outs[t]
            else:
                d = (RANK + 1 + (first + j - 1) % (WORLD - 1)) % WORLD
                dst = _image_base(buf_ptrs, d, image, DT) + image_offsets[t]
            for r0 in range(0, block_rows, tile_rows):
                push_tile(
                    ins[t], strides[t], dst, row0, r0, block_rows, n_rows, seq_local, d,
                    RANK, HEADS[t], REPS[t], HEAD_DIM, VEC, WORLD, SEQ_TO_HEADS, TILE,
                )  # fmt: skip


@triton.jit
def copy_out_rows(
    image_ptr, out_ptr, row0, block_rows, n_rows, seq_local, src_rank,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, VEC: tl.constexpr, WORLD: tl.constexpr,
    SEQ_TO_HEADS: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """The segments rank src_rank pushed for rows [row0, row0 + block_rows): image -> output, same
    offsets."""
    NCOLS: tl.constexpr = HEADS * HEAD_DIM
    COLS: tl.constexpr = triton.next_power_of_2(NCOLS)
    ROWS: tl.constexpr = max(1, TILE // COLS)
    x = tl.arange(0, COLS)
    col_ok = x < NCOLS
    for r0 in range(0, block_rows, ROWS):
        r = r0 + tl.arange(0, ROWS)
        i = row0 + r
        row_ok = (r < block_rows) & (i < n_rows)
        mask = row_ok[:, None] & col_ok[None, :] if COLS != NCOLS else row_ok[:, None]
        rows = dest_row_offsets(i, src_rank, seq_local, HEADS, HEAD_DIM, WORLD, SEQ_TO_HEADS)
        offs = rows[:, None] + x[None, :]
        tl.store(out_ptr + offs, tl.load(image_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _flag_index(pid, src, chunk):
    return (pid * MAX_WORLD + src) * MAX_CHUNKS + chunk


@triton.jit
def _all_to_all_kernel(
    ins, strides, outs, image_offsets,
    buf_ptrs, base_offset, image_stride, epoch_ptr, status_ptr,
    n_rows, seq_local, block_rows, timeout_ns,
    HEADS: tl.constexpr, REPS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
    HEAD_DIM: tl.constexpr, VEC: tl.constexpr, SEQ_TO_HEADS: tl.constexpr, TILE: tl.constexpr,
    OP: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    NT: tl.constexpr = len(ins)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = load_epoch(epoch_ptr, pid)
    DT: tl.constexpr = outs[0].dtype.element_ty
    image = base_offset + FLAG_BYTES + (epoch & 1).to(tl.int64) * image_stride
    n_chunks = tl.cdiv(tl.cdiv(n_rows, block_rows) - pid, nprog)
    my_flags = (tl.load(buf_ptrs.to(tl.pointer_type(tl.uint64)) + RANK).to(tl.int64) + base_offset).to(
        tl.pointer_type(tl.int32)
    )
    mine = _image_base(buf_ptrs, RANK, image, DT)
    ranks = tl.arange(0, WORLD)
    peer_flags = tl.load(buf_ptrs.to(tl.pointer_type(tl.uint64)) + ranks).to(tl.int64) + base_offset
    peer_flags = peer_flags.to(tl.pointer_type(tl.int32))
    for k in range(n_chunks + 1):
        if k < n_chunks:
            push_block(
                ins, strides, outs, image_offsets, buf_ptrs, image, (k * nprog + pid) * block_rows,
                block_rows, n_rows, seq_local, HEADS, REPS, RANK, WORLD, HEAD_DIM, VEC, SEQ_TO_HEADS, TILE,
                ROTATE,
            )  # fmt: skip
        if k > 0:
            prev = (k - 1) * nprog + pid
            for j in tl.static_range(1, WORLD):
                src = (RANK + WORLD - j) % WORLD
                wait_flag(
                    my_flags + _flag_index(pid, src, k - 1), epoch + 1, status_ptr, OP, k - 1, src, timeout_ns
                )
                for t in tl.static_range(NT):
                    copy_out_rows(
                        mine + image_offsets[t], outs[t], prev * block_rows, block_rows, n_rows, seq_local,
                        src, HEADS[t], HEAD_DIM, VEC, WORLD, SEQ_TO_HEADS, TILE,
                    )  # fmt: skip
        if k < n_chunks:
            # Every thread's pushes of chunk k are issued before the flags that announce them.
            tl.debug_barrier()
            tl.atomic_xchg(
                peer_flags + _flag_index(pid, RANK, k),
                tl.full([WORLD], 0, tl.int32) + epoch + 1,
                mask=ranks != RANK,
                sem="release",
                scope="sys",
            )
    advance_epoch(epoch_ptr, pid, epoch)


# -------------------------------------------------------------------------------------------- host


def output_shape(shape: Sequence[int], world: int, seq_to_heads: bool) -> tuple[int, int, int, int]:
    """[B, heads, seq, D] of the result for an input of `shape`; replicated heads counted as received."""
    bsz, heads, seq, dim = shape
    if seq_to_heads:
        return bsz, max(heads, world) // world, seq * world, dim
    return bsz, heads * world, seq // world, dim


def check_inputs(xs: Sequence[torch.Tensor], world: int, seq_to_heads: bool) -> None:
    """Raise ValueError (saying what to change) when no path can exchange `xs` over `world` ranks."""
    name = "seq_to_heads" if seq_to_heads else "heads_to_seq"
    if not 1 <= len(xs) <= MAX_TENSORS:
        raise ValueError(f"{name}: takes 1 to {MAX_TENSORS} tensors (q, k, v), got {len(xs)}")
    first = xs[0]
    for n, x in enumerate(xs):
        if x.dim() != 4:
            raise ValueError(f"{name}: tensor {n} has shape {tuple(x.shape)}; expected [B, heads, seq, D]")
        if x.dtype != first.dtype or x.device != first.device:
            raise ValueError(
                f"{name}: tensor {n} is {x.dtype} on {x.device}, tensor 0 {first.dtype} on {first.device}: "
                "exchange tensors of one dtype and device together"
            )
        if (x.shape[0], x.shape[2], x.shape[3]) != (first.shape[0], first.shape[2], first.shape[3]):
            raise ValueError(
                f"{name}: tensor {n} has shape {tuple(x.shape)}, tensor 0 {tuple(first.shape)}: batch, seq "
                "and head dim must match (only the head counts may differ)"
            )
        heads = x.shape[1]
        if seq_to_heads and heads % world and world % heads:
            raise ValueError(
                f"{name}: tensor {n} has {heads} heads, which neither divide nor are divisible by the "
                f"{world} ranks: choose another parallel.cp"
            )
        if not seq_to_heads and x.shape[2] % world:
            raise ValueError(
                f"{name}: tensor {n} has sequence length {x.shape[2]}, not divisible by the {world} ranks"
            )


def fallback_reason(xs: Sequence[torch.Tensor], world: int) -> str | None:
    """Why the kernel cannot run these (well-formed) inputs and the reference must, or None."""
    x = xs[0]
    if world not in SUPPORTED_WORLD_SIZES:
        return f"world size {world} (the kernel serves {SUPPORTED_WORLD_SIZES})"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} (the kernel serves {SUPPORTED_DTYPES})"
    if x.shape[3] * x.element_size() % VECTOR_BYTES:
        return f"head dim {x.shape[3]} is not a whole number of 16-byte vectors"
    return None


def readable(x: torch.Tensor) -> bool:
    """True when the kernel reads `x` in place: 16-byte aligned, contiguous head dim, every other
    stride a whole number of 16-byte vectors (the stride of a dimension of size 1 is never used)."""
    vec = VECTOR_BYTES // x.element_size()
    strides = all(s % vec == 0 for size, s in zip(x.shape[:3], x.stride()[:3], strict=True) if size > 1)
    return x.stride(3) == 1 and strides and x.data_ptr() % VECTOR_BYTES == 0


def vector_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """The kernel's view of a `readable` [B, H, S, D] input: its first three strides in 16-byte
    vectors, 0 for a dimension of size 1."""
    vec = VECTOR_BYTES // x.element_size()
    return tuple(s // vec if size > 1 else 0 for size, s in zip(x.shape[:3], x.stride()[:3], strict=True))


def new_output(shape: Sequence[int], seq_to_heads: bool, like: torch.Tensor) -> torch.Tensor:
    """A [B, heads, seq, D] tensor whose memory is [B, seq, heads, D] (the layout the kernel writes)."""
    bsz, heads, seq, dim = shape
    return torch.empty_strided(
        (bsz, heads, seq, dim), (seq * heads * dim, dim, heads * dim, 1), dtype=like.dtype, device=like.device
    )


def image_layout(shapes: Sequence[Sequence[int]], itemsize: int) -> tuple[list[int], int]:
    """Element offsets of each output inside a buffer image, and the image's bytes (256-byte aligned)."""
    offsets, nbytes = [], 0
    for shape in shapes:
        offsets.append(nbytes // itemsize)
        nbytes += -(-math.prod(shape) * itemsize // IMAGE_ALIGN) * IMAGE_ALIGN
    return offsets, nbytes


def buffer_bytes(image_bytes: int) -> int:
    """Bytes of the symmetric buffer for images of `image_bytes`: flags + two images."""
    return FLAG_BYTES.value + 2 * image_bytes


def image_stride(buffer_nbytes: int) -> int:
    """Bytes from image 0 to image 1 in a buffer of `buffer_nbytes`: half the space after the flags,
    fixed per buffer, so calls of any size on one buffer never overlap the other parity's image."""
    return (buffer_nbytes - FLAG_BYTES.value) // 2 // IMAGE_ALIGN * IMAGE_ALIGN


def schedule(n_rows: int, row_bytes: int, max_programs: int, chunks: int = TARGET_CHUNKS) -> tuple[int, int]:
    """(block_rows, programs): rows per block (one chunk of a program) and the grid. About `chunks`
    chunks per program, each of at least MIN_CHUNK_BYTES, never more than MAX_CHUNKS; every program
    gets at least one block. Pure: CPU-testable."""
    if min(n_rows, row_bytes, max_programs, chunks) < 1:
        raise ValueError(
            f"need positive rows, row bytes, programs and chunks, got {n_rows}, {row_bytes}, {max_programs}, "
            f"{chunks}"
        )
    programs = min(max_programs, MAX_PROGRAMS.value)
    rows_per_program = -(-n_rows // programs)
    block_rows = max(-(-rows_per_program // min(chunks, MAX_CHUNKS.value)), -(-MIN_CHUNK_BYTES // row_bytes))
    block_rows = min(block_rows, n_rows)
    return block_rows, min(programs, -(-n_rows // block_rows))


# (group name, tag, id) -> the buffers whose flags this module has zeroed (weak: kernels/symm_mem.py's
# cache owns them, and a buffer freed with its group leaves this table too).
_READY: weakref.WeakValueDictionary[tuple[str, str, int], SymmBuffer] = weakref.WeakValueDictionary()


def prepare(group: dist.ProcessGroup, image_bytes: int, tag: str = BUFFER_TAG) -> SymmBuffer:
    """The symmetric buffer for outputs of up to `image_bytes` bytes, allocated and its flags zeroed on
    the first use of its size class (collective over `group`, not capturable). Before capturing a CUDA
    graph, make one eager call of each shape instead: it also compiles the kernel."""
    nbytes = buffer_bytes(image_bytes)
    key = (group.group_name, tag, size_class(nbytes))
    if key not in _READY and torch.cuda.is_current_stream_capturing():
        # Checked before get_symm_buffer, whose collective allocation cannot run inside a capture.
        raise RuntimeError(
            f"all_to_all: no symmetric buffer for {nbytes} bytes yet, and allocating one is collective: "
            "make one eager call of this shape before capturing the CUDA graph"
        )
    buf = get_symm_buffer(group, nbytes, tag=tag)
    if key not in _READY:
        buf.tensor[: FLAG_BYTES.value].zero_()
        torch.cuda.synchronize()
        dist.barrier(group=group)  # every rank's flags zeroed before any peer signals
        _READY[key] = buf
    return buf


def check(group: dist.ProcessGroup | None = None, tag: str = BUFFER_TAG) -> None:
    """Raise SymmMemTimeout (naming this rank, the op and the missing peer) if a wait of the all-to-all
    on `group` gave up; synchronizes the device. Call after a CUDA graph replay or in tests."""
    name = (group if group is not None else dist.group.WORLD).group_name
    for (group_name, buf_tag, _), buf in list(_READY.items()):
        if group_name == name and buf_tag == tag:
            check_status(buf, "all_to_all")


def launch_all_to_all(
    buf: SymmBuffer,
    xs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    seq_to_heads: bool,
    timeout_ns: int,
    num_warps: int = 16,
    tile: int = 8192,
    max_programs: int | None = None,
    chunks: int = TARGET_CHUNKS,
    rotate_peers: bool = True,
) -> None:
    """Run the kernel: `outs` (from `new_output`) receive the exchange of `xs` (kernel-`readable`).
    `rotate_peers`: each program starts its pushes at a peer of its own (`push_block`), rather than every
    program at rank + 1. On 4x H100 (all_to_all-h100-x4.md of 2026-11-26 20:39, launch sweep at S = 32768)
    rotation was faster at 46 of 48 settings of programs, warps and chunks (the two others at H = 8, 8
    warps: 174.2 and 178.9 against 178.1 and 179.2 GB/s a rank), and 16 warps faster than 8: at H = 32,
    one program per SM, 16 warps and 4-8 chunks 275.6-278.5 against 252.5 for the launch before (8
    warps, 8 chunks, rank + 1 first); at H = 8 186.8-192.8 against 178.1. The node's floor for such
    pushes is 343 GB/s (push_floor-h100-x4.md). The re-run with aligned ranks (2026-11-27 00:29): rotation
    faster at 34 of 48, the default 293.4 against 291.7 at H = 32."""
    world, rank = buf.world_size, buf.rank
    x0 = xs[0]
    bsz, _, seq_in, dim = x0.shape
    seq_local = seq_in if seq_to_heads else seq_in // world
    vec = VECTOR_BYTES // x0.element_size()
    heads = tuple(o.shape[1] if seq_to_heads else x.shape[1] for x, o in zip(xs, outs, strict=True))
    reps = tuple(
        o.shape[1] * world // x.shape[1] if seq_to_heads else 1 for x, o in zip(xs, outs, strict=True)
    )
    for x in xs:
        if not readable(x):
            raise ValueError(
                f"all_to_all: input of strides {x.stride()} is not readable in place (needs a contiguous, "
                "16-byte aligned head dim and 16-byte multiple strides): pass a fresh contiguous copy"
            )
    for o in outs:
        if not o.is_cuda or o.data_ptr() % VECTOR_BYTES:
            raise ValueError("all_to_all: outputs must be 16-byte aligned CUDA tensors from new_output")
    offsets, image_bytes = image_layout([o.shape for o in outs], x0.element_size())
    stride = image_stride(buf.nbytes)
    if image_bytes > stride:
        raise ValueError(
            f"all_to_all: images of {image_bytes} bytes need a buffer of {buffer_bytes(image_bytes)}"
        )
    n_rows = bsz * seq_local
    if n_rows == 0:
        return
    row_bytes = world * dim * x0.element_size() * sum(heads)
    if max_programs is None:
        max_programs = sm_count(x0.device)
    block_rows, programs = schedule(n_rows, row_bytes, max_programs, chunks)
    launch(
        _all_to_all_kernel, (programs,),
        tuple(xs), tuple(vector_strides(x) for x in xs), tuple(outs), tuple(offsets),
        buf.buffer_ptrs_dev, buf.base_offset, stride, buf.epoch, buf.status,
        n_rows, seq_local, block_rows, timeout_ns,
        HEADS=heads, REPS=reps, RANK=rank, WORLD=world, HEAD_DIM=dim, VEC=vec,
        SEQ_TO_HEADS=seq_to_heads, TILE=tile, OP=SEQ_TO_HEADS_OP if seq_to_heads else HEADS_TO_SEQ_OP,
        ROTATE=rotate_peers, num_warps=num_warps,
    )  # fmt: skip


def all_to_all_kernel(
    xs: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    seq_to_heads: bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    tag: str = BUFFER_TAG,
) -> list[torch.Tensor]:
    """The kernel path (callers check `fallback_reason` first): see the module docstring."""
    world = dist.get_world_size(group)
    # A copy, not x.contiguous(): a contiguous tensor may still be misaligned.
    xs = [x if readable(x) else x.clone(memory_format=torch.contiguous_format) for x in xs]
    outs = [new_output(output_shape(x.shape, world, seq_to_heads), seq_to_heads, x) for x in xs]
    _, image_bytes = image_layout([o.shape for o in outs], xs[0].element_size())
    buf = prepare(group, image_bytes, tag)
    launch_all_to_all(buf, xs, outs, seq_to_heads, int(timeout_s * 1e9))
    return outs


# ---------------------------------------------------------------------------------------- reference


def replicate_heads(x: torch.Tensor, world: int) -> torch.Tensor:
    """x [B, H, ...] with H < world heads repeated (interleaved) to `world`; x itself otherwise."""
    heads = x.shape[1]
    return x if heads >= world else x.repeat_interleave(world // heads, dim=1)


def _all_to_all_single(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def seq_to_heads_reference(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """The stock path: permute into a contiguous buffer, `all_to_all_single`, permute back."""
    world = dist.get_world_size(group)
    check_inputs(xs, world, seq_to_heads=True)
    outs = []
    for x in xs:
        x = replicate_heads(x, world)
        bsz, heads, seq_local, dim = x.shape
        send = x.reshape(bsz, world, heads // world, seq_local, dim).transpose(0, 1).contiguous()
        recv = _all_to_all_single(send, group)
        # recv[src] holds rank src's sequence chunk of our heads: chunks in rank order form the sequence.
        outs.append(recv.permute(1, 2, 0, 3, 4).reshape(bsz, heads // world, world * seq_local, dim))
    return outs


def heads_to_seq_reference(
    xs: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """The inverse stock path: [B, H/W, S, D] -> [B, H, S/W, D] (replicated heads are not summed)."""
    world = dist.get_world_size(group)
    check_inputs(xs, world, seq_to_heads=False)
    outs = []
    for x in xs:
        bsz, heads, seq, dim = x.shape
        send = x.reshape(bsz, heads, world, seq // world, dim).permute(2, 0, 1, 3, 4).contiguous()
        recv = _all_to_all_single(send, group)
        # recv[src] holds our sequence chunk of rank src's heads: head groups in rank order.
        outs.append(recv.transpose(0, 1).reshape(bsz, world * heads, seq // world, dim))
    return outs


# ------------------------------------------------------------------------------ registered op, entry


def _exchange(xs: list[torch.Tensor], group_name: str, seq_to_heads: bool) -> list[torch.Tensor]:
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    check_inputs(xs, world, seq_to_heads)
    if not xs[0].is_cuda:
        raise ValueError(
            f"all_to_all (parallel.comm=triton) needs CUDA tensors, got {xs[0].device}: use "
            "parallel.comm=torch (or seq_to_heads_reference / heads_to_seq_reference) on CPU"
        )
    reason = fallback_reason(xs, world) if world > 1 else None
    if world > 1 and reason is None:
        return all_to_all_kernel(xs, group, seq_to_heads)
    if reason is not None:
        warn_fallback("seq_to_heads" if seq_to_heads else "heads_to_seq", reason)
    reference = seq_to_heads_reference if seq_to_heads else heads_to_seq_reference
    results = [x.clone() for x in xs] if world == 1 else reference(xs, group)
    # Every path returns the kernel's memory layout, which the fake op promises to torch.compile.
    outs = [new_output(r.shape, seq_to_heads, r) for r in results]
    for out, result in zip(outs, results, strict=True):
        out.copy_(result)
    return outs


def _fake(xs: list[torch.Tensor], group_name: str, seq_to_heads: bool) -> list[torch.Tensor]:
    world = resolve_group(group_name).size()
    return [new_output(output_shape(x.shape, world, seq_to_heads), seq_to_heads, x) for x in xs]


@torch.library.custom_op("weft::ulysses_seq_to_heads", mutates_args=())
def seq_to_heads_op(xs: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """Registered op: `seq_to_heads` over the group `group_name` (kernel, or reference where
    `fallback_reason` says so)."""
    return _exchange(xs, group_name, seq_to_heads=True)


@seq_to_heads_op.register_fake
def _(xs: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    return _fake(xs, group_name, seq_to_heads=True)


@torch.library.custom_op("weft::ulysses_heads_to_seq", mutates_args=())
def heads_to_seq_op(xs: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """Registered op: `heads_to_seq` over the group `group_name`."""
    return _exchange(xs, group_name, seq_to_heads=False)


@heads_to_seq_op.register_fake
def _(xs: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    return _fake(xs, group_name, seq_to_heads=False)


def seq_to_heads(xs: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Each [B, H, S/W, D] -> [B, max(H, W)/W, S, D] over `group` (default: the world), q, k and v in one
    launch: what parallel/comm.py's triton path calls."""
    group = group if group is not None else dist.group.WORLD
    run = eager_or_op(partial(_exchange, seq_to_heads=True), torch.ops.weft.ulysses_seq_to_heads)
    return run(list(xs), group.group_name)


def heads_to_seq(xs: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Each [B, H/W, S, D] -> [B, H, S/W, D] over `group` (default: the world), in one launch."""
    group = group if group is not None else dist.group.WORLD
    run = eager_or_op(partial(_exchange, seq_to_heads=False), torch.ops.weft.ulysses_heads_to_seq)
    return run(list(xs), group.group_name)


__all__ = [
    "check",
    "check_inputs",
    "fallback_reason",
    "heads_to_seq",
    "heads_to_seq_reference",
    "prepare",
    "schedule",
    "seq_to_heads",
    "seq_to_heads_reference",
]
