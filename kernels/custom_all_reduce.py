"""`CustomAllReduce`: weft's decode all-reduce for one process group, and its dispatch rules.

    car = CustomAllReduce(group)              # collective: allocates + rendezvouses once
    y = car(x)                                # eager or inside a CUDA graph: sum over the group
    buf = car.input_buffer((batch, hidden), torch.bfloat16)
    torch.matmul(h, w_shard.t(), out=buf)     # row-parallel partial sums written in place
    y = car(buf)                              # no copy: the kernel reads the peers' buffers directly
    torch.ops.weft.symm_all_reduce(x, group.group_name)   # the same, as a registered op

Four kernels (kernels/all_reduce.py): one_shot and two_shot (copy-in, barrier, remote reads) and
one_shot_push and two_shot_push (remote stores whose data is its own flag: no barrier; a second
symmetric buffer of 3 sets of slots, filled with the sentinel at construction; messages up to
`push_max_size`). `choose_algorithm` walks AUTO_ALGORITHMS[world size][dtype], size ranges measured on
GPUs of one node, and takes the first row that covers the size and whose kernel can take it; NCCL
(dist.all_reduce) above `max_size`, for unsupported world sizes / dtypes, and for sizes that are not
whole 16-byte vectors. The rules are plain Python (tests/test_all_reduce_dispatch.py runs them on CPU).

Direct use (`input_buffer`): the returned tensor is this rank's `direct` region of the symmetric
buffer. Write the partial sums into it, then call the all-reduce on it (or on a leading slice of it
that starts at its first element); the kernels only read it (the push kernels read it like any other
input). There is one direct region per object: write the next call's partials only after the
previous call was issued (stream order does the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.all_reduce import (
    PUSH_ALGORITHMS,
    SENTINEL,
    SUPPORTED_DTYPES,
    VECTOR_BYTES,
    PushLayout,
    all_reduce_reference,
    launch_all_reduce,
    launch_push_all_reduce,
    region_offset,
)
from kernels.symm_mem import (
    DEFAULT_TIMEOUT_S,
    MAX_BLOCKS,
    MAX_PROGRAMS,
    SymmBuffer,
    check_status,
    get_symm_buffer,
)

SUPPORTED_WORLD_SIZES = (2, 4, 8)
DEFAULT_MAX_SIZE = 32 << 20
# Largest message of the push kernels. Their buffer holds 3 (W + 2) slots of this size (world 4:
# 18 x 4 MiB, rounded up to a power of two: 128 MiB).
DEFAULT_PUSH_MAX_SIZE = 4 << 20
ALGORITHMS = ("one_shot", "two_shot", *PUSH_ALGORITHMS)
KiB, MiB = 1 << 10, 1 << 20

# (up to bytes, algorithm) rows per world size and dtype: the first row whose bound covers the size
# and whose kernel can take it wins (a push row past the object's push_max_size falls through).
# World 2 (`torchrun --nproc_per_node=2 -m benchmarks.bench_all_reduce --sweep` on 2x H200,
# benchmarks/results/all_reduce_sweep-h200-x2.md, before the push kernels existed): one-shot was
# faster than two-shot at every size from 4 KiB to 32 MiB (two GPUs: both move the same bytes,
# two-shot pays a second barrier). The push kernels are not measured on 2 GPUs: replace from a sweep.
# World 4 (`torchrun --nproc_per_node=4 -m benchmarks.bench_all_reduce` on 4x H100,
# benchmarks/results/all_reduce-h100-x4.md): the push kernels beat both copy-in kernels at every size,
# one-shot push up to 128 KiB (3.9-6.2 us against 7.7-10.1 us), two-shot push from 256 KiB (5.9 us;
# 9.9 us at 1 MiB against 18.8). Past push_max_size the copy-in two-shot is the faster of the rest.
# World 8 is NOT measured (no 8-GPU machine was lent): one-shot reads (W - 1) x size per rank,
# two-shot 2 (W - 1) / W x size, so the copy-in crossover is placed at a quarter of world 4's on
# 4x H200 (512 KiB): replace with a sweep on 8 GPUs.
AlgorithmTable = dict[int, dict[torch.dtype, tuple[tuple[int, str], ...]]]
ANY_SIZE = 1 << 62


def _same_for_every_dtype(
    rows: tuple[tuple[int, str], ...],
) -> dict[torch.dtype, tuple[tuple[int, str], ...]]:
    return {dtype: rows for dtype in SUPPORTED_DTYPES}


AUTO_ALGORITHMS: AlgorithmTable = {
    2: _same_for_every_dtype(((ANY_SIZE, "one_shot"),)),
    4: _same_for_every_dtype(((128 * KiB, "one_shot_push"), (ANY_SIZE, "two_shot_push"))),
    8: _same_for_every_dtype(((128 * KiB, "one_shot"), (ANY_SIZE, "two_shot"))),
}


@dataclass(frozen=True)
class LaunchRow:
    """Up to `max_bytes`: `num_warps` per program, at most `max_blocks` programs."""

    max_bytes: int
    num_warps: int
    max_blocks: int


# First row whose max_bytes >= the message size. The copy-in kernels' rows, from the 2x H200 launch
# sweep of 4-32 warps (all_reduce_sweep-h200-x2.md): small messages are fastest with 4 warps and one
# 16-byte vector per thread spread over as many programs as that takes; from ~64 KiB more warps and up
# to 64 programs; beyond 1 MiB (bandwidth-bound) up to 128 programs, one per SM.
LAUNCH: dict[str, tuple[LaunchRow, ...]] = {
    "one_shot": (
        LaunchRow(32 * KiB, 4, 16),
        LaunchRow(128 * KiB, 8, 32),
        LaunchRow(1 * MiB, 16, 64),
        LaunchRow(1 << 62, 16, 128),
    ),
    "two_shot": (
        LaunchRow(32 * KiB, 4, 16),
        LaunchRow(1 * MiB, 8, 64),
        LaunchRow(1 << 62, 16, 128),
    ),
    # The push kernels have no pad barrier, so their programs may outnumber the SMs. From the 4x H200
    # sweep of 1-32 warps (all_reduce_sweep-h200-x4.md, 2026-11-28): up to 1 MiB (two-shot) / 128 KiB
    # (one-shot) one warp per program and one step each, as many programs as that takes (up to 256), is
    # the fastest launch at every size: 4 KiB 4.0 us at 8 one-warp programs against 6.2 at 2 four-warp
    # ones, 1 MiB 8.4 us against 10.2 at 64 eight-warp ones. Larger messages want more warps a program.
    "one_shot_push": (
        LaunchRow(128 * KiB, 1, 256),
        LaunchRow(256 * KiB, 2, 256),
        LaunchRow(1 * MiB, 4, 256),
        LaunchRow(4 * MiB, 8, 256),
        LaunchRow(1 << 62, 32, 256),
    ),
    "two_shot_push": (
        LaunchRow(1 * MiB, 1, 256),
        LaunchRow(4 * MiB, 4, 256),
        LaunchRow(8 * MiB, 8, 256),
        LaunchRow(16 * MiB, 16, 256),
        LaunchRow(1 << 62, 32, 256),
    ),
}


def choose_algorithm(
    nbytes: int,
    world_size: int,
    dtype: torch.dtype,
    max_size: int,
    table: AlgorithmTable | None = None,
    push_max_size: int = DEFAULT_PUSH_MAX_SIZE,
) -> str:
    """'identity' (world 1), one of ALGORITHMS, or 'nccl' for a message of `nbytes`: the first row of
    the table (AUTO_ALGORITHMS where `table` has no rows for this world size and dtype) that covers
    `nbytes` and whose kernel takes it (push kernels: up to `push_max_size`); two-shot when no row does."""
    if world_size == 1:
        return "identity"
    if (
        world_size not in SUPPORTED_WORLD_SIZES
        or dtype not in SUPPORTED_DTYPES
        or nbytes <= 0
        or nbytes % VECTOR_BYTES
        or nbytes > max_size
    ):
        return "nccl"
    # A table that leaves out this world size or dtype: the measured defaults serve it.
    rows = (table or {}).get(world_size, {}).get(dtype) or AUTO_ALGORITHMS[world_size][dtype]
    for max_bytes, algo in rows:
        if nbytes <= max_bytes and (algo not in PUSH_ALGORITHMS or nbytes <= push_max_size):
            return algo
    return "two_shot"


def launch_config(algo: str, nbytes: int, world_size: int, itemsize: int) -> tuple[int, int]:
    """(num_warps, num_blocks) for a kernel launch: the table row for the size, programs capped by the
    work (each program moves num_warps * 32 vectors per step; two-shot per rank's chunk)."""
    if algo not in LAUNCH:
        raise ValueError(f"no launch table for {algo!r}")
    row = next(r for r in LAUNCH[algo] if nbytes <= r.max_bytes)
    vectors = -(-nbytes // VECTOR_BYTES)
    if algo in ("two_shot", "two_shot_push"):
        vectors = -(-vectors // world_size)
    per_step = row.num_warps * 32
    # Pad barriers serve MAX_BLOCKS programs; the push kernels only read an epoch slot per program.
    cap = MAX_PROGRAMS.value if algo in PUSH_ALGORITHMS else MAX_BLOCKS.value
    blocks = max(1, min(row.max_blocks, cap, -(-vectors // per_step)))
    return row.num_warps, blocks


def slot_bytes_for(max_size: int) -> int:
    """Bytes per buffer region: max_size rounded up to whole vectors."""
    if max_size <= 0:
        raise ValueError(f"max_size must be positive, got {max_size}")
    return -(-max_size // VECTOR_BYTES) * VECTOR_BYTES


_REGISTRY: dict[str, CustomAllReduce] = {}


class CustomAllReduce:
    """Symmetric-memory all-reduce (sum) for one process group on one node.

    Construction is collective over `group` (buffer allocation and rendezvous, one-node + peer-access
    check, the push buffer's sentinel fill). Calls are CUDA-graph capturable; after a graph or before
    relying on results in a test, call `check()` to turn a recorded peer timeout into an exception.
    `push_max_size=0` leaves the push kernels (and their buffer) out."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        max_size: int = DEFAULT_MAX_SIZE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        algorithms: AlgorithmTable | None = None,
        tag: str = "all_reduce",
        push_max_size: int = DEFAULT_PUSH_MAX_SIZE,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.group_name = self.group.group_name
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.max_size = max_size
        self.slot_bytes = slot_bytes_for(max_size)
        self.timeout_ns = int(timeout_s * 1e9)
        self.algorithms = algorithms
        if push_max_size < 0:
            raise ValueError(f"push_max_size must be >= 0 (0: no push kernels), got {push_max_size}")
        self.push_max_size = min(push_max_size, max_size)
        self.buf: SymmBuffer | None = None
        self.push_buf: SymmBuffer | None = None
        self.push_layout: PushLayout | None = None
        if self.world_size in SUPPORTED_WORLD_SIZES and torch.cuda.is_available():
            self.buf = get_symm_buffer(self.group, 3 * self.slot_bytes, tag=tag)
            if self.push_max_size > 0:
                self._make_push_buffer(tag + "-push")
        _REGISTRY[self.group_name] = self

    def _make_push_buffer(self, tag: str) -> None:
        """Allocate the push buffer and fill every word with the sentinel before any rank can push
        (collective: the fill is done on every rank before the barrier returns anywhere)."""
        self.push_layout = PushLayout(self.world_size, slot_bytes_for(self.push_max_size))
        total = self.push_layout.total_bytes
        self.push_buf = get_symm_buffer(self.group, total, tag=tag)
        self.push_buf.tensor[:total].view(torch.int32).fill_(SENTINEL.value)
        torch.cuda.synchronize()
        dist.barrier(group=self.group)

    # ---------------------------------------------------------------- dispatch

    def algorithm(self, x: torch.Tensor) -> str:
        """What `all_reduce(x)` will run."""
        if self.buf is None and self.world_size > 1:
            return "nccl"
        if not x.is_cuda or not x.is_contiguous() or x.data_ptr() % VECTOR_BYTES:
            return "nccl" if self.world_size > 1 else "identity"
        return choose_algorithm(
            x.numel() * x.element_size(),
            self.world_size,
            x.dtype,
            self.max_size,
            self.algorithms,
            self.push_max_size if self.push_buf is not None else 0,
        )

    # ---------------------------------------------------------------- direct region

    def input_buffer(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """This rank's direct region as a tensor of `shape`: write partial sums here, then call."""
        if self.buf is None:
            raise RuntimeError(f"rank {self.rank}: no symmetric buffer (world size {self.world_size})")
        numel = 1
        for d in shape:
            numel *= d
        return self.buf.view(region_offset(2, self.slot_bytes), numel, dtype).view(shape)

    def is_direct(self, x: torch.Tensor) -> bool:
        """True if `x` starts at this rank's direct region (written by a producer)."""
        return self.buf is not None and x.data_ptr() == self.buf.tensor.data_ptr() + region_offset(
            2, self.slot_bytes
        )

    # ---------------------------------------------------------------- the call

    def all_reduce(
        self, x: torch.Tensor, algo: str = "auto", out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Sum of `x` over the group, in a new tensor (or `out`). algo: auto, nccl, or one of ALGORITHMS."""
        if algo not in ("auto", "nccl", *ALGORITHMS):  # ("identity" is auto's choice at world 1 only)
            raise ValueError(f"algo must be auto, nccl or one of {ALGORITHMS}, got {algo!r}")
        chosen = self.algorithm(x) if algo == "auto" else algo
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            # The stock paths copy x into out, which would broadcast or cast it without a word.
            raise ValueError(
                f"out is {out.dtype} {tuple(out.shape)} on {out.device}; x is {x.dtype} {tuple(x.shape)} on "
                f"{x.device}: pass an out of x's shape, dtype and device"
            )
        if chosen == "identity":
            return out.copy_(x)
        if chosen == "nccl":
            out.copy_(x)
            dist.all_reduce(out, group=self.group)
            return out
        num_warps, num_blocks = launch_config(
            chosen, x.numel() * x.element_size(), self.world_size, x.element_size()
        )
        return self.launch(x, out, chosen, num_warps, num_blocks)

    __call__ = all_reduce

    def launch(
        self, x: torch.Tensor, out: torch.Tensor, algo: str, num_warps: int, num_blocks: int
    ) -> torch.Tensor:
        """One kernel launch with an explicit launch config (the benchmark's sweep uses it)."""
        if algo not in ALGORITHMS:
            raise ValueError(f"algo must be one of {ALGORITHMS}, got {algo!r}")
        if self.buf is None:
            raise RuntimeError(f"rank {self.rank}: {algo} needs a symmetric buffer; this group has none")
        if algo in PUSH_ALGORITHMS:
            if self.push_buf is None or self.push_layout is None:
                raise RuntimeError(
                    f"rank {self.rank}: {algo} needs the push buffer: construct with push_max_size > 0"
                )
            return launch_push_all_reduce(
                self.push_buf, self.push_layout, x, out, algo, num_warps, num_blocks, self.timeout_ns
            )
        return launch_all_reduce(
            self.buf,
            x,
            out,
            algo,
            self.slot_bytes,
            self.is_direct(x),
            num_warps,
            num_blocks,
            self.timeout_ns,
        )

    def check(self) -> None:
        """Raise `SymmMemTimeout` (naming rank, op, barrier, missing peer) if a wait timed out."""
        for buf in (self.buf, self.push_buf):
            if buf is not None:
                check_status(buf)


def get_custom_all_reduce(group: dist.ProcessGroup | None = None, **kwargs) -> CustomAllReduce:
    """The group's `CustomAllReduce`, created on first use (collective then)."""
    group = group if group is not None else dist.group.WORLD
    car = _REGISTRY.get(group.group_name)
    return car if car is not None else CustomAllReduce(group, **kwargs)


def check(group: dist.ProcessGroup | None = None) -> None:
    """`CustomAllReduce.check` of the group's all-reduce, if it has one."""
    car = _REGISTRY.get((group if group is not None else dist.group.WORLD).group_name)
    if car is not None:
        car.check()


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The fast op, with the reference's signature: sum of `x` over `group` in a new tensor."""
    return get_custom_all_reduce(group).all_reduce(x)


__all__ = [
    "ALGORITHMS",
    "CustomAllReduce",
    "all_reduce",
    "all_reduce_reference",
    "check",
    "choose_algorithm",
    "launch_config",
]


@torch.library.custom_op("weft::symm_all_reduce", mutates_args=())
def symm_all_reduce(x: torch.Tensor, group_name: str, algo: str = "auto") -> torch.Tensor:
    """Registered op: the `CustomAllReduce` of `group_name` (create it first) summing `x`."""
    car = _REGISTRY.get(group_name)
    if car is None:
        raise RuntimeError(f"no CustomAllReduce for group {group_name!r}: construct one first")
    return car.all_reduce(x, algo)


@symm_all_reduce.register_fake
def _(x, group_name, algo="auto"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
