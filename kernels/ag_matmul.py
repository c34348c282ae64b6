"""All-gather + matmul (async tensor parallelism) over symmetric memory, and the reference.

    a, [a @ b0, a @ b1, ...] = all_gather_matmul(a_shard, [b0, b1, ...], dim, group)

`a` is every rank's `a_shard` concatenated along `dim` in rank order (the backward needs it). The
gather hides behind the matmul: copy engines pull the peers' shards while a persistent Triton GEMM
(tensor descriptors, i.e. TMA on Hopper) works through the row tiles whose rows have already arrived.

Data layout
-----------
A shard of shape [d0, ..., d_dim, ..., K] is seen as [P, R, K] with P = d0 * ... * d_{dim-1} pieces of
R = d_dim * ... * d_{last-1} rows. The gathered `a` (and every output) is then [P, W, R, K]: piece p of
rank r lives at index p * W + r of a [P * W, R, K] view. The GEMM addresses A and the outputs through
3-D descriptors of that view, so every row is read and written at its final position; dim=0 and 2-D
inputs are the case P = 1, the model's [B, S/W, D] with dim=1 is P = B. A row tile never crosses a
piece (R need not be a multiple of the tile: the descriptors clip).

One call (host choreography, all on the caller's stream S plus one high-priority side stream C)
----------------------------------------------------------------------------------------------
    S: GEMM over all tiles, own rows first (read       C: a_shard -> this rank's buffer, region x
       from a_shard, no wait); a peer's tile waits      C: entry barrier (every peer's shard is in place)
       on the flag of its rows' split                   C: for r = rank+1, ...:
                                                               a[rows of r, split q] <- peer r's region x
                                                               flag(r, q) = 1   (copy engine)
                                                        C: own rows of `a` <- a_shard
    S: wait for C; under CUDA-graph capture only: exit barrier

S runs nothing before the GEMM: the copy-in and the entry barrier (on 4x H100 6 and 15-17 us a
call at 4096 rows, the barrier absorbing the ranks' skew) overlap this rank's rows' tiles. The barrier is
a one-program kernel, so the GEMM leaves it one SM (gemm_programs).

The buffer holds three regions of a shard. Eager calls alternate between regions 0 and 1 (a host
counter per buffer, the same on every rank, as every rank makes the same calls) and need no exit
barrier: this rank overwrites eager call n's region in eager call n + 2, after it passed the entry
barrier of call n + 1 on C, which every peer reaches only after its own C finished its copies of call
n. A captured call cannot know how many eager calls will precede a replay, so captured calls use
region 2 and keep the exit barrier (no peer still reads the region when the next captured call writes
it).

Flags are a fresh zeroed uint32 tensor per call, written by `cuStreamWriteValue32` (it fences before
the write; kernels/stream_ops.py), eager and under CUDA-graph capture alike; copies and flag writes are
memory operations of the stream (copy engines, as PyTorch's own async-TP relies on), no kernel: the GEMM
that waits for them cannot starve them of SMs.
The barriers are the epoch barriers of kernels/symm_mem.py (bounded, device-side state), so eager
calls and graph replays mix.

Tile schedule (the order the persistent programs walk, program i taking tiles i, i + G, ...): ranks in
arrival order (own rank first, then rank+1, ...); inside a rank its row tiles are cut into `splits`
balanced runs, each run's tiles x every weight's column tiles, ordered by a group-M swizzle inside the
run (GROUP_M row tiles share their B tiles in L2); the column tiles of weight 0 come first, then
weight 1, ... so the A tiles of a row block are reused from L2 across weights.

Waits: before the first K-step of a tile of a peer's rows the program waits (acquire, system scope,
bounded) on its split's flag; on timeout it records (op, flag index, rank that owns the rows) in the
buffer's status word, and `check(group)` (or `check_status`) raises SymmMemTimeout naming the missing
rank. In the status word the "barrier" of a flag wait is 2 + its flag index (r * splits + q); 0 is
the entry and exit barriers'.

What runs where (decided here, and what comm.py's triton path gets):
* the kernel: bf16 a_shard and weights on CUDA, world size 2, 4 or 8, gather dim not the last, K and
  every N a multiple of 8 (TMA needs 16-byte row strides), all weights in one layout: `[K, N]`
  contiguous or `weight.t()` views of `[N, K]` contiguous weights (no weight is copied);
* the reference (NCCL all-gather + torch.matmul) for everything else that is well formed (another
  dtype, world size, a gather on the last dim, misaligned K or N), `fallback_reason` says why;
* an error for what no path can do: CPU tensors on the triton path, mismatched shapes or dtypes.
The first call for a shard size allocates the symmetric buffer (collective): call `prepare` (or one
eager call) before capturing a CUDA graph. The first call of each shape also makes its plan (`_CallPlan`:
buffer, config, copy offsets, launchers), so that later calls of an eager training step spend their host
time on allocating, queueing and launching only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import stream_ops
from kernels.launch import Launcher, Relaunch, launch
from kernels.symm_mem import (
    DEFAULT_TIMEOUT_S,
    INTERPRETED,
    SymmBuffer,
    advance_epoch,
    barrier,
    check_status,
    eager_or_op,
    fence_async_proxy,
    get_symm_buffer,
    load_epoch,
    op_id,
    resolve_group,
    size_class,
    sm_count,
    wait_flag,
    wait_flag_unbranched,
    warn_fallback,
)

SUPPORTED_WORLD_SIZES = (2, 4, 8)
MAX_WEIGHTS = 4  # weights per GEMM launch; more weights take further launches over the same `a`
TMA_ALIGN = 8  # bf16 elements per 16 bytes: K and N must be multiples (TMA row strides)
BUFFER_TAG = "ag_matmul"
OP = op_id("all_gather_matmul")
REGIONS = 3  # of the symmetric buffer: two for eager calls in turn, one for captured calls
CAPTURED_REGION = 2
REGION_ALIGN = 256
FLAG_WHERE_BASE = tl.constexpr(2)  # status "barrier" field of a flag wait: FLAG_WHERE_BASE + flag index


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    splits: int  # flag runs per rank's rows (copy-engine chunks)
    # flatten: the persistent loop and the K loop fused into one software-pipelined loop (Triton's
    # `flatten`), so the next tile's first loads are in flight during this tile's epilogue.
    # epilogue_split: the C tile stored in 1 or 2 column slices (half the epilogue staging in shared
    # memory, room for a deeper pipeline).
    flatten: bool = False
    epilogue_split: int = 1


# (largest total N over the weights, config), first match. 128x256x64 / 8 warps is the wgmma-friendly
# Hopper tile; with the loops flattened, the C tile stored in two halves and 4 stages (224 KiB of shared
# memory) it came within 1.01-1.05x of cuBLAS on one H100 where 3 stages unflattened were 1.02-1.08x
# (benchmarks/results/ag_matmul_gemm_sweep-h100.md). Narrow outputs get 128x128 tiles so that enough
# tiles exist to fill the SMs. Sweep: `python -m benchmarks.bench_ag_matmul --gemm-alone --sweep` (one
# GPU, the GEMM alone) and `torchrun --nproc_per_node=4 benchmarks/bench_ag_matmul.py --sweep`.
CONFIGS: tuple[tuple[int, GemmConfig], ...] = (
    (1024, GemmConfig(128, 128, 64, 8, 8, 4, 4)),
    (1 << 62, GemmConfig(128, 256, 64, 8, 8, 4, 4, flatten=True, epilogue_split=2)),
)


def pick_config(n_total: int) -> GemmConfig:
    """The table's config for weights whose column counts sum to `n_total`."""
    return next(cfg for max_n, cfg in CONFIGS if n_total <= max_n)


# ------------------------------------------------------------------------------------ layout math


@dataclasses.dataclass(frozen=True)
class GatherLayout:
    """A shard seen as [pieces, rows, k]; the gathered tensor as [pieces * world, rows, k]."""

    pieces: int
    rows: int
    k: int
    world: int

    def gathered_shape(self, shard_shape: Sequence[int], dim: int) -> list[int]:
        shape = list(shard_shape)
        shape[dim] *= self.world
        return shape


def gather_layout(shard_shape: Sequence[int], dim: int, world: int) -> GatherLayout:
    """[P, R, K] of a shard gathered along `dim` (not the last dim)."""
    nd = len(shard_shape)
    if nd < 2:
        raise ValueError(f"a_shard must have at least 2 dims (rows, K), got shape {tuple(shard_shape)}")
    if not -nd <= dim < nd:
        raise ValueError(f"dim {dim} is out of range for a {nd}-d a_shard")
    dim %= nd
    if dim == nd - 1:
        raise ValueError("gathering along the last (K) dim is not a row gather")
    return GatherLayout(
        pieces=math.prod(shard_shape[:dim]),
        rows=math.prod(shard_shape[dim:-1]),
        k=shard_shape[-1],
        world=world,
    )


def split_starts(tiles_per_rank: int, splits: int) -> list[int]:
    """First row tile (in a rank's tile order) of each split, plus the end: balanced runs."""
    return [q * tiles_per_rank // splits for q in range(splits + 1)]


def copy_plan(layout: GatherLayout, block_m: int, splits: int) -> list[list[tuple[int, int, int]]]:
    """For each split q of a rank's rows: (piece, first row, end row) ranges that its copies move.
    A rank's row tiles are numbered piece-major (piece b holds tiles b * T .. b * T + T - 1, T =
    ceil(rows / block_m)), the numbering the kernel's `_tile_coords` uses."""
    per_piece = triton.cdiv(layout.rows, block_m)
    starts = split_starts(layout.pieces * per_piece, splits)
    plan = []
    for q in range(splits):
        ranges = []
        for b in range(layout.pieces):
            lo = max(starts[q], b * per_piece) - b * per_piece
            hi = min(starts[q + 1], (b + 1) * per_piece) - b * per_piece
            if lo < hi:
                ranges.append((b, lo * block_m, min(hi * block_m, layout.rows)))
        plan.append(ranges)
    return plan


@functools.cache
def row_copies(
    layout: GatherLayout, block_m: int, splits: int, src: int, element_size: int
) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """`copy_plan` in bytes, for the rows of rank `src`: per split, (offset in the gathered `a`, offset
    in a shard, bytes) of each range. What the side stream hands the copy engines (raw addresses: a
    torch slice and copy_ per range cost the host twice as much)."""
    row_bytes = layout.k * element_size
    return tuple(
        tuple(
            (((b * layout.world + src) * layout.rows + lo) * row_bytes, (b * layout.rows + lo) * row_bytes,
             (hi - lo) * row_bytes)
            for b, lo, hi in ranges
        )
        for ranges in copy_plan(layout, block_m, splits)
    )  # fmt: skip


# ------------------------------------------------------------------------------------ the kernels


@triton.jit
def _tile_coords(
    tile, tiles_per_rank, tiles_per_piece, nt0, nt1, nt2, nt3,
    RANK: tl.constexpr, WORLD: tl.constexpr, NUM_W: tl.constexpr, SPLITS: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """tile -> (source rank, split, piece index in the gathered view, row tile in the piece, weight,
    column tile of that weight). See the module docstring for the order."""
    nt = nt0 + nt1 + nt2 + nt3
    per_rank = tiles_per_rank * nt
    step = tile // per_rank
    rem = tile - step * per_rank
    src = (RANK + step) % WORLD
    q = rem * 0
    for qq in tl.static_range(1, SPLITS):
        q += (rem >= (qq * tiles_per_rank // SPLITS) * nt).to(q.dtype)
    m_first = q * tiles_per_rank // SPLITS
    m_count = (q + 1) * tiles_per_rank // SPLITS - m_first
    local = rem - m_first * nt
    in_group = GROUP_M * nt
    first = (local // in_group) * GROUP_M
    group_rows = tl.minimum(m_count - first, GROUP_M)
    m = m_first + first + (local % in_group) % group_rows
    j = (local % in_group) // group_rows
    piece = (m // tiles_per_piece) * WORLD + src
    row_tile = m % tiles_per_piece
    w = j * 0
    if NUM_W > 1:
        past = (j >= nt0).to(j.dtype)
        w += past
        j -= nt0 * past
    if NUM_W > 2:
        past = ((w == 1) & (j >= nt1)).to(j.dtype)
        w += past
        j -= nt1 * past
    if NUM_W > 3:
        past = ((w == 2) & (j >= nt2)).to(j.dtype)
        w += past
        j -= nt2 * past
    return src, q, piece, row_tile, w, j


@triton.jit
def _wait_rows(flag_ptr, status_ptr, where, src, timeout_ns, OP_ID: tl.constexpr, FENCE: tl.constexpr):
    """Wait until the copy of these rows has landed: an acquire read first (the common case, the flag
    is already set), the bounded spin of kernels/symm_mem.py only when it is not; then the proxy fence
    that orders the TMA loads of those rows after the acquire."""
    arrived = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if arrived == 0:
        wait_flag(flag_ptr, 1, status_ptr, OP_ID, where, src, timeout_ns)
    fence_async_proxy(FENCE)


@triton.jit
def _tile(a_desc, a_piece, b_desc, c_desc, c_piece, row0, n0, k_tiles,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, B_KN: tl.constexpr,
          EPI: tl.constexpr):  # fmt: skip
    """C[c_piece, row0:+BM, n0:+BN] = A[a_piece, row0:+BM, :] @ B[:, n0:+BN], fp32 accumulation. B_KN:
    B is stored [K, N]; otherwise [N, K] (an nn.Linear weight, used transposed). EPI: store C in 1 or 2
    column slices (`c_desc`'s block is BN / EPI wide)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(k_tiles):
        k = ki * BK
        a = a_desc.load([a_piece, row0, k]).reshape(BM, BK)
        acc = tl.dot(a, b_desc.load([k, n0]), acc) if B_KN else tl.dot(a, b_desc.load([n0, k]).T, acc)
    c = acc.to(c_desc.dtype)
    if EPI == 2:
        left, right = tl.split(tl.permute(tl.reshape(c, (BM, 2, BN // 2)), (0, 2, 1)))
        c_desc.store([c_piece, row0, n0], left.reshape(1, BM, BN // 2))
        c_desc.store([c_piece, row0, n0 + BN // 2], right.reshape(1, BM, BN // 2))
    else:
        c_desc.store([c_piece, row0, n0], c.reshape(1, BM, BN))


@triton.jit
def _tile_of_weight(
    a_desc, a_piece, b0_desc, b1_desc, b2_desc, b3_desc, c0_desc, c1_desc, c2_desc, c3_desc,
    w, c_piece, row0, n0, k_tiles,
    NUM_W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, B_KN: tl.constexpr,
    EPI: tl.constexpr,
):  # fmt: skip
    """`_tile` with weight w's B and C descriptors (descriptors cannot be indexed at run time)."""
    if w == 0:
        _tile(a_desc, a_piece, b0_desc, c0_desc, c_piece, row0, n0, k_tiles, BM, BN, BK, B_KN, EPI)
    if NUM_W > 1 and w == 1:
        _tile(a_desc, a_piece, b1_desc, c1_desc, c_piece, row0, n0, k_tiles, BM, BN, BK, B_KN, EPI)
    if NUM_W > 2 and w == 2:
        _tile(a_desc, a_piece, b2_desc, c2_desc, c_piece, row0, n0, k_tiles, BM, BN, BK, B_KN, EPI)
    if NUM_W > 3 and w == 3:
        _tile(a_desc, a_piece, b3_desc, c3_desc, c_piece, row0, n0, k_tiles, BM, BN, BK, B_KN, EPI)


@triton.jit
def _ag_matmul_kernel(
    own_desc, a_desc, b0_desc, b1_desc, b2_desc, b3_desc, c0_desc, c1_desc, c2_desc, c3_desc,
    flags_ptr, status_ptr, timeout_ns, k, tiles_per_piece, pieces, nt0, nt1, nt2, nt3,
    RANK: tl.constexpr, WORLD: tl.constexpr, NUM_W: tl.constexpr, SPLITS: tl.constexpr,
    B_KN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, OP_ID: tl.constexpr, FENCE: tl.constexpr, FLAT: tl.constexpr, EPI: tl.constexpr,
):  # fmt: skip
    """Persistent GEMM over the gathered rows: program i takes tiles i, i + G, ... of `_tile_coords`'
    order. Own rows are read from this rank's shard (`own_desc`, [P, R, K]) without waiting; a peer's
    rows from the gathered `a` (`a_desc`, [P * W, R, K]) once the flag of their split is set."""
    tiles_per_rank = pieces * tiles_per_piece
    total = WORLD * tiles_per_rank * (nt0 + nt1 + nt2 + nt3)
    k_tiles = tl.cdiv(k, BK)
    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLAT):
        src, q, piece, row_tile, w, n_tile = _tile_coords(
            tile, tiles_per_rank, tiles_per_piece, nt0, nt1, nt2, nt3,
            RANK, WORLD, NUM_W, SPLITS, GROUP_M,
        )  # fmt: skip
        row0 = row_tile * BM
        n0 = n_tile * BN
        a_piece = piece // WORLD
        if FLAT and FENCE:
            # Every tile waits (own rows on target 0: at once), and the loads' coordinate comes out of
            # the wait, so that the pipeliner cannot issue a tile's loads before its wait.
            flag = src * SPLITS + q
            a_piece = wait_flag_unbranched(
                flags_ptr + flag, (src != RANK).to(tl.int32), tl.where(src != RANK, piece, a_piece),
                status_ptr, OP_ID, FLAG_WHERE_BASE + flag, src, timeout_ns, True,
            )  # fmt: skip
        elif src != RANK:
            flag = src * SPLITS + q
            _wait_rows(flags_ptr + flag, status_ptr, FLAG_WHERE_BASE + flag, src, timeout_ns, OP_ID, FENCE)
            a_piece = piece
        a_d = own_desc
        if src != RANK:
            a_d = a_desc
        _tile_of_weight(
            a_d, a_piece, b0_desc, b1_desc, b2_desc, b3_desc, c0_desc, c1_desc, c2_desc,
            c3_desc, w, piece, row0, n0, k_tiles, NUM_W, BM, BN, BK, B_KN, EPI,
        )  # fmt: skip


@triton.jit
def _barrier_kernel(pad_ptrs, epoch_ptr, status_ptr, timeout_ns,
                    RANK: tl.constexpr, WORLD: tl.constexpr, OP_ID: tl.constexpr):  # fmt: skip
    """One program: meet program 0 of every peer (kernels/symm_mem.py's epoch barrier 0)."""
    epoch = load_epoch(epoch_ptr, 0)
    barrier(pad_ptrs, 0, 0, epoch + 1, status_ptr, OP_ID, timeout_ns, RANK, WORLD)
    advance_epoch(epoch_ptr, 0, epoch)


def is_kn_layout(b: torch.Tensor) -> bool:
    """True for a contiguous [K, N] matrix, False for `weight.t()` of a contiguous [N, K] weight."""
    if b.is_contiguous():
        return True
    if b.t().is_contiguous():
        return False
    raise ValueError(
        f"weight of shape {tuple(b.shape)} and strides {b.stride()} is neither a contiguous [K, N] "
        "matrix nor the transpose of a contiguous [N, K] one: pass weight.t() or a contiguous tensor"
    )


def launch_gemm(
    own: torch.Tensor,
    a_out: torch.Tensor,
    layout: GatherLayout,
    bs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    flags: torch.Tensor,
    status: torch.Tensor,
    rank: int,
    config: GemmConfig,
    num_programs: int,
    timeout_ns: int,
    launcher: Launcher = launch,
) -> triton.compiler.CompiledKernel:
    """Launch the persistent GEMM (through `launcher`): outs[i] (viewed [P * W, R, N_i]) = A @ bs[i],
    A's rows of this rank read from `own` ([P, R, K], contiguous), the other rows from `a_out` (viewed
    [P * W, R, K]) after flags[src * splits + q] is set (`config.splits` clamped to the row tiles per
    rank, as `all_gather_matmul_kernel` does). `a_out`'s own rows are neither read nor written.
    Returns the compiled kernel."""
    if not 1 <= len(bs) <= MAX_WEIGHTS or len(outs) != len(bs):
        raise ValueError(f"1 to {MAX_WEIGHTS} weights with one output each, got {len(bs)} / {len(outs)}")
    kn = {is_kn_layout(b) for b in bs}
    if len(kn) != 1:
        raise ValueError("all weights of one call must share a layout ([K, N] or weight.t() views)")
    b_kn = kn.pop()
    if config.epilogue_split not in (1, 2):
        raise ValueError(f"epilogue_split must be 1 or 2, got {config.epilogue_split}")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    pw, r, k = layout.pieces * layout.world, layout.rows, layout.k
    a_desc = TensorDescriptor(a_out, [pw, r, k], [r * k, k, 1], [1, bm, bk])
    own_desc = TensorDescriptor(own, [layout.pieces, r, k], [r * k, k, 1], [1, bm, bk])
    b_descs, c_descs, n_tiles = [], [], []
    for b, c in zip(bs, outs, strict=True):
        n = b.shape[1]
        if b_kn:
            b_descs.append(TensorDescriptor(b, [k, n], [n, 1], [bk, bn]))
        else:
            b_descs.append(TensorDescriptor(b.t(), [n, k], [k, 1], [bn, bk]))
        c_descs.append(TensorDescriptor(c, [pw, r, n], [r * n, n, 1], [1, bm, bn // config.epilogue_split]))
        n_tiles.append(triton.cdiv(n, bn))
    # Unused weight slots get None (a constexpr the kernel never touches past NUM_W): a descriptor
    # there would cost a TMA encode per launch for nothing.
    unused = MAX_WEIGHTS - len(bs)
    b_descs += [None] * unused
    c_descs += [None] * unused
    n_tiles += [0] * unused
    return launcher(
        _ag_matmul_kernel, (num_programs,), own_desc, a_desc, *b_descs, *c_descs,
        flags, status, timeout_ns, k, triton.cdiv(r, bm), layout.pieces, *n_tiles,
        RANK=rank, WORLD=layout.world, NUM_W=len(bs), SPLITS=config.splits, B_KN=b_kn,
        BM=bm, BN=bn, BK=bk, GROUP_M=config.group_m, OP_ID=OP, FENCE=not INTERPRETED,
        FLAT=config.flatten, EPI=config.epilogue_split, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


# The table's copy chunks hold at least this many row tiles of a peer's rows. On 4x H200 (bench_ag_matmul
# --sweep, ag_matmul_sweep_splits-h200-x4.md) one chunk per peer beat four at 8 and 16 row tiles per rank
# (4096 4096 7168: 1.151 -> 1.126x cuBLAS, 8192 4096 7168: 1.113 -> 1.086), where each chunk's copy,
# flag write and first wait are a larger share of the call; at 32 (16384 rows) four were faster (1.006
# against 1.044 at 16384 8192 14336) and two as fast.
MIN_TILES_PER_SPLIT = 16


def resolve_config(layout: GatherLayout, bs: Sequence[torch.Tensor], config: GemmConfig | None) -> GemmConfig:
    """The config a call runs: `config`, or the table's for these weights with its splits cut to chunks
    of at least MIN_TILES_PER_SPLIT row tiles; either way its splits clamped to the row tiles per rank."""
    return _resolved_config(layout, sum(b.shape[1] for b in bs), config)


@functools.cache
def _resolved_config(layout: GatherLayout, n_total: int, config: GemmConfig | None) -> GemmConfig:
    cfg = config or pick_config(n_total)
    tiles_per_rank = layout.pieces * triton.cdiv(layout.rows, cfg.block_m)
    splits = min(cfg.splits, tiles_per_rank)
    if config is None:
        splits = min(splits, tiles_per_rank // MIN_TILES_PER_SPLIT)
    return dataclasses.replace(cfg, splits=max(1, splits))


def gemm_programs(device: torch.device) -> int:
    """Programs of the persistent GEMM: one per SM but one. The entry barrier runs on the side stream
    while the GEMM works through this rank's rows, and the GEMM's later tiles wait for copies that
    follow the barrier: one SM is left free of GEMM programs so that the barrier kernel always finds
    one."""
    return max(1, sm_count(device) - 1)


def run_gemms(
    own: torch.Tensor,
    a_out: torch.Tensor,
    layout: GatherLayout,
    bs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    flags: torch.Tensor,
    status: torch.Tensor,
    rank: int,
    config: GemmConfig,
    num_sms: int,
    timeout_ns: int,
    launchers: Sequence[Launcher] | None = None,
) -> triton.compiler.CompiledKernel | None:
    """The GEMM launches of one call (`launch_gemm` with up to MAX_WEIGHTS weights each, the i-th
    through launchers[i], default `launch`), one program per SM or per tile where there are fewer
    tiles. Returns the last launch's compiled kernel."""
    kernel = None
    for i, start in enumerate(range(0, len(bs), MAX_WEIGHTS)):
        part = slice(start, start + MAX_WEIGHTS)
        tiles = (
            layout.world
            * layout.pieces
            * triton.cdiv(layout.rows, config.block_m)
            * sum(triton.cdiv(b.shape[1], config.block_n) for b in bs[part])
        )
        kernel = launch_gemm(
            own,
            a_out,
            layout,
            bs[part],
            outs[part],
            flags,
            status,
            rank,
            config,
            min(num_sms, tiles),
            timeout_ns,
            launch if launchers is None else launchers[i],
        )
    return kernel


class GemmAlone:
    """The GEMM of one `all_gather_matmul_kernel` call of rank `rank` of `world`, with the communication
    taken out: the gathered `a` is already in place and every flag is set, so no tile waits. Same config
    picking, tile schedule, descriptors and launches as the call (`run_gemms`), in one process without
    a process group: what `--gemm-alone` in the benchmarks times beside torch.matmul on `a`.

    `a` is the gathered input (dim `dim` holds the W shards in rank order), `bs` the weights as the call
    takes them; `run()` returns [a @ b for b in bs] (preallocated outputs, rewritten by every run).
    `num_sms` (default: the call's, gemm_programs) caps the programs per launch."""

    def __init__(
        self,
        a: torch.Tensor,
        bs: Sequence[torch.Tensor],
        dim: int,
        rank: int,
        world: int,
        config: GemmConfig | None = None,
        num_sms: int | None = None,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        dim %= a.dim()
        if a.shape[dim] % world:
            raise ValueError(f"dim {dim} of a has size {a.shape[dim]}, which is not {world} shards")
        shard_shape = list(a.shape)
        shard_shape[dim] //= world
        self.layout = gather_layout(shard_shape, dim, world)
        self.a = a.contiguous()
        a4 = self.a.view(self.layout.pieces, world, self.layout.rows, self.layout.k)
        self.own = a4[:, rank].contiguous()  # the call reads its own rows from its shard
        self.bs = list(bs)
        self.rank = rank
        self.config = resolve_config(self.layout, self.bs, config)
        self.num_sms = num_sms if num_sms is not None else gemm_programs(a.device)
        self.flags = torch.ones(world * self.config.splits + 1, dtype=torch.uint32, device=a.device)
        self.status = torch.zeros(4, dtype=torch.int32, device=a.device)
        # NaN until the kernel writes them: a config that wrote nothing would otherwise pass its check on
        # a block the allocator reused from an earlier config's correct output.
        self.outs = [
            torch.full((*a.shape[:-1], b.shape[1]), float("nan"), dtype=a.dtype, device=a.device) for b in bs
        ]
        self.kernels: tuple[triton.compiler.CompiledKernel, ...] = ()  # the last run's last launch

    def run(self) -> list[torch.Tensor]:
        last = run_gemms(
            self.own, self.a, self.layout, self.bs, self.outs, self.flags, self.status, self.rank,
            self.config, self.num_sms, int(DEFAULT_TIMEOUT_S * 1e9),
        )  # fmt: skip
        self.kernels = (last,)
        return self.outs


# ------------------------------------------------------------------------------------ reference


def all_gather_matmul_reference(
    a_shard: torch.Tensor, bs: Sequence[torch.Tensor], dim: int, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stock path: all_gather_into_tensor (NCCL / gloo), then one torch.matmul per weight."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    dim %= a_shard.dim()
    if world == 1:
        a = a_shard
    else:
        shard = a_shard.contiguous()
        flat = torch.empty((world * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(flat, shard, group=group)
        a = flat.unflatten(0, (world, -1)).movedim(0, dim).flatten(dim, dim + 1) if dim else flat
    return a, [torch.matmul(a, b) for b in bs]


# ------------------------------------------------------------------------------------ dispatch


def check_inputs(a_shard: torch.Tensor, bs: Sequence[torch.Tensor], dim: int) -> None:
    """Errors for calls no path can run (raised before any communication)."""
    if not bs:
        raise ValueError("all_gather_matmul needs at least one weight")
    nd = a_shard.dim()
    if nd < 2 or not -nd <= dim < nd:
        raise ValueError(f"dim {dim} is invalid for a_shard of shape {tuple(a_shard.shape)}")
    for i, b in enumerate(bs):
        if b.dim() != 2 or b.shape[0] != a_shard.shape[-1]:
            raise ValueError(
                f"weight {i} has shape {tuple(b.shape)}; a_shard {tuple(a_shard.shape)} needs "
                f"[{a_shard.shape[-1]}, N] (pass an nn.Linear weight as weight.t())"
            )
        if b.dtype != a_shard.dtype or b.device != a_shard.device:
            raise ValueError(
                f"weight {i} is {b.dtype} on {b.device}, a_shard {a_shard.dtype} on {a_shard.device}: "
                "cast them to one dtype on one device"
            )


def fallback_reason(a_shard: torch.Tensor, bs: Sequence[torch.Tensor], dim: int, world: int) -> str | None:
    """Why the kernel cannot run this call (the reference runs it instead), or None."""
    if world not in SUPPORTED_WORLD_SIZES:
        return f"world size {world} (the kernel serves {SUPPORTED_WORLD_SIZES})"
    if a_shard.dtype != torch.bfloat16:
        return f"dtype {a_shard.dtype} (the kernel is bf16)"
    if dim % a_shard.dim() == a_shard.dim() - 1:
        return "gather along the last dim"
    if a_shard.shape[-1] % TMA_ALIGN or any(b.shape[1] % TMA_ALIGN for b in bs):
        return f"K or N not a multiple of {TMA_ALIGN} (TMA needs 16-byte row strides)"
    if a_shard.numel() == 0 or any(b.shape[1] == 0 for b in bs):
        return "an empty operand"
    try:
        layouts = {is_kn_layout(b) for b in bs}
    except ValueError as err:
        return str(err)
    if len(layouts) != 1:
        return "weights in mixed layouts ([K, N] and weight.t())"
    if any(b.data_ptr() % 16 for b in bs):
        return "a weight not 16-byte aligned"
    return None


class _SideStream:
    """The high-priority stream of the copy-engine work on one device, and two events reused by every
    call to fork it from the caller's stream and join it back (`Stream.wait_stream` makes a new event
    each time)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self.forked, self.joined = torch.cuda.Event(), torch.cuda.Event()

    def fork(self, main: torch.cuda.Stream) -> None:
        self.forked.record(main)
        self.stream.wait_event(self.forked)

    def join(self, main: torch.cuda.Stream) -> None:
        self.joined.record(self.stream)
        main.wait_event(self.joined)


_SIDE_STREAMS: dict[int, _SideStream] = {}


def _side_stream(device: torch.device) -> _SideStream:
    """The device's side stream (one per device, reused)."""
    side = _SIDE_STREAMS.get(device.index)
    if side is None:
        side = _SIDE_STREAMS[device.index] = _SideStream(device)
    return side


def _run_barrier(
    buf: SymmBuffer, timeout_ns: int, stream: torch.cuda.Stream | None = None, launcher: Launcher = launch
) -> None:
    """The entry / exit barrier on `stream` (default: the current stream), launched by `launcher`."""
    launcher(
        _barrier_kernel, (1,), buf.signal_pad_ptrs_dev, buf.epoch, buf.status, timeout_ns,
        RANK=buf.rank, WORLD=buf.world_size, OP_ID=OP, num_warps=1, stream=stream,
    )  # fmt: skip


# Group name -> size classes of this op's buffers (kernels/symm_mem.py caches the buffers themselves).
_PREPARED: dict[str, set[int]] = {}
# (group name, buffer bytes) -> eager calls made on that buffer (region choice, `next_region`).
_EAGER_CALLS: dict[tuple[str, int], int] = {}


def buffer_bytes(shard_bytes: int) -> int:
    """Bytes to ask of the buffer for shards of `shard_bytes`: three regions of whole REGION_ALIGN units."""
    return REGIONS * -(-shard_bytes // REGION_ALIGN) * REGION_ALIGN


def region_offset(buffer_nbytes: int, region: int) -> int:
    """Byte offset of `region` in a buffer of `buffer_nbytes`: a third of it, fixed per buffer, so that
    calls of every shard size that buffer serves see the same regions."""
    return region * (buffer_nbytes // REGIONS // REGION_ALIGN * REGION_ALIGN)


def next_region(key: tuple[str, int], capturing: bool) -> int:
    """The region of the next call on the buffer `key` (group name, bytes): 2 under capture, else 0 and
    1 in turn, counted per buffer on the host."""
    if capturing:
        return CAPTURED_REGION
    calls = _EAGER_CALLS.get(key, 0)
    _EAGER_CALLS[key] = calls + 1
    return calls % 2


def prepare(group: dist.ProcessGroup, shard_bytes: int) -> SymmBuffer:
    """The symmetric buffer for shards of up to `shard_bytes` bytes, allocated on first use of its
    size class (collective over `group`). Before capturing a CUDA graph, make one eager call with the
    shapes the graph will use: it allocates the buffer and also compiles and loads the kernels, which
    cannot happen during a capture."""
    buf = get_symm_buffer(group, buffer_bytes(shard_bytes), tag=BUFFER_TAG)
    _PREPARED.setdefault(group.group_name, set()).add(buf.nbytes)
    return buf


def check(group: dist.ProcessGroup | None = None) -> None:
    """Raise SymmMemTimeout (naming this rank, the op and the missing peer) if a wait of this op on
    `group` gave up; synchronizes the device. Call after a CUDA graph replay or in tests."""
    group = group if group is not None else dist.group.WORLD
    for nbytes in sorted(_PREPARED.get(group.group_name, ())):
        check_status(get_symm_buffer(group, nbytes, tag=BUFFER_TAG), "all_gather_matmul")


@dataclasses.dataclass
class _CallPlan:
    """What every call of one shape does the same (host work done once per shape): the buffer, config,
    the copies as raw offsets and the launches, which skip launch.py's key after their first call.

    `peer_copies`: per (peer, split), in queue order, the ranges (offset in the gathered `a`, peer
    rank, offset in its shard, bytes) and the flag's byte offset; `own_copies`: (offset in `a`, offset
    in the shard, bytes) of this rank's rows."""

    buf: SymmBuffer
    layout: GatherLayout
    config: GemmConfig
    timeout_ns: int
    nbytes: int
    gathered_shape: list[int]
    out_shapes: list[list[int]]
    peer_copies: list[tuple[list[tuple[int, int, int, int]], int]]
    own_copies: tuple[tuple[int, int, int], ...]
    programs: int
    side_barrier: Relaunch = dataclasses.field(default_factory=Relaunch)
    exit_barrier: Relaunch = dataclasses.field(default_factory=Relaunch)
    gemms: list[Relaunch] = dataclasses.field(default_factory=list)


# (group name, shard shape and dtype, dim, weights' shapes and strides, config, timeout) -> the call's plan.
_PLANS: dict[tuple, _CallPlan] = {}
MAX_PLANS = 256  # call shapes kept; past it the plans are dropped and made again as met


def _call_plan(
    shard_shape: tuple[int, ...], bs: Sequence[torch.Tensor], dim: int, group: dist.ProcessGroup,
    config: GemmConfig | None, timeout_s: float, dtype: torch.dtype,
) -> _CallPlan:  # fmt: skip
    key = (
        group.group_name, shard_shape, dtype, dim, tuple((tuple(b.shape), b.stride()) for b in bs), config,
        timeout_s,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    world = dist.get_world_size(group)
    layout = gather_layout(shard_shape, dim, world)
    element_size = dtype.itemsize
    nbytes = math.prod(shard_shape) * element_size
    if torch.cuda.is_current_stream_capturing() and size_class(buffer_bytes(nbytes)) not in _PREPARED.get(
        group.group_name, ()
    ):
        raise RuntimeError(
            f"all_gather_matmul: no symmetric buffer for {nbytes}-byte shards yet, and allocating one "
            "is collective: run one eager call with these shapes before capturing the CUDA graph"
        )
    buf = prepare(group, nbytes)
    cfg = resolve_config(layout, bs, config)
    rank, splits = buf.rank, cfg.splits
    peer_copies = []
    for step in range(1, world):
        src = (rank + step) % world
        for q, ranges in enumerate(row_copies(layout, cfg.block_m, splits, src, element_size)):
            flag = 4 * (src * splits + q)
            peer_copies.append(([(to, src, start, count) for to, start, count in ranges], flag))
    gathered = layout.gathered_shape(shard_shape, dim)
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    plan = _PLANS[key] = _CallPlan(
        buf=buf, layout=layout, config=cfg, timeout_ns=int(timeout_s * 1e9), nbytes=nbytes,
        gathered_shape=gathered, out_shapes=[[*gathered[:-1], b.shape[1]] for b in bs],
        peer_copies=peer_copies, own_copies=row_copies(layout, cfg.block_m, 1, rank, element_size)[0],
        programs=gemm_programs(torch.device("cuda", torch.cuda.current_device())),
    )  # fmt: skip
    plan.gemms = [Relaunch() for _ in range(0, len(bs), MAX_WEIGHTS)]
    return plan


def all_gather_matmul_kernel(
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    dim: int,
    group: dist.ProcessGroup,
    config: GemmConfig | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The kernel path (callers check `fallback_reason` first): see the module docstring."""
    dim %= a_shard.dim()
    plan = _call_plan(tuple(a_shard.shape), bs, dim, group, config, timeout_s, a_shard.dtype)
    buf, layout, cfg = plan.buf, plan.layout, plan.config
    shard = a_shard.contiguous().view(layout.pieces, layout.rows, layout.k)
    capturing = torch.cuda.is_current_stream_capturing()
    region = region_offset(buf.nbytes, next_region((group.group_name, buf.nbytes), capturing))

    device = a_shard.device
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    a = torch.empty(plan.gathered_shape, dtype=a_shard.dtype, device=device)
    outs = [torch.empty(shape, dtype=a.dtype, device=device) for shape in plan.out_shapes]
    flags = torch.zeros(layout.world * cfg.splits, dtype=torch.uint32, device=device)
    if shard.data_ptr() % 16:  # the GEMM's TMA descriptor of the own rows needs a 16-byte aligned base
        shard = shard.clone()
    side.fork(main)  # the shard and the zeroed flags are ready
    # The copies are queued before the GEMM that waits for them, so that launches serialised by a
    # tool (CUDA_LAUNCH_BLOCKING=1, a profiler) cannot leave the GEMM spinning on copies not yet queued.
    copies = side.stream.cuda_stream
    regions = [address + region for address in buf.addresses]
    a_ptr, shard_ptr, flags_ptr = a.data_ptr(), shard.data_ptr(), flags.data_ptr()
    stream_ops.copy(copies, regions[buf.rank], shard_ptr, plan.nbytes)
    _run_barrier(buf, plan.timeout_ns, side.stream, plan.side_barrier)  # every peer's shard is in its buffer
    for ranges, flag in plan.peer_copies:
        for to, src, start, count in ranges:
            stream_ops.copy(copies, a_ptr + to, regions[src] + start, count)
        # After the split's copies (the write fences): no kernel, and captured into CUDA graphs.
        stream_ops.write(copies, flags_ptr + flag, 1)
    # This rank's rows of the result, last: nothing waits for them but the end of the call.
    for to, start, count in plan.own_copies:
        stream_ops.copy(copies, a_ptr + to, shard_ptr + start, count)
    # The GEMM starts at once on this rank's rows (read from the shard itself) while the side stream
    # copies the shard in, meets the peers and pulls theirs.
    run_gemms(
        shard, a, layout, bs, outs, flags, buf.status, buf.rank, cfg, plan.programs, plan.timeout_ns,
        plan.gemms,
    )  # fmt: skip
    side.join(main)
    if capturing:  # eager calls need no exit barrier (module docstring)
        _run_barrier(buf, plan.timeout_ns, launcher=plan.exit_barrier)
    return a, outs


def _all_gather_matmul(
    a_shard: torch.Tensor, bs: list[torch.Tensor], dim: int, group_name: str
) -> list[torch.Tensor]:
    """[all_gather(a_shard, dim), a @ bs[0], a @ bs[1], ...] over the group `group_name`: the kernel
    where `fallback_reason` allows, the reference otherwise (the registered op's body)."""
    check_inputs(a_shard, bs, dim)
    if not a_shard.is_cuda:
        raise ValueError(
            f"all_gather_matmul (parallel.comm=triton) needs CUDA tensors, got a_shard on {a_shard.device}: "
            "use parallel.comm=torch (or all_gather_matmul_reference) on CPU"
        )
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    if world == 1:
        a = a_shard.clone()
        return [a, *(torch.matmul(a, b) for b in bs)]
    reason = fallback_reason(a_shard, bs, dim, world)
    if reason is None:
        a, outs = all_gather_matmul_kernel(a_shard, bs, dim, group)
    else:
        warn_fallback("all_gather_matmul", reason)
        a, outs = all_gather_matmul_reference(a_shard, bs, dim, group)
    return [a, *outs]


all_gather_matmul_op = torch.library.custom_op("weft::all_gather_matmul", _all_gather_matmul, mutates_args=())


@all_gather_matmul_op.register_fake
def _(a_shard: torch.Tensor, bs: list[torch.Tensor], dim: int, group_name: str) -> list[torch.Tensor]:
    shape = list(a_shard.shape)
    shape[dim % a_shard.dim()] *= resolve_group(group_name).size()
    return [a_shard.new_empty(shape), *(a_shard.new_empty((*shape[:-1], b.shape[1])) for b in bs)]


def all_gather_matmul(
    a_shard: torch.Tensor, bs: Sequence[torch.Tensor], dim: int, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(all_gather(a_shard, dim), [a @ b for b in bs]) over `group` (default: the world): what
    parallel/comm.py's triton path calls. torch.compile traces the registered op
    weft::all_gather_matmul; eager calls run its body directly (see `eager_or_op`)."""
    group = group if group is not None else dist.group.WORLD
    run = eager_or_op(_all_gather_matmul, torch.ops.weft.all_gather_matmul)
    a, *outs = run(a_shard, list(bs), dim, group.group_name)
    return a, outs
