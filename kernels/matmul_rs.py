"""Matmul + reduce-scatter (the row-parallel matmul of sequence parallelism) over symmetric memory,
and the reference.

    out = matmul_reduce_scatter(a, b, dim, group)  ==  reduce_scatter(a @ b, dim)   (sum)

`a` holds this rank's K shard of every row; chunk d of `dim` of the summed product goes to rank d. Two
persistent Triton GEMMs (tensor-descriptor loads, i.e. TMA on Hopper) run back to back on the caller's
stream, and one copy stream per peer moves their partials with copy engines:
* the stage launch computes the peers' rows and stores each partial tile into a local staging buffer;
* a copy stream per peer copies each finished chunk of that peer's rows into the peer's symmetric
  buffer, as the chunk completes, and raises the chunk's flag there;
* the own launch, which may start on each SM the first leaves (programmatic dependent launch), finishes
  this rank's own rows, adding the peers' copied partials to its own accumulator.
No SM stores over NVLink: on two H100s the stores that pushed partials straight into the peers'
buffers cost the GEMM 10-15% at K <= 4096, which copy engines take off the SMs. No copy of `a` or of the
weight.

Data layout
-----------
`a` of shape [d0, ..., d_dim, ..., K] is seen as [P, W, R, K]: P = d0 * ... * d_{dim-1} pieces, each
of W blocks of R = d_dim / W * d_{dim+1} * ... rows, block d of every piece bound for rank d. The GEMM
reads A through a 3-D descriptor of the [P * W, R, K] view (row (p, d, r) at index p * W + d); a row
tile never crosses a block (R need not be a multiple of the tile: loads clip, stores are masked). The
output shard, each staging slot and each received slot are [P, R, N]. dim=0 and 2-D `a` are P = 1; the
model's [B, S, K] with dim=1 is P = B, so no permute copy is needed for B > 1.

Tile schedule and chunks
------------------------
W steps of T = P * ceil(R / BM) * ceil(N / BN) tiles: step s computes the rows of destination
(rank + 1 + s) % W, so this rank's own rows come last and, at every moment, every rank's rows are being
computed by some peer. Inside a step the (row tile, column tile) pairs follow a group-M swizzle (GROUP_M
row tiles share their B tiles in L2, and finish together); every rank uses the same order. A chunk is
one such group of GROUP_M row tiles, all their columns: contiguous rows of a [P, R, N] slot (a tile
clips at its piece's end, so consecutive row tiles are consecutive rows even across pieces).

Protocol (per call, rank r; every value is a constant, so a CUDA graph replays it as captured)
------------------------------------------------------------------------------------------------
* Stage launch (steps 0 .. W - 2, program i taking tiles i, i + G, ...): each tile's partial goes to
  staging slot `step`; then every thread adds 1 to the chunk's counter with a release (each thread
  releases its own stores), so a counter at THREADS * tiles of the chunk means the chunk has landed.
  Nothing in it waits, so Triton flattens its persistent and K loops into one pipeline.
* Program 0 of the stage launch first waits (bounded) until every peer granted its credit (its
  previous call has read what r sent it), takes the credits (writes 0) and sets a local `credited`
  word, which the first copy stream waits for; the others wait for that one. (A stream wait on a
  peer's credit would hang for good on a lost peer; this wait gives up.) Then the copy stream of step
  s (destination d), for each chunk: waits for its counter (a stream wait), resets it, copies the
  chunk into slot (r - d) % W - 1 of d's data buffer and writes 1 into that slot's chunk flag in d's
  flag buffer (the write follows the copy with a memory barrier).
* Own launch (step W - 1, program i taking own tiles i, i + G, ...): each tile waits (acquire, bounded,
  branch-free spins so that the loop stays flattened) for the W - 1 flags of its chunk, then adds the
  peers' partials in rank order to its fp32 accumulator and writes the output shard.
* Then, on the caller's stream: this rank's chunk flags are reset to 0 (all its readers have ended),
  a credit is written into every peer's flag buffer, and the stream waits for the copy streams (the
  staging buffer and counters are free again for the next call).
Credits start at 1. A peer writes this rank's data buffer for call e + 1 only after this rank's own
launch of call e ended, so one data buffer suffices, whatever shape each call has. All calls of a group
go through one flag buffer and must be issued on one stream (as for every collective). A wait that times
out records (op, where, missing rank) in the status word (where: 0 for a credit, 1 + the chunk flag's
index) and later waits on the group return at once, so no call hangs on a lost peer; `check(group)`
raises SymmMemTimeout naming the rank; the group's state is then unusable. The stream waits are only
on this rank's own words, which its stage launch always sets.

The host queues the stage launch, then the copy streams' work, then the own launch (as
kernels/ag_matmul.py queues its copies before the GEMM that waits for them): under serialised launches
(CUDA_LAUNCH_BLOCKING=1, some profilers) a launch returns only when its kernel has ended, so an own
launch queued ahead of this rank's copies would spin on copies no host had queued yet, on every rank.
Where ranks share a GPU (parallel/shared_gpu.py), the copies are copies within one device, which run
on the sender's SMs: the own launch then leaves one SM free (`own_programs`).

What runs where (decided here; parallel/comm.py's triton path calls `matmul_reduce_scatter`):
* the kernel: bf16 on CUDA, world size 2, 4 or 8, `dim` not the last, d_dim divisible by W, K and N
  multiples of 8 (TMA row strides), b either a contiguous [K, N] matrix or `weight.t()` of a contiguous
  [N, K] weight (no weight is copied), at most MAX_CHUNKS chunks per slot, and streams not sharing one
  hardware queue (CUDA_DEVICE_MAX_CONNECTIONS other than 1);
* the reference (torch.matmul + reduce_scatter_tensor) for every other well-formed call (another dtype
  or world size, misaligned K or N, ...), `fallback_reason` says why;
* an error for calls no path can run: CPU tensors, mismatched shapes or dtypes, d_dim not divisible by W.
The first call of a size class allocates its buffers (collective; the first call on a group also the
flag buffer), and a new shape may compile the kernels: make one eager call of each shape before
capturing a CUDA graph (`prepare` allocates, but compiles nothing). Memory: (W - 1) / W * M * N * 2 bytes
of symmetric buffer and as much of local staging per rank, each rounded up to a power of two.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import stream_ops
from kernels.ag_matmul import is_kn_layout
from kernels.launch import Launcher, Relaunch
from kernels.launch import launch as launch_kernel
from kernels.symm_mem import (
    DEFAULT_TIMEOUT_S,
    INTERPRETED,
    SymmBuffer,
    check_group,
    check_status,
    eager_or_op,
    get_symm_buffer,
    op_id,
    resolve_group,
    size_class,
    sm_count,
    wait_flag,
    wait_flag_unbranched,
    warn_fallback,
)

SUPPORTED_WORLD_SIZES = (2, 4, 8)
TMA_ALIGN = 8  # bf16 elements per 16 bytes: K and N must be multiples (TMA row strides)
DATA_TAG = "matmul_rs"
FLAG_TAG = "matmul_rs_flags"
FLAG_BUFFER_BYTES = 1 << 20
CREDITS = max(SUPPORTED_WORLD_SIZES)  # int32 words at the flag buffer's start: credit from rank d at d
MAX_CHUNKS = (FLAG_BUFFER_BYTES // 4 - CREDITS) // (max(SUPPORTED_WORLD_SIZES) - 1)  # per received slot
OP = op_id("matmul_reduce_scatter")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # row tiles of a swizzle group, which is also a chunk of the copies
    num_warps: int
    num_stages: int

    @property
    def threads(self) -> int:
        """Threads of a program: each adds 1 to its tile's chunk counter."""
        return self.num_warps * 32


# (largest N, config), first match. 128x256x64 / 8 warps is the wgmma-friendly Hopper tile, with 4
# stages. Narrow outputs get 128x128 tiles so that enough tiles exist to fill the SMs. Refine from
# `torchrun --nproc_per_node=4 benchmarks/bench_matmul_rs.py --sweep`, the GEMM alone from
# `python -m benchmarks.bench_matmul_rs --gemm-alone --sweep` on one GPU. `pick_config` cuts group_m.
CONFIGS: tuple[tuple[int, GemmConfig], ...] = (
    (1024, GemmConfig(128, 128, 64, 8, 8, 4)),
    (1 << 62, GemmConfig(128, 256, 64, 8, 8, 4)),
)


@functools.cache
def pick_config(layout: ScatterLayout) -> GemmConfig:
    """The table's config for the call's output width, its group_m cut so that each destination's rows
    make at least two copy chunks. The last chunk, copied after the stage launch ends, is what the own
    launch waits for: at 8 row tiles per destination one chunk of 8 cost 1.37x the matmul alone, two of
    4 1.15x (4x H100, matmul_rs_sweep-h100-x4.md). More chunks than two gained nothing measurable at
    16 and 32 row tiles and cost the host four driver calls each per peer."""
    cfg = next(cfg for max_n, cfg in CONFIGS if layout.n <= max_n)
    return dataclasses.replace(cfg, group_m=max(1, min(cfg.group_m, layout.row_tiles(cfg) // 2)))


# ------------------------------------------------------------------------------------ layout math


@dataclasses.dataclass(frozen=True)
class Chunk:
    """GROUP_M consecutive row tiles of a slot, all columns: bytes [offset, offset + nbytes) of the
    slot, complete once its counter reached `target` (threads x tiles)."""

    offset: int
    nbytes: int
    target: int


@dataclasses.dataclass(frozen=True)
class ScatterLayout:
    """`a` seen as [pieces, world, rows, k]; the output shard (and each slot) as [pieces, rows, n]."""

    pieces: int
    rows: int  # rows per (piece, destination)
    k: int
    n: int
    world: int

    def row_tiles(self, config: GemmConfig) -> int:
        return self.pieces * triton.cdiv(self.rows, config.block_m)

    def tiles_per_dest(self, config: GemmConfig) -> int:
        return self.row_tiles(config) * triton.cdiv(self.n, config.block_n)

    def slot_numel(self) -> int:
        """Elements of one slot (one source's partial of one destination's rows)."""
        return self.pieces * self.rows * self.n

    def slots_bytes(self) -> int:
        """Bytes of the W - 1 slots of bf16 a rank stages (and receives)."""
        return (self.world - 1) * self.slot_numel() * 2

    def chunk_count(self, config: GemmConfig) -> int:
        return triton.cdiv(self.row_tiles(config), config.group_m)

    def chunks(self, config: GemmConfig) -> list[Chunk]:
        """The chunks of a slot, in schedule order."""
        bm, tiles_per_piece = config.block_m, triton.cdiv(self.rows, config.block_m)
        row_tiles, n_tiles = self.row_tiles(config), triton.cdiv(self.n, config.block_n)

        def first_row(m: int) -> int:
            return m // tiles_per_piece * self.rows + m % tiles_per_piece * bm

        def end_row(m: int) -> int:
            return m // tiles_per_piece * self.rows + min(m % tiles_per_piece * bm + bm, self.rows)

        out = []
        for m0 in range(0, row_tiles, config.group_m):
            m1 = min(m0 + config.group_m, row_tiles) - 1
            row_bytes = self.n * 2
            out.append(
                Chunk(
                    offset=first_row(m0) * row_bytes,
                    nbytes=(end_row(m1) - first_row(m0)) * row_bytes,
                    target=(m1 - m0 + 1) * n_tiles * config.threads,
                )
            )
        return out


def scatter_layout(shape: Sequence[int], dim: int, n: int, world: int) -> ScatterLayout:
    """[P, W, R, K] of an `a` of `shape` whose product is scattered along `dim` over `world` ranks."""
    nd = len(shape)
    if nd < 2:
        raise ValueError(f"a must have at least 2 dims (rows, K), got shape {tuple(shape)}")
    if not -nd <= dim < nd:
        raise ValueError(f"dim {dim} is out of range for a {nd}-d a")
    dim %= nd
    if dim == nd - 1:
        raise ValueError("scattering along the last (K) dim is not a row scatter: pick a row dim")
    if shape[dim] % world:
        raise ValueError(
            f"dim {dim} of a has size {shape[dim]}, which does not split over {world} ranks: pad the "
            f"sequence to a multiple of {world}"
        )
    return ScatterLayout(
        pieces=math.prod(shape[:dim]),
        rows=shape[dim] // world * math.prod(shape[dim + 1 : -1]),
        k=shape[-1],
        n=n,
        world=world,
    )


def output_shape(shape: Sequence[int], dim: int, n: int, world: int) -> list[int]:
    out = list(shape)
    out[dim % len(shape)] //= world
    out[-1] = n
    return out


# ------------------------------------------------------------------------------------ the kernels


@triton.jit
def _tile_coords(tile, tiles_per_dest, row_tiles, n_tiles, RANK: tl.constexpr, WORLD: tl.constexpr,
                 GROUP_M: tl.constexpr):  # fmt: skip
    """tile -> (destination rank, row tile of the destination's rows, column tile). Destinations in
    the order rank + 1, rank + 2, ..., rank; a group-M swizzle inside each."""
    step = tile // tiles_per_dest
    local = tile - step * tiles_per_dest
    dest = (RANK + 1 + step) % WORLD
    in_group = GROUP_M * n_tiles
    first = (local // in_group) * GROUP_M
    group_rows = tl.minimum(row_tiles - first, GROUP_M)
    m = first + (local % in_group) % group_rows
    j = (local % in_group) // group_rows
    return dest, m, j


@triton.jit
def _tile_ptrs(base, piece, row0, n0, rows, n, BM: tl.constexpr, BN: tl.constexpr):
    """Pointers and mask of tile (row0, n0) of piece `piece` of a [pieces, rows, n] tensor at `base`."""
    r = row0 + tl.arange(0, BM)
    c = tl.max_contiguous(tl.multiple_of(n0 + tl.arange(0, BN), BN), BN)
    offs = (piece.to(tl.int64) * rows + r[:, None]) * n + c[None, :]
    return base + offs, (r < rows)[:, None] & (c < n)[None, :]


@triton.jit
def _product(a_desc, b_desc, piece, row0, n0, k_tiles,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, B_KN: tl.constexpr):  # fmt: skip
    """A[piece, row0:+BM, :] @ B[:, n0:+BN] in fp32, split into its left and right column halves (the
    epilogue works on halves: half the registers and layout-conversion scratch). B_KN: B is stored
    [K, N]; otherwise [N, K] (an nn.Linear weight, used transposed)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(k_tiles):
        k = ki * BK
        a = a_desc.load([piece, row0, k]).reshape(BM, BK)
        acc = tl.dot(a, b_desc.load([k, n0]), acc) if B_KN else tl.dot(a, b_desc.load([n0, k]).T, acc)
    return tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _reduce_columns(part, data, slot_numel, piece, row0, n0, rows, n, out_ptr,
                    RANK: tl.constexpr, WORLD: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr):  # fmt: skip
    """Output columns [n0, n0 + BH) of a row tile = this rank's `part`, then the peers' received
    partials in rank order, summed in fp32 into `part` (no second fp32 tile in registers)."""
    ptrs, mask = _tile_ptrs(data, piece, row0, n0, rows, n, BM, BH)
    total = part
    for src in tl.static_range(WORLD):
        if src != RANK:
            slot = (src - RANK + WORLD) % WORLD - 1
            # .cg: read L2, where the peers' copies landed, never a stale L1 line of an earlier call.
            total += tl.load(ptrs + slot * slot_numel, mask=mask, cache_modifier=".cg").to(tl.float32)
    out, out_mask = _tile_ptrs(out_ptr, piece, row0, n0, rows, n, BM, BH)
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_slices(part, data, slot_numel, piece, row0, n0, rows, n, out_ptr, RANK: tl.constexpr,
                   WORLD: tl.constexpr, BM: tl.constexpr, BW: tl.constexpr,
                   SLICES: tl.constexpr):  # fmt: skip
    """`_reduce_columns` of a [BM, BW] column block, in SLICES (a power of two) narrower calls."""
    if SLICES == 1:
        _reduce_columns(part, data, slot_numel, piece, row0, n0, rows, n, out_ptr, RANK, WORLD, BM, BW)
    else:
        left, right = tl.split(tl.permute(tl.reshape(part, (BM, 2, BW // 2)), (0, 2, 1)))
        _reduce_slices(left, data, slot_numel, piece, row0, n0, rows, n, out_ptr, RANK, WORLD, BM, BW // 2,
                       SLICES // 2)  # fmt: skip
        _reduce_slices(right, data, slot_numel, piece, row0, n0 + BW // 2, rows, n, out_ptr, RANK, WORLD, BM,
                       BW // 2, SLICES // 2)  # fmt: skip


@triton.jit
def _geometry(k, rows, n, pieces, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """What both launches derive first: N, the tile counts, a slot's elements and the K steps."""
    # The kernel path has N % TMA_ALIGN (8) == 0. Saying so (an identity there; tl.multiple_of does
    # not reach a scalar argument) keeps stores and reads in 16-byte vectors even where N is not a
    # multiple of 16, the only divisibility Triton infers by itself.
    n = n // 8 * 8
    row_tiles_per_piece = tl.cdiv(rows, BM)
    row_tiles = pieces * row_tiles_per_piece
    n_tiles = tl.cdiv(n, BN)
    tiles_per_dest = row_tiles * n_tiles
    slot_numel = tl.cast(pieces, tl.int64) * rows * n  # int64: slots may exceed 2**31 elements
    return n, row_tiles_per_piece, row_tiles, n_tiles, tiles_per_dest, slot_numel, tl.cdiv(k, BK)


@triton.jit
def _matmul_rs_stage_kernel(
    a_desc, b_desc, staging_ptr, counters_ptr, credits_ptr, credited_ptr, status_ptr, timeout_ns, k, rows,
    n, pieces, chunks,
    RANK: tl.constexpr, WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, B_KN: tl.constexpr, THREADS: tl.constexpr, CREDITS: tl.constexpr,
    OP_ID: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Persistent GEMM over the peers' tiles [0, (W - 1) * T) of `_tile_coords`' order, program i
    taking tiles i, i + G, ...: each tile's partial goes to staging slot `step` (pointer stores: TMA
    stores measured no faster, matmul_rs_gemm-h100.md), then each of the program's THREADS threads adds
    1 to the tile's chunk counter (release: its own stores first). It never waits, so Triton flattens
    the loop: a tile's stores drain while the next tile's loads are in flight. With PDL the own-rows
    launch may take each SM this one leaves. CREDITS: program 0 first waits (bounded, "barrier 0" in
    the status word) until every peer granted its credit, takes them and sets `credited`, which the
    copy streams wait for; a peer's credit only waits for that peer's previous own launch to end."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if CREDITS:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if pid == 0:
            for src in tl.static_range(WORLD):
                if src != RANK:
                    _wait_set(credits_ptr + src, 0, status_ptr, src, timeout_ns, OP_ID)
                    tl.store(credits_ptr + src, 0)
            tl.atomic_xchg(credited_ptr, 1, sem="release", scope="gpu")
    BH: tl.constexpr = BN // 2
    DT: tl.constexpr = staging_ptr.dtype.element_ty
    n, row_tiles_per_piece, row_tiles, n_tiles, tiles_per_dest, slot_numel, k_tiles = _geometry(
        k, rows, n, pieces, BM, BN, BK
    )
    ones = tl.full([THREADS], 1, tl.int32)  # one element a thread
    for tile in tl.range(pid, (WORLD - 1) * tiles_per_dest, tl.num_programs(0), flatten=True):
        dest, m, j = _tile_coords(tile, tiles_per_dest, row_tiles, n_tiles, RANK, WORLD, GROUP_M)
        step = tile // tiles_per_dest
        piece = m // row_tiles_per_piece
        row0 = (m % row_tiles_per_piece) * BM
        n0 = j * BN
        left, right = _product(a_desc, b_desc, piece * WORLD + dest, row0, n0, k_tiles, BM, BN, BK, B_KN)
        slot = staging_ptr + step * slot_numel
        ptrs, mask = _tile_ptrs(slot, piece, row0, n0, rows, n, BM, BH)
        tl.store(ptrs, left.to(DT), mask=mask)
        ptrs, mask = _tile_ptrs(slot, piece, row0, n0 + BH, rows, n, BM, BH)
        tl.store(ptrs, right.to(DT), mask=mask)
        counter = counters_ptr + step * chunks + m // GROUP_M
        tl.atomic_add(counter + ones * 0, ones, sem="release", scope="gpu")


@triton.jit
def _wait_set(flag_ptr, where, status_ptr, src, timeout_ns, OP_ID: tl.constexpr):
    """Wait until the flag at `flag_ptr` is set (1): one acquire read first, the bounded spin of
    kernels/symm_mem.py only when it is not, recording `where` on a timeout. Ends with a CTA barrier."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if seen < 1:
        wait_flag(flag_ptr, 1, status_ptr, OP_ID, where, src, timeout_ns)
    tl.debug_barrier()


@triton.jit
def _matmul_rs_own_kernel(
    a_desc, b_desc, out_ptr, recv_ptr, flags_ptr, status_ptr, timeout_ns, k, rows, n, pieces, chunks,
    RANK: tl.constexpr, WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, B_KN: tl.constexpr, OP_ID: tl.constexpr, AFTER_STAGE: tl.constexpr,
    SPIN: tl.constexpr,
):  # fmt: skip
    """Persistent GEMM over this rank's own tiles [(W - 1) * T, W * T) of `_tile_coords`' order,
    program i taking own tiles i, i + G, ...: each tile's product waits for the W - 1 peers' flags of
    its chunk, adds their partials and writes the output shard. SPIN (compiled): the waits are
    unbranched spins, so that Triton flattens the loop and the next tile's loads are in flight during a
    tile's waits and reduction (the interpreter takes `_wait_set`). Only peers' copy streams set these
    flags, and they wait for nothing an SM holds, so the static schedule cannot deadlock."""
    pid = tl.program_id(0)
    BH: tl.constexpr = BN // 2
    n, row_tiles_per_piece, row_tiles, n_tiles, tiles_per_dest, slot_numel, k_tiles = _geometry(
        k, rows, n, pieces, BM, BN, BK
    )
    first = (WORLD - 1) * tiles_per_dest
    for tile in tl.range(first + pid, first + tiles_per_dest, tl.num_programs(0), flatten=True):
        _, m, j = _tile_coords(tile, tiles_per_dest, row_tiles, n_tiles, RANK, WORLD, GROUP_M)
        piece = m // row_tiles_per_piece
        row0 = (m % row_tiles_per_piece) * BM
        n0 = j * BN
        left, right = _product(a_desc, b_desc, piece * WORLD + RANK, row0, n0, k_tiles, BM, BN, BK, B_KN)
        # `zero` comes out of each wait and goes into the partials' addresses: a thread's loads of them
        # depend on its own acquires of every peer's flag.
        zero = pid * 0
        for src in tl.static_range(WORLD):
            if src != RANK:
                flag = ((src - RANK + WORLD) % WORLD - 1) * chunks + m // GROUP_M
                if SPIN:
                    zero = wait_flag_unbranched(flags_ptr + flag, 1, zero, status_ptr, OP_ID, 1 + flag, src,
                                                timeout_ns, False)  # fmt: skip
                else:
                    _wait_set(flags_ptr + flag, 1 + flag, status_ptr, src, timeout_ns, OP_ID)
        partials = tl.multiple_of(recv_ptr + zero, 16)
        # In column slices of at most 64 (32 past 4 ranks): the peers' partials of a slice are loaded
        # at once, so narrower slices keep the epilogue in registers.
        SLICES: tl.constexpr = 2 if WORLD <= 4 else 4
        _reduce_slices(left, partials, slot_numel, piece, row0, n0, rows, n, out_ptr, RANK, WORLD, BM, BH,
                       SLICES)  # fmt: skip
        _reduce_slices(right, partials, slot_numel, piece, row0, n0 + BH, rows, n, out_ptr, RANK, WORLD, BM,
                       BH, SLICES)  # fmt: skip
    if AFTER_STAGE:
        # End after the stage launch: whatever the stream runs next (the flag reset, the credits) then
        # follows both launches.
        gdc_wait()


@dataclasses.dataclass(frozen=True)
class CallBuffers:
    """A call's memory on this rank: the staging slots (bf16, local) and the chunk counters (int32,
    local, zero between calls) the stage launch fills, the received slots (bf16) and their chunk flags
    (int32, [W - 1, chunks]) the own launch reads, the credits (int32 [W], symmetric: credits[d] from
    rank d) and the `credited` word (int32, local) the stage launch takes and sets, and the status word
    the waits report to. `credits` None: no credits taken (the GEMM alone)."""

    staging: torch.Tensor
    counters: torch.Tensor
    received: torch.Tensor
    flags: torch.Tensor
    status: torch.Tensor
    credits: torch.Tensor | None = None
    credited: torch.Tensor | None = None


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    layout: ScatterLayout,
    buffers: CallBuffers,
    rank: int,
    config: GemmConfig,
    num_programs: int,
    timeout_ns: int,
    part: str = "both",
    launchers: tuple[Launcher, Launcher] = (launch_kernel, launch_kernel),
) -> tuple[triton.compiler.CompiledKernel, ...]:
    """Launch the stage and/or own launch (`part`: "stage", "own" or "both") of this rank's call:
    `out` ([P, R, N], contiguous) = this rank's rows of the sum over ranks of `a` ([P, W, R, K],
    contiguous) @ `b`, each launch with at most `num_programs` programs. The own launch follows the
    call's stage launch on the same stream (programmatic dependent launch where compiled), whether
    launched with it or on its own after the copies have been queued (`_GroupState`), which are the
    caller's. `launchers`: what launches the stage and the own kernel. Returns the compiled kernels, in
    launch order."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    p, w, r, k, n = layout.pieces, layout.world, layout.rows, layout.k, layout.n
    if tuple(a.shape) != (p, w, r, k) or not a.is_contiguous():
        raise ValueError(f"a must be a contiguous [{p}, {w}, {r}, {k}] tensor, got {tuple(a.shape)}")
    if tuple(out.shape) != (p, r, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{p}, {r}, {n}] tensor, got {tuple(out.shape)}")
    if part not in ("stage", "own", "both"):
        raise ValueError(f"part must be 'stage', 'own' or 'both', got {part!r}")
    if num_programs < 1:
        raise ValueError(f"num_programs must be at least 1, got {num_programs}")
    chunks = layout.chunk_count(config)
    slots = (w - 1) * layout.slot_numel()
    for name, tensor, numel in (
        ("staging", buffers.staging, slots),
        ("received", buffers.received, slots),
        ("counters", buffers.counters, (w - 1) * chunks),
        ("flags", buffers.flags, (w - 1) * chunks),
    ):
        if tensor.numel() < numel or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, at least {numel} elements; got {tensor.numel()}")
    b_kn = is_kn_layout(b)
    a_desc = TensorDescriptor(a, [p * w, r, k], [r * k, k, 1], [1, bm, bk])
    if b_kn:
        b_desc = TensorDescriptor(b, [k, n], [n, 1], [bk, bn])
    else:
        b_desc = TensorDescriptor(b.t(), [n, k], [k, 1], [bn, bk])
    per_dest = layout.tiles_per_dest(config)
    common = dict(RANK=rank, WORLD=w, BM=bm, BN=bn, BK=bk, GROUP_M=config.group_m, B_KN=b_kn,
                  num_warps=config.num_warps, num_stages=config.num_stages)  # fmt: skip
    kernels = ()
    if part in ("stage", "both"):
        credits = buffers.credits is not None
        credits_ptr = buffers.credits if credits else buffers.counters  # unused without credits
        credited_ptr = buffers.credited if credits else buffers.counters
        stage = launchers[0](
            _matmul_rs_stage_kernel, (min(num_programs, (w - 1) * per_dest),),
            a_desc, b_desc, buffers.staging, buffers.counters, credits_ptr, credited_ptr, buffers.status,
            timeout_ns, k, r, n, p, chunks,
            THREADS=config.threads, CREDITS=credits, OP_ID=OP, PDL=not INTERPRETED, **common,
        )  # fmt: skip
        kernels += (stage,)
    if part in ("own", "both"):
        after_stage = not INTERPRETED
        own = launchers[1](
            _matmul_rs_own_kernel, (min(num_programs, per_dest),),
            a_desc, b_desc, out, buffers.received, buffers.flags, buffers.status, timeout_ns, k, r, n, p,
            chunks, OP_ID=OP, AFTER_STAGE=after_stage, SPIN=not INTERPRETED,
            **common, **({"launch_pdl": True} if after_stage else {}),
        )  # fmt: skip
        kernels += (own,)
    return kernels


def grid_size(layout: ScatterLayout, config: GemmConfig, num_sms: int) -> int:
    """Programs of a launch: one per SM, or per tile where there are fewer tiles."""
    return min(num_sms, layout.world * layout.tiles_per_dest(config))


def own_programs(programs: int, num_sms: int, shares_gpu: bool) -> int:
    """Programs of the own launch. Where the group's ranks share a GPU, the copies between their
    buffers are copies within one device, which need an SM of the sender (measured on an H100: a copy
    issued while kernels fill every SM lands only once one of them ends). The own launch, whose
    programs spin until the peers' copies land, then leaves one SM free: on every SM, 8 ranks sharing
    one H100 timed out, each waiting for a copy that its sender's own launch held back."""
    return min(programs, max(1, num_sms - 1)) if shares_gpu else programs


class GemmAlone:
    """The GEMM of one `matmul_reduce_scatter_kernel` call of rank `rank` of `world`, with the
    communication taken out: the stage launch fills its staging slots and counters as in the call, and
    the own launch finds its chunk flags already set and the peers' partials in place (zeros: the
    output is this rank's rows of a @ b); no copies. Same config picking, tile schedule, descriptors and
    launches as the call (`launch`), in one process without a process group: what `--gemm-alone` in the
    benchmarks times beside torch.matmul on the same operands.

    `run()` returns the output shard (preallocated, rewritten by every run); `staged(dest)` the partial
    of destination `dest`'s rows the last run staged. `num_sms` (default: the device's) caps the grid."""

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        dim: int,
        rank: int,
        world: int,
        config: GemmConfig | None = None,
        num_sms: int | None = None,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        layout = scatter_layout(a.shape, dim, b.shape[1], world)
        self.layout, self.rank = layout, rank
        self.config = config or pick_config(layout)
        dev = a.device
        self.a = a.contiguous().view(layout.pieces, world, layout.rows, layout.k)
        self.b = b
        # NaN until the kernel writes it (see ag_matmul.GemmAlone).
        self.out = torch.full(
            output_shape(a.shape, dim, layout.n, world), float("nan"), dtype=a.dtype, device=dev
        )
        slots = (world - 1) * layout.slot_numel()
        flags = (world - 1) * layout.chunk_count(self.config)
        self.buffers = CallBuffers(
            staging=torch.full((slots,), float("nan"), dtype=a.dtype, device=dev),
            # The counters are never awaited here: they may wrap.
            counters=torch.zeros(flags, dtype=torch.int32, device=dev),
            received=torch.zeros(slots, dtype=a.dtype, device=dev),
            flags=torch.ones(flags, dtype=torch.int32, device=dev),
            status=torch.zeros(4, dtype=torch.int32, device=dev),
        )
        num_sms = num_sms if num_sms is not None else sm_count(dev)
        self.num_programs = grid_size(layout, self.config, num_sms)
        self.kernels: tuple[triton.compiler.CompiledKernel, ...] = ()  # the last run's launches
        self.runs = 0

    def run(self) -> torch.Tensor:
        out = self.out.view(self.layout.pieces, self.layout.rows, self.layout.n)
        self.kernels = launch(self.a, self.b, out, self.layout, self.buffers, self.rank, self.config,
                              self.num_programs, int(DEFAULT_TIMEOUT_S * 1e9))  # fmt: skip
        self.runs += 1
        return self.out

    def staged(self, dest: int) -> torch.Tensor:
        """[P, R, N]: the partial of `dest`'s rows that the last run staged for `dest`."""
        if dest == self.rank or not 0 <= dest < self.layout.world:
            world = self.layout.world
            raise ValueError(f"rank {self.rank} stages for its peers of {world} ranks, not {dest}")
        if not self.runs:
            raise ValueError("nothing staged yet: call run() first")
        step = (dest - self.rank) % self.layout.world - 1
        n = self.layout.slot_numel()
        slot = self.buffers.staging[step * n : (step + 1) * n]
        return slot.view(self.layout.pieces, self.layout.rows, self.layout.n)


# ------------------------------------------------------------------------------------ reference

# torch >= 2.13 names it reduce_scatter_single; torch 2.11 (the GPU hosts) only reduce_scatter_tensor.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def matmul_reduce_scatter_reference(
    a: torch.Tensor, b: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The stock path: torch.matmul, then reduce_scatter_tensor (NCCL / gloo) of chunks of `dim`."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    product = torch.matmul(a, b)
    if world == 1:
        return product
    dim %= a.dim()
    if product.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {product.shape[dim]} does not split over {world} ranks")
    # [..., W * n, ...] -> [W, ..., n, ...] contiguous: rank d's chunk is the d-th block.
    send = product.unflatten(dim, (world, -1)).movedim(dim, 0).contiguous()
    out = torch.empty(send.shape[1:], dtype=product.dtype, device=product.device)
    _reduce_scatter_single(out, send.flatten(0, 1), group=group)
    return out


# ------------------------------------------------------------------------------------ dispatch


def check_inputs(a: torch.Tensor, b: torch.Tensor, dim: int, world: int) -> None:
    """Errors for calls no path can run (raised before any communication)."""
    nd = a.dim()
    if nd < 2 or not -nd <= dim < nd or dim % nd == nd - 1:
        raise ValueError(f"dim {dim} is not a row dim of a of shape {tuple(a.shape)}")
    if b.dim() != 2 or b.shape[0] != a.shape[-1]:
        raise ValueError(
            f"b has shape {tuple(b.shape)}; a {tuple(a.shape)} needs [{a.shape[-1]}, N] "
            "(pass an nn.Linear weight as weight.t())"
        )
    if b.dtype != a.dtype or b.device != a.device:
        raise ValueError(
            f"b is {b.dtype} on {b.device}, a {a.dtype} on {a.device}: cast them to one dtype on one device"
        )
    if a.shape[dim] % world:
        raise ValueError(
            f"dim {dim % nd} of a has size {a.shape[dim]}, which does not split over {world} ranks: pad "
            f"it to a multiple of {world}"
        )


def fallback_reason(
    a: torch.Tensor, b: torch.Tensor, dim: int, world: int, config: GemmConfig | None = None
) -> str | None:
    """Why the kernel cannot run this call (the reference runs it instead), or None."""
    if world not in SUPPORTED_WORLD_SIZES:
        return f"world size {world} (the kernel serves {SUPPORTED_WORLD_SIZES})"
    if a.dtype != torch.bfloat16:
        return f"dtype {a.dtype} (the kernel is bf16)"
    if a.shape[-1] % TMA_ALIGN or b.shape[1] % TMA_ALIGN:
        return f"K or N not a multiple of {TMA_ALIGN} (TMA needs 16-byte row strides)"
    if a.numel() == 0 or b.shape[1] == 0:
        return "an empty operand"
    try:
        is_kn_layout(b)
    except ValueError as err:
        return str(err)
    layout = scatter_layout(a.shape, dim, b.shape[1], world)
    chunks = layout.chunk_count(config or pick_config(layout))
    if chunks > MAX_CHUNKS:
        return f"{chunks} chunks per slot (the flag buffer holds {MAX_CHUNKS})"
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return (
            "CUDA_DEVICE_MAX_CONNECTIONS=1 queues the copy streams behind the launch that waits for "
            "them: unset it"
        )
    return None


CopyOp = tuple[int, int, int, int, int, int]  # counter, target, destination, source, bytes, flag


def copy_plan(
    layout: ScatterLayout,
    config: GemmConfig,
    rank: int,
    received: Sequence[int],
    flag_buffers: Sequence[int],
    staging: int,
    counters: int,
) -> tuple[tuple[tuple[CopyOp, ...], ...], tuple[int, ...]]:
    """The addresses of one call's copies and signals on rank `rank`: per copy stream (step s, whose
    destination is rank + 1 + s), (counter, target, destination, source, bytes, flag) of each chunk;
    then the credit words this rank grants its peers after its own launch.
    `received[d]` and `flag_buffers[d]` are rank d's received slots and flag buffer ([credits | chunk
    flags]) as this process maps them; `staging` and `counters` are this rank's."""
    chunks = layout.chunks(config)
    w, slot_bytes = layout.world, layout.slot_numel() * 2
    steps = []
    for step in range(w - 1):
        dest = (rank + 1 + step) % w
        slot = (rank - dest) % w - 1  # this rank's slot in dest's buffers
        peer_flags = flag_buffers[dest] + 4 * (CREDITS + slot * len(chunks))
        ops = tuple(
            (
                counters + 4 * (step * len(chunks) + c),
                chunk.target,
                received[dest] + slot * slot_bytes + chunk.offset,
                staging + step * slot_bytes + chunk.offset,
                chunk.nbytes,
                peer_flags + 4 * c,
            )
            for c, chunk in enumerate(chunks)
        )
        steps.append(ops)
    grants = tuple(flag_buffers[d] + 4 * rank for d in range(w) if d != rank)
    return tuple(steps), grants


@dataclasses.dataclass(frozen=True)
class _CopyPlan:
    """A call shape's buffers, its `copy_plan` (computed once) and the launchers of its stage and own
    kernels (which skip launch.py's key after their first call)."""

    buffers: CallBuffers
    steps: tuple[tuple[CopyOp, ...], ...]
    grants: tuple[int, ...]
    launchers: tuple[Relaunch, Relaunch] = dataclasses.field(default_factory=lambda: (Relaunch(), Relaunch()))


class _GroupState:
    """What every call of a group shares on this rank: the flag buffer ([credits | chunk flags of the W
    - 1 received slots], int32, symmetric), the chunk counters (local), one copy stream per peer step,
    a staging buffer per size class (local) and a copy plan per call shape."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.flags = get_symm_buffer(group, FLAG_BUFFER_BYTES, tag=FLAG_TAG)
        self.shares_gpu = check_group(group)  # cached by get_symm_buffer: not collective here
        words = self.flags.view(0, FLAG_BUFFER_BYTES // 4, torch.int32)
        words.zero_()
        self.credits = words[:CREDITS]
        self.credits.fill_(1)  # every peer may write this rank's buffer for the first call
        self.credited = torch.zeros(1, dtype=torch.int32, device=words.device)
        self.counters = torch.zeros((self.world - 1) * MAX_CHUNKS, dtype=torch.int32, device=words.device)
        self.streams = [torch.cuda.Stream() for _ in range(self.world - 1)]
        self.staging: dict[int, torch.Tensor] = {}
        self.plans: dict[tuple[ScatterLayout, GemmConfig, int], _CopyPlan] = {}
        # Recorded anew by every call: a wait uses the record made last before it.
        self.fork, self.credited_event = torch.cuda.Event(), torch.cuda.Event()
        self.joins = [torch.cuda.Event() for _ in self.streams]
        torch.cuda.synchronize()
        dist.barrier(group=group)  # every credit and flag set before any peer copies or signals

    def plan(self, layout: ScatterLayout, config: GemmConfig, data: SymmBuffer) -> _CopyPlan:
        key = (layout, config, data.nbytes)
        if key not in self.plans:
            self.plans[key] = self._make_plan(layout, config, data)
        return self.plans[key]

    def _make_plan(self, layout: ScatterLayout, config: GemmConfig, data: SymmBuffer) -> _CopyPlan:
        w, chunks = self.world, layout.chunk_count(config)
        buffers = CallBuffers(
            staging=self.staging[data.nbytes],
            counters=self.counters[: (w - 1) * chunks],
            received=data.view(0, (w - 1) * layout.slot_numel(), torch.bfloat16),
            flags=self.flags.view(CREDITS * 4, (w - 1) * chunks, torch.int32),
            status=self.flags.status,
            credits=self.credits,
            credited=self.credited,
        )
        steps, grants = copy_plan(
            layout, config, self.rank, data.addresses, self.flags.addresses, buffers.staging.data_ptr(),
            buffers.counters.data_ptr(),
        )  # fmt: skip
        return _CopyPlan(buffers=buffers, steps=steps, grants=grants)

    def start(self, stream: torch.cuda.Stream) -> None:
        """Mark where the call's copy streams start on `stream`: before the stage launch, so that each
        copy waits for its chunk's counter rather than for the whole launch to end."""
        self.fork.record(stream)

    def copy(self, plan: _CopyPlan) -> None:
        """Queue the call's copies and signals on the copy streams, from `start` on: after the stage
        launch (kernels/stream_ops.py: lazy loading) and before the own launch (module docstring). The
        first copy stream waits until the stage launch took the credits."""
        first = self.streams[0]
        first.wait_event(self.fork)
        credited = plan.buffers.credited.data_ptr()
        stream_ops.wait_geq(first.cuda_stream, credited, 1)
        stream_ops.write(first.cuda_stream, credited, 0)
        self.credited_event.record(first)
        for copies, join, ops in zip(self.streams, self.joins, plan.steps, strict=True):
            if copies is not first:
                copies.wait_event(self.credited_event)
            handle = copies.cuda_stream
            for counter, target, dst, src, nbytes, flag in ops:
                stream_ops.wait_geq(handle, counter, target)
                stream_ops.write(handle, counter, 0)
                stream_ops.copy(handle, dst, src, nbytes)
                stream_ops.write(handle, flag, 1)
            join.record(copies)

    def finish(self, stream: torch.cuda.Stream, plan: _CopyPlan) -> None:
        """After the own launch, on `stream`: reset this rank's chunk flags, grant every peer its credit
        and wait for the copy streams."""
        handle = stream.cuda_stream
        stream_ops.fill(handle, plan.buffers.flags.data_ptr(), 0, plan.buffers.flags.numel())
        for grant in plan.grants:
            stream_ops.write(handle, grant, 1)
        for join in self.joins:
            stream.wait_event(join)


# Group name -> its state, with a weak reference to the flag buffer it was made for: a group re-created
# under the same name (its buffers made anew) gets a new state. parallel.distributed.release_groups
# drops them.
_STATES: dict[str, tuple[weakref.ref, _GroupState]] = {}
# Group name -> size classes of the data buffers allocated so far.
_PREPARED: dict[str, set[int]] = {}


def _group_state(group: dist.ProcessGroup) -> _GroupState:
    """The group's state, created (collective) on its first call."""
    flags = get_symm_buffer(group, FLAG_BUFFER_BYTES, tag=FLAG_TAG)
    entry = _STATES.get(group.group_name)
    if entry is None or entry[0]() is not flags:
        entry = (weakref.ref(flags), _GroupState(group))
        _STATES[group.group_name] = entry
    return entry[1]


def prepare(
    a: torch.Tensor, b: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> tuple[_GroupState, SymmBuffer]:
    """The group's state and the data buffer of a call with these arguments, allocated on first use
    (collective over `group`), with its staging buffer. Before capturing a CUDA graph, make one eager
    call of each shape instead: it also compiles and loads the kernels, which cannot happen during a
    capture."""
    group = group if group is not None else dist.group.WORLD
    layout = scatter_layout(a.shape, dim, b.shape[1], dist.get_world_size(group))
    state = _group_state(group)
    data = get_symm_buffer(group, layout.slots_bytes(), tag=DATA_TAG)
    if data.nbytes not in state.staging:
        state.staging[data.nbytes] = torch.empty(data.nbytes // 2, dtype=torch.bfloat16, device=a.device)
    _PREPARED.setdefault(group.group_name, set()).add(data.nbytes)
    return state, data


def check(group: dist.ProcessGroup | None = None) -> None:
    """Raise SymmMemTimeout (naming this rank, the op and the missing peer) if a wait of this op on
    `group` gave up; synchronizes the device. Call after a CUDA graph replay or in tests."""
    group = group if group is not None else dist.group.WORLD
    if group.group_name in _STATES:
        check_status(_group_state(group).flags, "matmul_reduce_scatter")


def matmul_reduce_scatter_kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup,
    config: GemmConfig | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """The kernel path (callers check `fallback_reason` first): see the module docstring."""
    world = dist.get_world_size(group)
    layout = scatter_layout(a.shape, dim, b.shape[1], world)
    if torch.cuda.is_current_stream_capturing() and (
        group.group_name not in _STATES
        or size_class(layout.slots_bytes()) not in _PREPARED.get(group.group_name, ())
    ):
        raise RuntimeError(
            f"matmul_reduce_scatter: no symmetric buffers for a {tuple(a.shape)} x {tuple(b.shape)} call "
            "yet, and allocating them is collective: run one eager call with these shapes before "
            "capturing the CUDA graph"
        )
    state, data = prepare(a, b, dim, group)
    cfg = config or pick_config(layout)
    a = a.contiguous()
    # TMA needs 16-byte aligned bases. Copying an odd view (rare) rather than falling back keeps every
    # rank on the same path whatever its allocations.
    if a.data_ptr() % 16:
        a = a.clone()
    if b.data_ptr() % 16:
        b = b.clone() if is_kn_layout(b) else b.t().clone().t()
    a4 = a.view(layout.pieces, world, layout.rows, layout.k)
    out = torch.empty(output_shape(a.shape, dim, layout.n, world), dtype=a.dtype, device=a.device)
    num_sms = sm_count(a.device)
    plan = state.plan(layout, cfg, data)
    stream = torch.cuda.current_stream()
    args = (a4, b, out.view(layout.pieces, layout.rows, layout.n), layout, plan.buffers, state.rank, cfg)
    programs, timeout_ns = grid_size(layout, cfg, num_sms), int(timeout_s * 1e9)
    state.start(stream)
    launch(*args, programs, timeout_ns, part="stage", launchers=plan.launchers)
    state.copy(plan)
    own = own_programs(programs, num_sms, state.shares_gpu)
    launch(*args, own, timeout_ns, part="own", launchers=plan.launchers)
    state.finish(stream, plan)
    return out


def _matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """reduce_scatter(a @ b, dim) (sum) over the group `group_name`: the kernel where `fallback_reason`
    allows, the reference otherwise (the registered op's body)."""
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    check_inputs(a, b, dim, world)
    if not a.is_cuda:
        raise ValueError(
            f"matmul_reduce_scatter (parallel.comm=triton) needs CUDA tensors, got a on {a.device}: use "
            "parallel.comm=torch (or matmul_reduce_scatter_reference) on CPU"
        )
    if world == 1:
        return torch.matmul(a, b)
    reason = fallback_reason(a, b, dim, world)
    if reason is None:
        return matmul_reduce_scatter_kernel(a, b, dim, group)
    warn_fallback("matmul_reduce_scatter", reason)
    return matmul_reduce_scatter_reference(a, b, dim, group)


matmul_reduce_scatter_op = torch.library.custom_op(
    "weft::matmul_reduce_scatter", _matmul_reduce_scatter, mutates_args=()
)


@matmul_reduce_scatter_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    world = resolve_group(group_name).size()
    return a.new_empty(output_shape(a.shape, dim, b.shape[1], world))


def matmul_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """reduce_scatter(a @ b, dim) (sum, chunks of `dim` in rank order) over `group` (default: the
    world): what parallel/comm.py's triton path calls. torch.compile traces the registered op
    weft::matmul_reduce_scatter; eager calls run its body directly (see `eager_or_op`)."""
    group = group if group is not None else dist.group.WORLD
    run = eager_or_op(_matmul_reduce_scatter, torch.ops.weft.matmul_reduce_scatter)
    return run(a, b, dim, group.group_name)
