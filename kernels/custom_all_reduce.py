"""`CustomAllReduce`: weft's decode all-reduce for one process group, and its dispatch rules.

    car = CustomAllReduce(group)              # collective: allocates + rendezvouses once
    y = car(x)                                # eager or inside a CUDA graph: sum over the group
    buf = car.input_buffer((batch, hidden), torch.bfloat16)
    torch.matmul(h, w_shard.t(), out=buf)     # row-parallel partial sums written in place
    y = car(buf)                              # no copy: the kernel reads the peers' buffers directly
    torch.ops.weft.symm_all_reduce(x, group.group_name)   # the same, as a registered op

`choose_algorithm` picks one-shot up to a size measured per (world size, dtype) on 4x H200
(ONE_SHOT_MAX_BYTES), two-shot above it, and NCCL (dist.all_reduce) above `max_size`, for unsupported
world sizes / dtypes, and for sizes that are not whole 16-byte vectors. The rules are plain Python
(tests/test_all_reduce_dispatch.py runs them on CPU).

Direct use (`input_buffer`): the returned tensor is this rank's `direct` region of the symmetric
buffer. Write the partial sums into it, then call the all-reduce on it (or on a leading slice of it
that starts at its first element); the kernels only read it. There is one
direct region per object: write the next call's partials only after the previous call was issued
(stream order does the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.all_reduce import (
    SUPPORTED_DTYPES,
    VECTOR_BYTES,
    all_reduce_reference,
    launch_all_reduce,
    region_offset,
)
from kernels.symm_mem import DEFAULT_TIMEOUT_S, MAX_BLOCKS, SymmBuffer, check_status, get_symm_buffer

SUPPORTED_WORLD_SIZES = (2, 4, 8)
DEFAULT_MAX_SIZE = 32 << 20
KiB, MiB = 1 << 10, 1 << 20

# Largest message (bytes) that goes one-shot; two-shot above. Keyed by world size, then dtype.
# World 2 (`torchrun --nproc_per_node=2 -m benchmarks.bench_all_reduce --sweep` on 2x H200,
# benchmarks/results/all_reduce_sweep-2xh200.md): one-shot was faster than two-shot at every size from
# 4 KiB to 32 MiB (two GPUs: both move the same bytes, two-shot pays a second barrier).
# World 4 (`torchrun --nproc_per_node=4 -m benchmarks.bench_all_reduce` on 4x H200,
# benchmarks/results/all_reduce-4xh200.md): one-shot faster up to 512 KiB (12.1 vs 13.1 us), two-shot
# from 1 MiB (15.4 vs 18.1 us). World 8 is NOT measured (no 8-GPU machine was lent): one-shot reads
# (W - 1) x size per rank, two-shot 2 (W - 1) / W x size, so the crossover is placed at a quarter of
# world 4's: replace with a sweep on 8 GPUs.
ONE_SHOT_MAX_BYTES: dict[int, dict[torch.dtype, int]] = {
    2: {torch.bfloat16: 1 << 40, torch.float16: 1 << 40, torch.float32: 1 << 40},
    4: {torch.bfloat16: 512 * KiB, torch.float16: 512 * KiB, torch.float32: 512 * KiB},
    8: {torch.bfloat16: 128 * KiB, torch.float16: 128 * KiB, torch.float32: 128 * KiB},
}


@dataclass(frozen=True)
class LaunchRow:
    """Up to `max_bytes`: `num_warps` per program, at most `max_blocks` programs."""

    max_bytes: int
    num_warps: int
    max_blocks: int


# First row whose max_bytes >= the message size. From the 2x H200 launch sweep
# (all_reduce_sweep-2xh200.md): small messages are fastest with 4 warps and one 16-byte vector per
# thread spread over as many programs as that takes; from ~64 KiB more warps and up to 64 programs;
# beyond 1 MiB (bandwidth-bound) up to 128 programs, one per SM.
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
}


def choose_algorithm(
    nbytes: int,
    world_size: int,
    dtype: torch.dtype,
    max_size: int,
    one_shot_max: dict[int, dict[torch.dtype, int]] | None = None,
) -> str:
    """'identity' (world 1), 'one_shot', 'two_shot' or 'nccl' for a message of `nbytes`."""
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
    table = ONE_SHOT_MAX_BYTES if one_shot_max is None else one_shot_max
    return "one_shot" if nbytes <= table[world_size][dtype] else "two_shot"


def launch_config(algo: str, nbytes: int, world_size: int, itemsize: int) -> tuple[int, int]:
    """(num_warps, num_blocks) for a kernel launch: the table row for the size, programs capped by the
    work (each program moves num_warps * 32 vectors per step; two-shot per rank's chunk)."""
    if algo not in LAUNCH:
        raise ValueError(f"no launch table for {algo!r}")
    row = next(r for r in LAUNCH[algo] if nbytes <= r.max_bytes)
    vectors = -(-nbytes // VECTOR_BYTES)
    if algo == "two_shot":
        vectors = -(-vectors // world_size)
    per_step = row.num_warps * 32
    blocks = max(1, min(row.max_blocks, MAX_BLOCKS.value, -(-vectors // per_step)))
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
    check). Calls are CUDA-graph capturable; after a graph or before relying on results in a test, call
    `check()` to turn a recorded peer timeout into an exception."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        max_size: int = DEFAULT_MAX_SIZE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        one_shot_max: dict[int, dict[torch.dtype, int]] | None = None,
        tag: str = "all_reduce",
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.group_name = self.group.group_name
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.max_size = max_size
        self.slot_bytes = slot_bytes_for(max_size)
        self.timeout_ns = int(timeout_s * 1e9)
        self.one_shot_max = one_shot_max
        self.buf: SymmBuffer | None = None
        if self.world_size in SUPPORTED_WORLD_SIZES and torch.cuda.is_available():
            self.buf = get_symm_buffer(self.group, 3 * self.slot_bytes, torch.uint8, tag=tag)
        _REGISTRY[self.group_name] = self

    # ---------------------------------------------------------------- dispatch

    def algorithm(self, x: torch.Tensor) -> str:
        """What `all_reduce(x)` will run."""
        if self.buf is None and self.world_size > 1:
            return "nccl"
        if not x.is_cuda or not x.is_contiguous() or x.data_ptr() % VECTOR_BYTES:
            return "nccl" if self.world_size > 1 else "identity"
        return choose_algorithm(
            x.numel() * x.element_size(), self.world_size, x.dtype, self.max_size, self.one_shot_max
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
        """Sum of `x` over the group, in a new tensor (or `out`). algo: auto, one_shot, two_shot, nccl."""
        chosen = self.algorithm(x) if algo == "auto" else algo
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if chosen == "identity":
            return out.copy_(x)
        if chosen == "nccl":
            out.copy_(x)
            dist.all_reduce(out, group=self.group)
            return out
        if self.buf is None:
            raise RuntimeError(f"rank {self.rank}: {chosen} needs a symmetric buffer; this group has none")
        num_warps, num_blocks = launch_config(
            chosen, x.numel() * x.element_size(), self.world_size, x.element_size()
        )
        return launch_all_reduce(
            self.buf,
            x,
            out,
            chosen,
            self.slot_bytes,
            self.is_direct(x),
            num_warps,
            num_blocks,
            self.timeout_ns,
        )

    __call__ = all_reduce

    def check(self) -> None:
        """Raise `SymmMemTimeout` (naming rank, op, barrier, missing peer) if a wait timed out."""
        if self.buf is not None:
            check_status(self.buf)


def get_custom_all_reduce(group: dist.ProcessGroup | None = None, **kwargs) -> CustomAllReduce:
    """The group's `CustomAllReduce`, created on first use (collective then)."""
    group = group if group is not None else dist.group.WORLD
    car = _REGISTRY.get(group.group_name)
    return car if car is not None else CustomAllReduce(group, **kwargs)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The fast op, with the reference's signature: sum of `x` over `group` in a new tensor."""
    return get_custom_all_reduce(group).all_reduce(x)


__all__ = ["CustomAllReduce", "all_reduce", "all_reduce_reference", "choose_algorithm", "launch_config"]


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
