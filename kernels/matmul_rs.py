"""Matmul + reduce-scatter (the row-parallel matmul of sequence parallelism) over symmetric memory,
and the reference.

    out = matmul_reduce_scatter(a, b, dim, group)  ==  reduce_scatter(a @ b, dim)   (sum)

`a` holds this rank's K shard of every row; chunk d of `dim` of the summed product goes to rank d. Two
persistent Triton GEMMs (tensor-descriptor loads, i.e. TMA on Hopper), back to back on the caller's
stream, do everything: the first computes the peers' rows and pushes its partial tiles straight into the
peers' symmetric buffers while it computes; the second, which may start on each SM the first leaves
(programmatic dependent launch), finishes this rank's own rows by adding the peers' pushed tiles to its
own accumulator. No side stream, no copy of `a` or of the weight. (A config without `push_launch` runs
both parts in the second kernel alone, one launch.)

Data layout
-----------
`a` of shape [d0, ..., d_dim, ..., K] is seen as [P, W, R, K]: P = d0 * ... * d_{dim-1} pieces, each
of W blocks of R = d_dim / W * d_{dim+1} * ... rows, block d of every piece bound for rank d. The GEMM
reads A through a 3-D descriptor of the [P * W, R, K] view (row (p, d, r) at index p * W + d); a row
tile never crosses a block (R need not be a multiple of the tile: loads clip, stores are masked). The
output shard and every pushed slot are [P, R, N]. dim=0 and 2-D `a` are P = 1; the model's [B, S, K]
with dim=1 is P = B, so no permute copy is needed for B > 1.

Tile schedule
-------------
W steps of T = P * ceil(R / BM) * ceil(N / BN) tiles: step s computes the rows of destination
(rank + 1 + s) % W, so this rank's own rows come last and, at every moment, every rank's rows are being
computed by some peer. Inside a step the (row tile, column tile) pairs follow a group-M swizzle (GROUP_M
row tiles share their B tiles in L2); every rank uses the same order inside a step.

* A tile of a peer's rows (the first launch: steps 0 .. W - 2, program i taking tiles i, i + G, ...) is
  stored (plain stores over NVLink) into slot (rank - dest) % W - 1 of the destination's data buffer.
  When a program has pushed all its tiles it announces them: one release (system scope, it waits for
  the stores to land), writing `epoch + 1` into each tile's flag of that slot in the destination's flag
  buffer. Nothing in this launch waits, so Triton flattens its persistent loop and K loop into one
  pipeline: a tile's pushes drain while the next tile's loads are in flight (on one H100 the GEMM alone
  went from 1.13 / 1.05 / 1.13 / 1.02x cuBLAS in one launch to 1.09 / 1.02 / 1.09 / 1.00x at the
  benchmark's shapes, matmul_rs_gemm-h100.md).
* A tile of this rank's rows (the second launch, step W - 1, program i taking own tiles i, i + G, ...)
  waits (acquire, bounded) until the W - 1 peers' flags of that tile reached `epoch + 1`, then adds
  their bf16 partials to its own fp32 accumulator and writes the output shard. The waits are spins
  without branches, so this loop is flattened too. Only this 1/W of the GEMM waits, and only on peers'
  first launches, which never wait. The second launch's programs start only once every program of the
  first has started (its trigger is at the start), so no resident program of any rank spins for a push
  that a program still waiting for an SM would make, whatever the SM occupancy; it waits for the first
  launch to end before advancing the epoch.
* The one-launch form (a config without `push_launch`) claims every tile from an atomic counter zeroed
  before the launch, and defers a push tile's release until after the program's next tile's main loop.

Flags are per tile and hold the epoch of the call that wrote them (`epoch` counts the calls on the
group, kept on the device beside the flags as in kernels/symm_mem.py): they are never reset, a stale
flag of an earlier call is always below the target, and CUDA-graph replays mixed with eager calls keep
working. They need no per-shape bookkeeping either, unlike counters would.

Why no barrier is needed: buffers and flags come in two halves, a call using half `epoch % 2`. A peer
writes half e % 2 of this rank's buffers during its call e + 2 only after its call e + 1 ended, which
waited for this rank's call e + 1 pushes, which this rank's stream issued only after its call e kernels
(the last reader of half e % 2) had ended. So a peer is at most one call ahead and never writes the half
this rank is reading. All calls of a group go through one flag buffer and one epoch, whatever data
buffer (size class) they use, so the argument holds across shapes. Calls of one group must be issued on
one stream (as for every collective). A wait that times out records (op, flag index, missing rank) in
the flag buffer's status word; `check(group)` raises SymmMemTimeout naming the rank; the group's state
is then unusable.

What runs where (decided here; parallel/comm.py's triton path calls `matmul_reduce_scatter`):
* the kernel: bf16 on CUDA, world size 2, 4 or 8, `dim` not the last, d_dim divisible by W, K and N
  multiples of 8 (TMA row strides), b either a contiguous [K, N] matrix or `weight.t()` of a contiguous
  [N, K] weight (no weight is copied), at most FLAGS_PER_HALF flags per call;
* the reference (torch.matmul + reduce_scatter_tensor) for every other well-formed call (another dtype
  or world size, misaligned K or N, ...), `fallback_reason` says why;
* an error for calls no path can run: CPU tensors, mismatched shapes or dtypes, d_dim not divisible by W.
The first call of a size class allocates its data buffer (collective; the first call on a group also
the flag buffer), and a new shape may compile the kernel: make one eager call of each shape before
capturing a CUDA graph (`prepare` allocates, but compiles nothing). Memory: 2 (W - 1) / W * M * N * 2
bytes per rank, rounded up to a power of two.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.symm_mem import (
    DEFAULT_TIMEOUT_S,
    INTERPRETED,
    MAX_PROGRAMS,
    SymmBuffer,
    advance_epoch,
    check_status,
    eager_or_op,
    get_symm_buffer,
    load_epoch,
    op_id,
    size_class,
    wait_flag,
    wait_flag_unbranched,
    warn_fallback,
)

SUPPORTED_WORLD_SIZES = (2, 4, 8)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}  # pushed partials
TMA_ALIGN = 8  # bf16 elements per 16 bytes: K and N must be multiples (TMA row strides)
DATA_TAG = "matmul_rs"
FLAG_TAG = "matmul_rs_flags"
FLAG_BUFFER_BYTES = 1 << 20
EPOCH_SLOTS = MAX_PROGRAMS.value  # programs per launch that may read an epoch slot (H200: 132 SMs)
FLAGS_PER_HALF = (FLAG_BUFFER_BYTES // 4 - EPOCH_SLOTS) // 2
OP = op_id("matmul_reduce_scatter")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # push_launch: the peers' tiles in a launch of their own (`_matmul_rs_push_kernel`: a static
    # schedule whose persistent loop and K loop Triton flattens into one pipeline, so a tile's pushes
    # overlap the next tile's loads), then this rank's own tiles in a second (`_matmul_rs_kernel` over
    # them alone).
    push_launch: bool = False


# (largest N, config), first match. 128x256x64 / 8 warps is the wgmma-friendly Hopper tile, with 4
# stages and the peers' tiles and the own rows each in a flattened launch of their own: on one H100 the
# GEMM alone takes 1.085-1.090x cuBLAS at K = 3584-4096 and 1.01-1.02x at K = 7168-14336, against 1.13
# and 1.02-1.05 in one launch (benchmarks/results/matmul_rs_gemm-h100.md). Narrow outputs get 128x128
# tiles so that enough tiles exist to fill the SMs. Refine from `torchrun --nproc_per_node=4
# benchmarks/bench_matmul_rs.py --sweep`, the GEMM alone from `python -m benchmarks.bench_matmul_rs
# --gemm-alone --sweep` on one GPU.
CONFIGS: tuple[tuple[int, GemmConfig], ...] = (
    (1024, GemmConfig(128, 128, 64, 8, 8, 4, push_launch=True)),
    (1 << 62, GemmConfig(128, 256, 64, 8, 8, 4, push_launch=True)),
)


def pick_config(n: int) -> GemmConfig:
    """The table's config for an output of `n` columns."""
    return next(cfg for max_n, cfg in CONFIGS if n <= max_n)


# ------------------------------------------------------------------------------------ layout math


@dataclasses.dataclass(frozen=True)
class ScatterLayout:
    """`a` seen as [pieces, world, rows, k]; the output shard (and each pushed slot) as [pieces, rows, n]."""

    pieces: int
    rows: int  # rows per (piece, destination)
    k: int
    n: int
    world: int

    def tiles_per_dest(self, config: GemmConfig) -> int:
        return self.pieces * triton.cdiv(self.rows, config.block_m) * triton.cdiv(self.n, config.block_n)

    def slot_numel(self) -> int:
        """Elements of one pushed slot (one source's partial of one destination's rows)."""
        return self.pieces * self.rows * self.n

    def half_bytes(self) -> int:
        """Bytes of one half of the data buffer: W - 1 slots of bf16."""
        return (self.world - 1) * self.slot_numel() * 2


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


# ------------------------------------------------------------------------------------ the kernel


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
def _rank_base(ptr_table, r, byte_offset, DT: tl.constexpr):
    """Rank r's symmetric buffer + byte_offset, as a 16-byte aligned pointer to DT."""
    base = tl.load(ptr_table.to(tl.pointer_type(tl.uint64)) + r).to(tl.int64) + byte_offset
    return tl.multiple_of(base.to(tl.pointer_type(DT)), 16)


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
def _push(left, right, data_table, data_offset, dest, slot, slot_numel, piece, row0, n0, rows, n,
          BM: tl.constexpr, BH: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """Store a tile's column halves (plain stores, over NVLink to a peer) into slot `slot` of rank
    `dest`'s data buffer."""
    base = _rank_base(data_table, dest, data_offset, DT) + slot * slot_numel
    ptrs, mask = _tile_ptrs(base, piece, row0, n0, rows, n, BM, BH)
    tl.store(ptrs, left.to(DT), mask=mask)
    ptrs, mask = _tile_ptrs(base, piece, row0, n0 + BH, rows, n, BM, BH)
    tl.store(ptrs, right.to(DT), mask=mask)


@triton.jit
def _announce(flag_table, dest, flag_offset, flag, value):
    """flags[flag] of rank `dest` = value, after every store this program made (release, system)."""
    tl.debug_barrier()
    flags = _rank_base(flag_table, dest, flag_offset, tl.int32)
    tl.atomic_xchg(flags + flag, value, sem="release", scope="sys")


@triton.jit
def _wait_tile(flags, flag, value, status_ptr, src, timeout_ns, OP_ID: tl.constexpr):
    """Wait until flags[flag] reached `value`: one acquire read first (the flag is usually set by
    now), the bounded spin of kernels/symm_mem.py only when it is not. Ends with a CTA barrier."""
    seen = tl.atomic_add(flags + flag, 0, sem="acquire", scope="sys")
    if seen - value < 0:
        wait_flag(flags + flag, value, status_ptr, OP_ID, flag, src, timeout_ns)
    tl.debug_barrier()


@triton.jit
def _reduce_columns(part, data, slot_numel, piece, row0, n0, rows, n, out_ptr,
                    RANK: tl.constexpr, WORLD: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr):  # fmt: skip
    """Output columns [n0, n0 + BH) of a row tile = this rank's `part`, then the peers' pushed partials
    in rank order, summed in fp32 into `part` (no second fp32 tile in registers)."""
    ptrs, mask = _tile_ptrs(data, piece, row0, n0, rows, n, BM, BH)
    total = part
    for src in tl.static_range(WORLD):
        if src != RANK:
            slot = (src - RANK + WORLD) % WORLD - 1
            # .cg: read L2, where the peers' stores landed, never a stale L1 line of an earlier call.
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
def _call_geometry(epoch_ptr, pid, data_offset, data_half, flag_offset, flag_half, k, rows, n, pieces,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """What every launch of a call derives first: its epoch, the byte offsets of the data and flag
    halves the call uses, N, the tile counts, a slot's elements and the K steps."""
    epoch = load_epoch(epoch_ptr, pid)
    parity = (epoch & 1).to(tl.int64)
    data_offset += parity * data_half
    flag_offset += parity * flag_half * 4
    # The kernel path has N % TMA_ALIGN (8) == 0. Saying so (an identity there; tl.multiple_of does
    # not reach a scalar argument) keeps pushes and reads in 16-byte vectors even where N is not a
    # multiple of 16, the only divisibility Triton infers by itself.
    n = n // 8 * 8
    row_tiles_per_piece = tl.cdiv(rows, BM)
    row_tiles = pieces * row_tiles_per_piece
    n_tiles = tl.cdiv(n, BN)
    tiles_per_dest = row_tiles * n_tiles
    slot_numel = tl.cast(pieces, tl.int64) * rows * n  # int64: slots may exceed 2**31 elements
    k_tiles = tl.cdiv(k, BK)
    return epoch, data_offset, flag_offset, n, row_tiles_per_piece, row_tiles, n_tiles, tiles_per_dest, \
        slot_numel, k_tiles  # fmt: skip


@triton.jit
def _matmul_rs_kernel(
    a_desc, b_desc, out_ptr, data_table, data_offset, data_half, flag_table, flag_offset, flag_half,
    epoch_ptr, status_ptr, claim_ptr, timeout_ns, k, rows, n, pieces, tile_begin, tile_end,
    RANK: tl.constexpr, WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, B_KN: tl.constexpr, OP_ID: tl.constexpr,
):  # fmt: skip
    """Persistent GEMM + reduce-scatter over tiles [tile_begin, tile_end) of `_tile_coords`' order
    (the whole call is [0, W * T)), claimed one by one through the zeroed int32 at `claim_ptr`: the
    one-launch form (a config without `push_launch`); see the module docstring."""
    pid = tl.program_id(0)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    BH: tl.constexpr = BN // 2
    epoch, data_offset, flag_offset, n, row_tiles_per_piece, row_tiles, n_tiles, tiles_per_dest, slot_numel, \
        k_tiles = _call_geometry(epoch_ptr, pid, data_offset, data_half, flag_offset, flag_half, k, rows, n,
                                 pieces, BM, BN, BK)  # fmt: skip
    # The destination (-1: none) and flag of this program's last push, not yet announced. Tensors
    # from the start: loop-carried values keep one type.
    pending_dest = pid * 0 - 1
    pending_flag = pid * 0
    tile = tile_begin + tl.atomic_add(claim_ptr, 1, sem="relaxed")
    while tile < tile_end:
        dest, m, j = _tile_coords(tile, tiles_per_dest, row_tiles, n_tiles, RANK, WORLD, GROUP_M)
        piece = m // row_tiles_per_piece
        row0 = (m % row_tiles_per_piece) * BM
        n0 = j * BN
        left, right = _product(a_desc, b_desc, piece * WORLD + dest, row0, n0, k_tiles, BM, BN, BK, B_KN)
        if pending_dest >= 0:
            _announce(flag_table, pending_dest, flag_offset, pending_flag, epoch + 1)
        tile_flag = m * n_tiles + j
        if dest != RANK:
            slot = (RANK - dest + WORLD) % WORLD - 1
            _push(left, right, data_table, data_offset, dest, slot, slot_numel, piece, row0, n0, rows, n,
                  BM, BH, DT)  # fmt: skip
            pending_dest = dest
            pending_flag = slot * tiles_per_dest + tile_flag
        else:
            pending_dest = dest * 0 - 1
            flags = _rank_base(flag_table, RANK, flag_offset, tl.int32)
            for src in tl.static_range(WORLD):
                if src != RANK:
                    slot = (src - RANK + WORLD) % WORLD - 1
                    _wait_tile(flags, slot * tiles_per_dest + tile_flag, epoch + 1, status_ptr, src,
                               timeout_ns, OP_ID)  # fmt: skip
            data = _rank_base(data_table, RANK, data_offset, DT)
            _reduce_columns(left, data, slot_numel, piece, row0, n0, rows, n, out_ptr, RANK, WORLD, BM, BH)
            _reduce_columns(right, data, slot_numel, piece, row0, n0 + BH, rows, n, out_ptr, RANK, WORLD, BM,
                            BH)  # fmt: skip
        tile = tile_begin + tl.atomic_add(claim_ptr, 1, sem="relaxed")
    if pending_dest >= 0:
        _announce(flag_table, pending_dest, flag_offset, pending_flag, epoch + 1)
    advance_epoch(epoch_ptr, pid, epoch)  # every slot: the next launch may use another grid


@triton.jit
def _matmul_rs_own_kernel(
    a_desc, b_desc, out_ptr, data_table, data_offset, data_half, flag_table, flag_offset, flag_half,
    epoch_ptr, status_ptr, timeout_ns, k, rows, n, pieces,
    RANK: tl.constexpr, WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, B_KN: tl.constexpr, OP_ID: tl.constexpr, AFTER_PUSHES: tl.constexpr,
    SPIN: tl.constexpr,
):  # fmt: skip
    """Persistent GEMM over this rank's own tiles [(W - 1) * T, W * T) of `_tile_coords`' order,
    program i taking own tiles i, i + G, ...: each tile's product waits for the W - 1 peers' flags of
    that tile, adds their partials and writes the output shard. SPIN (compiled): the waits are
    unbranched spins, so that Triton flattens the loop and the next tile's loads are in flight during a
    tile's waits and reduction; the interpreter takes the branched `_wait_tile`. Only peers' push
    launches, which never wait, set these flags, so the static schedule cannot deadlock."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    BH: tl.constexpr = BN // 2
    epoch, data_offset, flag_offset, n, row_tiles_per_piece, row_tiles, n_tiles, tiles_per_dest, slot_numel, \
        k_tiles = _call_geometry(epoch_ptr, pid, data_offset, data_half, flag_offset, flag_half, k, rows, n,
                                 pieces, BM, BN, BK)  # fmt: skip
    flags = _rank_base(flag_table, RANK, flag_offset, tl.int32)
    data = _rank_base(data_table, RANK, data_offset, DT)
    first = (WORLD - 1) * tiles_per_dest
    for tile in tl.range(first + pid, first + tiles_per_dest, nprog, flatten=True):
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
                flag = ((src - RANK + WORLD) % WORLD - 1) * tiles_per_dest + m * n_tiles + j
                if SPIN:
                    zero = wait_flag_unbranched(flags + flag, epoch + 1, zero, status_ptr, OP_ID, flag, src,
                                                timeout_ns, False)  # fmt: skip
                else:
                    _wait_tile(flags, flag, epoch + 1, status_ptr, src, timeout_ns, OP_ID)
        partials = tl.multiple_of(data + zero, 16)
        # In column slices of at most 64 (32 past 4 ranks): the peers' partials of a slice are loaded
        # at once, so narrower slices keep the epilogue in registers.
        SLICES: tl.constexpr = 2 if WORLD <= 4 else 4
        _reduce_slices(left, partials, slot_numel, piece, row0, n0, rows, n, out_ptr, RANK, WORLD, BM, BH,
                       SLICES)  # fmt: skip
        _reduce_slices(right, partials, slot_numel, piece, row0, n0 + BH, rows, n, out_ptr, RANK, WORLD, BM,
                       BH, SLICES)  # fmt: skip
    if AFTER_PUSHES:
        gdc_wait()  # the push launch read its epoch slots: it has ended before they advance
    advance_epoch(epoch_ptr, pid, epoch)


@triton.jit
def _matmul_rs_push_kernel(
    a_desc, b_desc, data_table, data_offset, data_half, flag_table, flag_offset, flag_half, epoch_ptr,
    k, rows, n, pieces,
    RANK: tl.constexpr, WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, B_KN: tl.constexpr, DT: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Persistent GEMM over the peers' tiles [0, (W - 1) * T) of `_tile_coords`' order, program i
    taking tiles i, i + G, ...: each tile is pushed into its destination's slot, and once the program
    has pushed all of them it announces them (one release, then a flag per tile). It never waits, so a
    static schedule cannot deadlock, and Triton flattens the loop: a tile's pushes drain while the
    next tile's loads are in flight. With PDL the own-rows launch may take each SM this one leaves."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    BH: tl.constexpr = BN // 2
    epoch, data_offset, flag_offset, n, row_tiles_per_piece, row_tiles, n_tiles, tiles_per_dest, slot_numel, \
        k_tiles = _call_geometry(epoch_ptr, pid, data_offset, data_half, flag_offset, flag_half, k, rows, n,
                                 pieces, BM, BN, BK)  # fmt: skip
    total = (WORLD - 1) * tiles_per_dest
    for tile in tl.range(pid, total, nprog, flatten=True):
        dest, m, j = _tile_coords(tile, tiles_per_dest, row_tiles, n_tiles, RANK, WORLD, GROUP_M)
        piece = m // row_tiles_per_piece
        row0 = (m % row_tiles_per_piece) * BM
        n0 = j * BN
        left, right = _product(a_desc, b_desc, piece * WORLD + dest, row0, n0, k_tiles, BM, BN, BK, B_KN)
        slot = (RANK - dest + WORLD) % WORLD - 1
        _push(left, right, data_table, data_offset, dest, slot, slot_numel, piece, row0, n0, rows, n,
              BM, BH, DT)  # fmt: skip
    # Every thread's pushes before the flags; the flags of all this program's tiles in one vector
    # release (each lane one flag), so the release waits for the pushes once.
    tl.debug_barrier()
    tiles = pid + nprog * tl.arange(0, TILES_PER_PROGRAM)
    dest, m, j = _tile_coords(tiles, tiles_per_dest, row_tiles, n_tiles, RANK, WORLD, GROUP_M)
    flags = _rank_base(flag_table, dest, flag_offset, tl.int32)
    flag = ((RANK - dest + WORLD) % WORLD - 1) * tiles_per_dest + m * n_tiles + j
    value = tl.zeros_like(flag) + epoch + 1
    tl.atomic_xchg(flags + flag, value, mask=tiles < total, sem="release", scope="sys")


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Where a launch finds the symmetric state: device tables of every rank's buffer base address,
    the byte offset of half 0 of the data (slots) and of the flags, each half's size (bytes of data,
    int32 flags), this rank's epoch slots and status word."""

    data_table: int
    data_offset: int
    data_half: int
    flag_table: int
    flag_offset: int
    flag_half: int
    epochs: torch.Tensor
    status: torch.Tensor


def is_kn_layout(b: torch.Tensor) -> bool:
    """True for a contiguous [K, N] matrix, False for `weight.t()` of a contiguous [N, K] weight."""
    if b.is_contiguous():
        return True
    if b.t().is_contiguous():
        return False
    raise ValueError(
        f"b of shape {tuple(b.shape)} and strides {b.stride()} is neither a contiguous [K, N] matrix "
        "nor the transpose of a contiguous [N, K] weight: pass weight.t() or a contiguous tensor"
    )


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    layout: ScatterLayout,
    buffers: Buffers,
    rank: int,
    config: GemmConfig,
    num_programs: int,
    timeout_ns: int,
    tiles: tuple[int, int] | None = None,
) -> tuple[triton.compiler.CompiledKernel, ...]:
    """Launch the persistent kernel(s): `out` ([P, R, N], contiguous) = this rank's rows of the sum
    over ranks of `a` ([P, W, R, K], contiguous) @ `b`, each launch with at most `num_programs`
    programs. `tiles` restricts the call to a range of the schedule (default: all W * T tiles, one
    whole call); with `config.push_launch` the range is the peers' tiles [0, (W - 1) * T), the own
    tiles [(W - 1) * T, W * T) or both. Returns the compiled kernels, in launch order."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    p, w, r, k, n = layout.pieces, layout.world, layout.rows, layout.k, layout.n
    if tuple(a.shape) != (p, w, r, k) or not a.is_contiguous():
        raise ValueError(f"a must be a contiguous [{p}, {w}, {r}, {k}] tensor, got {tuple(a.shape)}")
    if tuple(out.shape) != (p, r, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{p}, {r}, {n}] tensor, got {tuple(out.shape)}")
    per_dest = layout.tiles_per_dest(config)
    if (w - 1) * per_dest > buffers.flag_half:
        raise ValueError(
            f"{(w - 1) * per_dest} tiles need more flags than the {buffers.flag_half} of a flag-buffer "
            "half: use larger tiles"
        )
    if not 1 <= num_programs <= EPOCH_SLOTS:
        raise ValueError(f"num_programs must be in [1, {EPOCH_SLOTS}], got {num_programs}")
    peers, total = (w - 1) * per_dest, w * per_dest
    begin, end = tiles if tiles is not None else (0, total)
    if not 0 <= begin <= end <= total:
        raise ValueError(f"tile range [{begin}, {end}) outside the schedule's [0, {total})")
    if config.push_launch and (begin, end) not in ((0, peers), (peers, total), (0, total)):
        raise ValueError(
            f"with push_launch a launch covers the peers' tiles [0, {peers}), the own tiles "
            f"[{peers}, {total}) or both, not [{begin}, {end})"
        )
    b_kn = is_kn_layout(b)
    a_desc = TensorDescriptor(a, [p * w, r, k], [r * k, k, 1], [1, bm, bk])
    if b_kn:
        b_desc = TensorDescriptor(b, [k, n], [n, 1], [bk, bn])
    else:
        b_desc = TensorDescriptor(b.t(), [n, k], [k, 1], [bn, bk])
    if not config.push_launch:
        claims = torch.zeros(1, dtype=torch.int32, device=a.device)
        one = _matmul_rs_kernel[(min(num_programs, max(1, end - begin)),)](
            a_desc, b_desc, out, buffers.data_table, buffers.data_offset, buffers.data_half,
            buffers.flag_table, buffers.flag_offset, buffers.flag_half, buffers.epochs, buffers.status,
            claims, timeout_ns, k, r, n, p, begin, end,
            RANK=rank, WORLD=w, BM=bm, BN=bn, BK=bk, GROUP_M=config.group_m, B_KN=b_kn, OP_ID=OP,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        return (one,)
    first = None
    if begin == 0 and peers > 0:
        programs = min(num_programs, peers)
        per_program = triton.next_power_of_2(triton.cdiv(peers, programs))
        first = _matmul_rs_push_kernel[(programs,)](
            a_desc, b_desc, buffers.data_table, buffers.data_offset, buffers.data_half,
            buffers.flag_table, buffers.flag_offset, buffers.flag_half, buffers.epochs, k, r, n, p,
            RANK=rank, WORLD=w, BM=bm, BN=bn, BK=bk, GROUP_M=config.group_m, B_KN=b_kn,
            DT=_TL_DTYPES[out.dtype], TILES_PER_PROGRAM=per_program, PDL=not INTERPRETED,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        if end == peers:
            return (first,)
    after_pushes = first is not None and not INTERPRETED
    own = _matmul_rs_own_kernel[(min(num_programs, per_dest),)](
        a_desc, b_desc, out, buffers.data_table, buffers.data_offset, buffers.data_half,
        buffers.flag_table, buffers.flag_offset, buffers.flag_half, buffers.epochs, buffers.status,
        timeout_ns, k, r, n, p,
        RANK=rank, WORLD=w, BM=bm, BN=bn, BK=bk, GROUP_M=config.group_m, B_KN=b_kn, OP_ID=OP,
        AFTER_PUSHES=after_pushes, SPIN=not INTERPRETED, num_warps=config.num_warps,
        num_stages=config.num_stages, **({"launch_pdl": True} if after_pushes else {}),
    )  # fmt: skip
    return (own,) if first is None else (first, own)


def grid_size(layout: ScatterLayout, config: GemmConfig, num_sms: int) -> int:
    """Programs of a whole call's launch: one per SM, or per tile where there are fewer tiles."""
    return min(num_sms, layout.world * layout.tiles_per_dest(config), EPOCH_SLOTS)


# A flag value every call's target (epoch + 1) is below for the next 2**30 calls: a flag that never waits.
_ALWAYS_SET = 1 << 30


class GemmAlone:
    """The GEMM of one `matmul_reduce_scatter_kernel` call of rank `rank` of `world`, with the
    communication taken out: the peers' "symmetric buffers" are local tensors (one data and one flag
    buffer per rank, as in the call), so the pushes of the peers' rows land in local memory, and this
    rank's own tiles find their flags already set and the peers' partials in place (zeros: the output
    is this rank's rows of a @ b). Same config picking, tile schedule, descriptors and launch as the
    call (`launch`), in one process without a process group: what `--gemm-alone` in the benchmarks
    times beside torch.matmul on the same operands.

    `run()` returns the output shard (preallocated, rewritten by every run); `pushed(dest)` the partial
    of destination `dest`'s rows the last run pushed. `num_sms` (default: the device's) caps the grid."""

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
        self.config = config or pick_config(layout.n)
        dev = a.device
        self.a = a.contiguous().view(layout.pieces, world, layout.rows, layout.k)
        self.b = b
        # NaN until the kernel writes it (see ag_matmul.GemmAlone).
        self.out = torch.full(
            output_shape(a.shape, dim, layout.n, world), float("nan"), dtype=a.dtype, device=dev
        )
        flag_half = (world - 1) * layout.tiles_per_dest(self.config)
        self.data = [
            torch.zeros(2 * layout.half_bytes(), dtype=torch.uint8, device=dev) for _ in range(world)
        ]
        self.flags = [torch.zeros(2 * flag_half, dtype=torch.int32, device=dev) for _ in range(world)]
        self.flags[rank].fill_(_ALWAYS_SET)
        self.tables = [
            torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)
            for ts in (self.data, self.flags)
        ]
        self.epochs = torch.zeros(EPOCH_SLOTS, dtype=torch.int32, device=dev)
        self.buffers = Buffers(
            data_table=self.tables[0].data_ptr(),
            data_offset=0,
            data_half=layout.half_bytes(),
            flag_table=self.tables[1].data_ptr(),
            flag_offset=0,
            flag_half=flag_half,
            epochs=self.epochs,
            status=torch.zeros(4, dtype=torch.int32, device=dev),
        )
        num_sms = (
            num_sms if num_sms is not None else torch.cuda.get_device_properties(dev).multi_processor_count
        )
        self.num_programs = grid_size(layout, self.config, num_sms)
        self.kernels: tuple[triton.compiler.CompiledKernel, ...] = ()  # the last run's launches

    def run(self) -> torch.Tensor:
        out = self.out.view(self.layout.pieces, self.layout.rows, self.layout.n)
        self.kernels = launch(self.a, self.b, out, self.layout, self.buffers, self.rank, self.config,
                             self.num_programs, int(DEFAULT_TIMEOUT_S * 1e9))  # fmt: skip
        return self.out

    def pushed(self, dest: int) -> torch.Tensor:
        """[P, R, N]: the partial of `dest`'s rows that the last run pushed into `dest`'s data buffer."""
        if dest == self.rank or not 0 <= dest < self.layout.world:
            raise ValueError(f"rank {self.rank} pushes to the other ranks of {self.layout.world}, not {dest}")
        last = int(self.epochs[0].item()) - 1  # the epoch of the last run picked its buffer half
        if last < 0:
            raise ValueError("nothing pushed yet: call run() first")
        slot = (self.rank - dest) % self.layout.world - 1
        half = self.data[dest].view(2, -1)[last % 2].view(self.out.dtype)
        n = self.layout.slot_numel()
        return half[slot * n : (slot + 1) * n].view(self.layout.pieces, self.layout.rows, self.layout.n)


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
    flags = (world - 1) * layout.tiles_per_dest(config or pick_config(layout.n))
    if flags > FLAGS_PER_HALF:
        return f"{flags} tile flags (a flag-buffer half holds {FLAGS_PER_HALF})"
    return None


# Group name -> the flag buffer whose flags and epochs were zeroed (weakly: kernels/symm_mem.py owns it).
_ZEROED: dict[str, weakref.ref] = {}
# Group name -> size classes of the data buffers allocated so far.
_PREPARED: dict[str, set[int]] = {}


def _flag_buffer(group: dist.ProcessGroup) -> SymmBuffer:
    """The group's flag buffer: [epoch slots | flags half 0 | flags half 1] int32, zeroed (collective)
    when first allocated, before any peer can signal into it."""
    buf = get_symm_buffer(group, FLAG_BUFFER_BYTES, torch.uint8, tag=FLAG_TAG)
    seen = _ZEROED.get(group.group_name)
    if seen is None or seen() is not buf:
        buf.tensor.zero_()
        torch.cuda.synchronize()
        dist.barrier(group=group)
        _ZEROED[group.group_name] = weakref.ref(buf)
    return buf


def _data_bytes(layout: ScatterLayout) -> int:
    return 2 * layout.half_bytes()


def prepare(a: torch.Tensor, b: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> Buffers:
    """The symmetric state of a call with these arguments, allocated on first use (collective over
    `group`). Before capturing a CUDA graph, make one eager call of each shape instead: it also compiles
    and loads the kernel, which cannot happen during a capture."""
    group = group if group is not None else dist.group.WORLD
    layout = scatter_layout(a.shape, dim, b.shape[1], dist.get_world_size(group))
    flags = _flag_buffer(group)
    data = get_symm_buffer(group, _data_bytes(layout), torch.uint8, tag=DATA_TAG)
    _PREPARED.setdefault(group.group_name, set()).add(data.nbytes)
    return Buffers(
        data_table=data.buffer_ptrs_dev,
        data_offset=data.base_offset,
        data_half=data.nbytes // 2,
        flag_table=flags.buffer_ptrs_dev,
        flag_offset=flags.base_offset + EPOCH_SLOTS * 4,
        flag_half=FLAGS_PER_HALF,
        epochs=flags.view(0, EPOCH_SLOTS, torch.int32),
        status=flags.status,
    )


def check(group: dist.ProcessGroup | None = None) -> None:
    """Raise SymmMemTimeout (naming this rank, the op and the missing peer) if a wait of this op on
    `group` gave up; synchronizes the device. Call after a CUDA graph replay or in tests."""
    group = group if group is not None else dist.group.WORLD
    if group.group_name in _ZEROED:
        check_status(_flag_buffer(group), "matmul_reduce_scatter")


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
        group.group_name not in _ZEROED
        or size_class(_data_bytes(layout)) not in _PREPARED.get(group.group_name, ())
    ):
        raise RuntimeError(
            f"matmul_reduce_scatter: no symmetric buffers for a {tuple(a.shape)} x {tuple(b.shape)} call "
            "yet, and allocating them is collective: run one eager call with these shapes before "
            "capturing the CUDA graph"
        )
    buffers = prepare(a, b, dim, group)
    cfg = config or pick_config(layout.n)
    a = a.contiguous()
    # TMA needs 16-byte aligned bases. Copying an odd view (rare) rather than falling back keeps every
    # rank on the same path whatever its allocations.
    if a.data_ptr() % 16:
        a = a.clone()
    if b.data_ptr() % 16:
        b = b.clone() if is_kn_layout(b) else b.t().clone().t()
    a4 = a.view(layout.pieces, world, layout.rows, layout.k)
    out = torch.empty(output_shape(a.shape, dim, layout.n, world), dtype=a.dtype, device=a.device)
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    launch(
        a4,
        b,
        out.view(layout.pieces, layout.rows, layout.n),
        layout,
        buffers,
        dist.get_rank(group),
        cfg,
        grid_size(layout, cfg, num_sms),
        int(timeout_s * 1e9),
    )
    return out


def _resolve_group(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


def _matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """reduce_scatter(a @ b, dim) (sum) over the group `group_name`: the kernel where `fallback_reason`
    allows, the reference otherwise (the registered op's body)."""
    group = _resolve_group(group_name)
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
    world = _resolve_group(group_name).size()
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
