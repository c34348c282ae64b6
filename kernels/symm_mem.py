"""Shared symmetric-memory plumbing for weft's communication kernels (all-gather-matmul,
matmul-reduce-scatter, the Ulysses all-to-all and the decode all-reduce).

Host side
---------
* `get_symm_buffer(group, nbytes, tag)`: a symmetric byte buffer per (group name, size class, tag),
  allocated once with `torch.distributed._symmetric_memory.empty` and rendezvoused, with its device
  pointer tables (`buffer_ptrs_dev`, `signal_pad_ptrs_dev`), every rank's buffer address as this
  process maps it (`addresses`: for copy engines and stream memory operations, kernels/stream_ops.py),
  a per-rank epoch array and a status word.
* Shared-GPU mode: when ranks of the group share a GPU (more ranks than GPUs, to test the kernels on
  one GPU), torch's rendezvous refuses the group ("allocations from overlapping devices"), so each
  rank allocates its buffer and signal pad with the caching allocator and maps its peers' with CUDA
  IPC (`IpcHandle`). The kernels get the same `SymmBuffer` and cannot tell the difference.
* `check_group(group)`: every rank of the group on one host with peer access to the others; a clear
  error otherwise (symmetric memory is NVLink/P2P memory: it cannot span nodes). Says whether ranks
  share a GPU.
* `check_status(buf, op)`: raises `SymmMemTimeout` naming rank, op, barrier and the missing peer when a
  kernel's bounded wait gave up. Kernels never raise; they record and return.

Device side: the barrier protocol (epochs)
-----------------------------------------
Every rank keeps `epoch[MAX_PROGRAMS]` (int32, local) beside each buffer. A kernel's program `pid` reads
`e = epoch[pid]` at entry; a barrier `bar` then means: write `e + 1` into flag (bar, pid, my rank) of
every peer's signal pad (release, system scope) and wait until flag (bar, pid, r) of my own pad is
`>= e + 1` for every rank r (acquire, bounded). At exit the programs together write `e + 1` into all
`MAX_PROGRAMS` epoch slots (`advance_epoch`), so every slot holds the number of calls made so far
whatever grid each call used. Flags only ever grow, so pads are never reset, and the state lives on
the device: a CUDA graph replayed any number of times, mixed with eager calls, keeps working.
Program `pid` only synchronizes with program `pid` of the peers, so a kernel must give program `pid`
the same slice of the data on every rank. The `>=` (on the signed difference, so wrap-around is
harmless) lets a fast peer already be one call ahead.

Every kernel that uses a buffer's pads must follow this protocol (read its epoch slot at entry, call
`advance_epoch` at exit, use barrier ids below `NUM_BARRIERS`); kernels of different kinds can then
share one buffer.

Bounded waits: a wait gives up after `timeout_ns` (read from `%globaltimer`), records
(1, op id, barrier, missing rank) in the status word and returns; later waits on that buffer see the
status set and do not spin, so a lost peer costs one timeout, not one per call.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
import triton
import triton.language as tl

MAX_WORLD = tl.constexpr(8)  # flag stride per (barrier, program); world sizes up to 8 (one node)
MAX_BLOCKS = tl.constexpr(128)  # programs per kernel launch that may take part in barriers (H200: 132 SMs)
# Programs per kernel launch that may read an epoch slot: kernels without pad barriers (the push
# all-reduce, the all-to-all) may run one program per SM or more.
MAX_PROGRAMS = tl.constexpr(256)
NUM_BARRIERS = tl.constexpr(2)  # distinct barrier ids per kernel
# 8 KiB of flags; torch's default signal pad is 9216 bytes.
PAD_INT32S = NUM_BARRIERS.value * MAX_BLOCKS.value * MAX_WORLD.value
DEFAULT_TIMEOUT_S = float(os.environ.get("WEFT_SYMM_MEM_TIMEOUT_S", "30"))
MIN_SIZE_CLASS = 1 << 20
# Triton's interpreter (the CPU tests) runs no PTX: kernels leave out their inline assembly under it.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

T = TypeVar("T")
_OPS: list[str] = []


def op_id(name: str) -> int:
    """A small integer naming an op in the status word (registered on first use, 1-based)."""
    if name not in _OPS:
        _OPS.append(name)
    return _OPS.index(name) + 1


def op_name(op: int) -> str:
    return _OPS[op - 1] if 0 < op <= len(_OPS) else f"op#{op}"


class SymmMemError(RuntimeError):
    """A group that symmetric-memory kernels cannot serve (spans nodes, no peer access, ...)."""


class SymmMemTimeout(RuntimeError):
    """A kernel's bounded wait for a peer gave up."""


class KernelFallbackWarning(UserWarning):
    """A comm kernel handed a call to its reference path (a shape or dtype it does not take)."""


def warn_fallback(op: str, reason: str) -> None:
    """Say (once per op and reason) that `op` runs its stock reference path, not weft's kernel."""
    warnings.warn(f"{op}: {reason}; this call runs the reference path", KernelFallbackWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------- host


def size_class(nbytes: int) -> int:
    """Bytes allocated for a request of `nbytes`: the next power of two, at least 1 MiB."""
    if nbytes <= 0:
        raise ValueError(f"size must be positive, got {nbytes}")
    return max(MIN_SIZE_CLASS, 1 << (nbytes - 1).bit_length())


def node_info() -> dict[str, object]:
    """What this process tells its group for the one-node check."""
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    uuid = str(getattr(props, "uuid", ""))
    return {"host": socket.gethostname(), "boot": _boot_id(), "device": dev, "uuid": uuid}


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def check_single_node(infos: list[dict[str, object]], rank: int) -> None:
    """Raise `SymmMemError` unless every rank's (host, boot id) equals this rank's. Pure: CPU-testable."""
    mine = (infos[rank]["host"], infos[rank]["boot"])
    others = [r for r, i in enumerate(infos) if (i["host"], i["boot"]) != mine]
    if others:
        hosts = sorted({str(i["host"]) for i in infos})
        raise SymmMemError(
            f"rank {rank}: symmetric memory needs every rank of the group on one node (NVLink peers), but "
            f"the group spans hosts {hosts} (ranks {others} are not on {mine[0]}). Use a group inside one "
            f"node (tensor parallel within a node), or the torch/NCCL path."
        )


def shares_gpu(infos: list[dict[str, object]]) -> bool:
    """True when two ranks of the group sit on one GPU (by UUID, else by device index). Pure."""
    gpus = [i["uuid"] or i["device"] for i in infos]
    return len(set(gpus)) != len(gpus)


def check_peer_access(infos: list[dict[str, object]], rank: int, can_access=None) -> None:
    """Raise `SymmMemError` if this rank's GPU cannot map a peer's GPU (visible device indices only)."""
    if can_access is None:
        can_access = torch.cuda.can_device_access_peer
    me = int(infos[rank]["device"])
    visible = torch.cuda.device_count() if can_access is torch.cuda.can_device_access_peer else 1 << 30
    for r, info in enumerate(infos):
        dev = int(info["device"])
        if r == rank or dev == me or dev >= visible:
            continue
        if not can_access(me, dev):
            raise SymmMemError(
                f"rank {rank}: GPU {me} has no peer access to GPU {dev} (rank {r}); symmetric-memory "
                f"kernels need NVLink/P2P between every pair of the group's GPUs"
            )


# Group name -> whether its ranks share a GPU (set once the group passed its checks).
_CHECKED: dict[str, bool] = {}


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group a registered op names (custom ops take strings, not groups)."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device: the persistent kernels' grid."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_group(group: dist.ProcessGroup) -> bool:
    """One-node + peer-access check for `group` (collective over the group; cached per group name).
    Returns True when ranks of the group share a GPU: their buffers are then mapped by CUDA IPC."""
    name = group.group_name
    if name in _CHECKED:
        return _CHECKED[name]
    infos: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(infos, node_info(), group=group)
    rank = dist.get_rank(group)
    check_single_node(infos, rank)
    check_peer_access(infos, rank)
    _CHECKED[name] = shares_gpu(infos)
    return _CHECKED[name]


def enable_symm_mem(group_name: str) -> None:
    """Enable symmetric memory on a group once, as torch 2.11's fused ops (`torch.ops.symm_mem.*`)
    require; later torch versions deprecate the call as a no-op, and it is skipped there."""
    from torch.distributed import _symmetric_memory as symm

    enabled = getattr(symm, "is_symm_mem_enabled_for_group", None)
    if enabled is None or enabled(group_name):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        symm.enable_symm_mem_for_group(group_name)


@dataclass
class SymmBuffer:
    """One rendezvoused symmetric allocation plus the state its kernels need."""

    group_name: str
    rank: int
    world_size: int
    nbytes: int  # usable bytes starting at `tensor`
    tensor: torch.Tensor  # uint8 [nbytes], this rank's view
    handle: object  # torch's _SymmetricMemory, or an IpcHandle when ranks share a GPU
    buffer_ptrs_dev: int  # device address of world_size uint64 buffer base addresses
    signal_pad_ptrs_dev: int  # device address of world_size uint64 signal pad addresses
    base_offset: int  # bytes from the handle's buffer base to `tensor`
    addresses: tuple[int, ...]  # every rank's `tensor` as this process maps it (copy engines' targets)
    epoch: torch.Tensor  # int32 [MAX_PROGRAMS], local
    status: torch.Tensor  # int32 [4]: (timed out, op id, barrier, missing rank)

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's buffer, `numel` elements of `dtype` from byte `offset`."""
        size = numel * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + size > self.nbytes:
            raise ValueError(f"view [{offset}, {offset + size}) outside the {self.nbytes}-byte buffer")
        return self.tensor[offset : offset + size].view(dtype)


class IpcHandle:
    """The shared-GPU stand-in for torch's symmetric-memory handle: this rank's buffer and signal pad
    (one caching-allocator block) and every peer's, mapped with CUDA IPC, with device tables of their
    addresses. It offers what weft's kernels and benchmarks use of the torch handle."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        block = torch.zeros(nbytes + PAD_INT32S * 4, dtype=torch.uint8, device=device)
        shared: list = [None] * self.world_size
        dist.all_gather_object(shared, reduce_tensor(block), group=group)
        try:
            # A process cannot open its own IPC handle: it keeps its own tensor.
            blocks = [block if r == self.rank else fn(*args) for r, (fn, args) in enumerate(shared)]
        except RuntimeError as err:
            raise SymmMemError(
                f"rank {self.rank}: ranks of group {group.group_name!r} share a GPU, and mapping a peer's "
                f"buffer with CUDA IPC failed ({str(err).splitlines()[0]}); use parallel.comm=torch"
            ) from err
        self.buffers = [b[:nbytes] for b in blocks]
        self.pads = [b[nbytes:].view(torch.int32) for b in blocks]
        # The kernels load peer addresses as uint64; addresses fit int64.
        table = [b.data_ptr() for b in self.buffers] + [p.data_ptr() for p in self.pads]
        self.ptr_table = torch.tensor(table, dtype=torch.int64, device=device)
        self.buffer_ptrs_dev = self.ptr_table.data_ptr()
        self.signal_pad_ptrs_dev = self.buffer_ptrs_dev + 8 * self.world_size

    def get_buffer(
        self, rank: int, sizes: list[int], dtype: torch.dtype, storage_offset: int = 0
    ) -> torch.Tensor:
        """Rank `rank`'s buffer as a `sizes` tensor of `dtype`, from element `storage_offset`."""
        numel = math.prod(sizes)
        return self.buffers[rank].view(dtype)[storage_offset : storage_offset + numel].view(sizes)

    def get_signal_pad(self, rank: int, sizes: list[int], dtype: torch.dtype) -> torch.Tensor:
        return self.pads[rank].view(dtype)[: math.prod(sizes)].view(sizes)


_CACHE: dict[tuple[str, int, str], SymmBuffer] = {}


def get_symm_buffer(group: dist.ProcessGroup, nbytes: int, tag: str = "") -> SymmBuffer:
    """The cached symmetric buffer of at least `nbytes` for (group, size class, tag); the first call for
    a key allocates and rendezvouses (collective: every rank of the group must call it)."""
    key = (group.group_name, size_class(nbytes), tag)
    buf = _CACHE.get(key)
    if buf is not None:
        return buf
    shared_gpu = check_group(group)
    device = torch.device("cuda", torch.cuda.current_device())
    if shared_gpu:
        handle = IpcHandle(group, key[1], device)
        tensor, base_offset = handle.buffers[handle.rank], 0
    else:
        from torch.distributed import _symmetric_memory as symm

        tensor = symm.empty(key[1], dtype=torch.uint8, device=device)
        handle = symm.rendezvous(tensor, group.group_name)
        ptrs = getattr(handle, "buffer_ptrs", None)
        base_offset = tensor.data_ptr() - int(ptrs[handle.rank]) if ptrs else 0
    rank, world = handle.rank, handle.world_size
    if shared_gpu:
        addresses = tuple(b.data_ptr() for b in handle.buffers)
    else:
        addresses = tuple(int(p) + base_offset for p in ptrs) if ptrs else ()
    try:
        pad = handle.get_signal_pad(rank, [PAD_INT32S], dtype=torch.int32)
    except (TypeError, RuntimeError):
        pad = handle.get_signal_pad(rank).view(torch.int32)
    if pad.numel() < PAD_INT32S:
        raise SymmMemError(f"signal pad of {pad.numel() * 4} bytes; the barriers need {PAD_INT32S * 4}")
    pad.zero_()
    buf = SymmBuffer(
        group_name=group.group_name,
        rank=rank,
        world_size=world,
        nbytes=key[1],
        tensor=tensor,
        handle=handle,
        buffer_ptrs_dev=int(handle.buffer_ptrs_dev),
        signal_pad_ptrs_dev=int(handle.signal_pad_ptrs_dev),
        base_offset=base_offset,
        addresses=addresses,
        epoch=torch.zeros(MAX_PROGRAMS.value, dtype=torch.int32, device=device),
        status=torch.zeros(4, dtype=torch.int32, device=device),
    )
    torch.cuda.synchronize()
    dist.barrier(group=group)  # every pad zeroed before anyone signals
    _CACHE[key] = buf
    return buf


def eager_or_op(body: Callable[..., T], op: Callable[..., T]) -> Callable[..., T]:
    """What a comm kernel's Python entry point calls: the registered custom op `op` while torch.compile
    traces (the graph needs the op and its fake), its `body` in eager mode. The dispatcher of a
    custom op cost about 0.4 ms of host time per call on a 4x H100 host (matmul-reduce-scatter, 2026-11-26:
    1.09 ms through the op, 0.69 ms calling the kernel path directly), and an eager training step makes
    dozens of such calls."""
    return op if torch.compiler.is_compiling() else body


def describe_status(status: list[int], rank: int, group_name: str) -> str | None:
    """The error text for a status word, or None when it is clear. Pure: CPU-testable."""
    if not status[0]:
        return None
    return (
        f"rank {rank}: {op_name(status[1])} timed out at barrier {status[2]} waiting for rank "
        f"{status[3]} of group {group_name!r} (a peer never arrived: it crashed, hung, or took another "
        f"code path). The group's symmetric-memory state is now unusable; tear the group down."
    )


def check_status(buf: SymmBuffer, op: str | None = None) -> None:
    """Raise `SymmMemTimeout` if a kernel on `buf` recorded a timeout (synchronizes the device)."""
    message = describe_status(buf.status.tolist(), buf.rank, buf.group_name)
    if message is not None:
        raise SymmMemTimeout(message if op is None else f"{message} [checked by {op}]")


# --------------------------------------------------------------------------------------- device


@triton.jit
def flag_index(bar: tl.constexpr, pid, src):
    """int32 offset of flag (barrier, program, source rank) inside a signal pad."""
    return (bar * MAX_BLOCKS + pid) * MAX_WORLD + src


@triton.jit
def load_epoch(epoch_ptr, pid):
    """This program's epoch: the number of calls made on the buffer so far."""
    return tl.load(epoch_ptr + pid, volatile=True)


@triton.jit
def advance_epoch(epoch_ptr, pid, epoch):
    """Every program writes epoch + 1 into its slots pid, pid + nprog, ...: all MAX_PROGRAMS slots advance."""
    nprog = tl.num_programs(0)
    for j in range(pid, MAX_PROGRAMS, nprog):
        tl.store(epoch_ptr + j, epoch + 1)


def bounded_spin_ptx(flag: int, then: str = "") -> str:
    """PTX of a bounded wait on a flag, per element: `$0` <- 0 once the u32 at address `$flag` minus
    `$(flag + 1)` is >= 0 (signed: flags wrap), or 1 once `$(flag + 2)` nanoseconds have passed; then the
    instructions `then`. Operands before `$flag` are the caller's further outputs."""
    return f"""
        {{
        .reg .pred %p<2>;
        .reg .s32 %v;
        .reg .u64 %t0, %t1;
        mov.u64 %t0, %globaltimer;
        mov.u32 $0, 0;
        L_spin:
        ld.acquire.sys.global.u32 %v, [${flag}];
        sub.s32 %v, %v, ${flag + 1};
        setp.ge.s32 %p0, %v, 0;
        @%p0 bra L_done;
        mov.u64 %t1, %globaltimer;
        sub.u64 %t1, %t1, %t0;
        setp.lt.u64 %p1, %t1, ${flag + 2};
        @%p1 bra L_spin;
        mov.u32 $0, 1;
        L_done:
{then}        }}
        """


SPIN_PTX = tl.constexpr(bounded_spin_ptx(1))


@triton.jit
def _spin_until(addrs, target, timeout_ns):
    """Per element: spin (ld.acquire.sys) until *addr - target >= 0 (signed) or timeout_ns pass.
    Returns 0 when reached, 1 on timeout."""
    return tl.inline_asm_elementwise(
        SPIN_PTX,
        "=r,l,r,l",
        [addrs, target, timeout_ns],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


# The bounded spin, then `$1` <- `$5` (a value the caller's later accesses use), with or without the
# async-proxy fence between them.
SPIN_PASS_PTX = tl.constexpr(bounded_spin_ptx(2, "        mov.u32 $1, $5;\n"))
SPIN_FENCE_PASS_PTX = tl.constexpr(
    bounded_spin_ptx(2, "        fence.proxy.async.global;\n        mov.u32 $1, $5;\n")
)


@triton.jit
def wait_flag_unbranched(
    flag_ptr, target, value, status_ptr, op, where, src, timeout_ns, FENCE: tl.constexpr
):
    """`wait_flag` for a flattened loop, which Triton pipelines only without branches or CTA barriers
    in it: every thread spins on the flag itself (acquire, system scope) until it reached `target`
    (signed difference >= 0), bounded, then (FENCE) fences the async proxy for TMA loads of what the
    flag guards, all in one asm that hands `value` (int32) back: accesses whose address uses the
    returned value depend on the wait. A timeout is recorded by masked stores; once the status word
    is set, later waits do not spin."""
    one = tl.zeros([1], tl.int32)  # inline asm wants blocks, not scalars
    failed = tl.load(status_ptr + one, volatile=True)
    budget = tl.where(failed == 0, one.to(tl.int64) + timeout_ns, 0)
    late, after = tl.inline_asm_elementwise(
        SPIN_FENCE_PASS_PTX if FENCE else SPIN_PASS_PTX,
        "=r,=r,l,r,l,r",
        [flag_ptr + one, one + target, budget, one + value],
        dtype=(tl.int32, tl.int32),
        is_pure=False,
        pack=1,
    )
    timed_out = (late != 0) & (failed == 0)
    tl.store(status_ptr + 1 + one, one + op, mask=timed_out)
    tl.store(status_ptr + 2 + one, one + where, mask=timed_out)
    tl.store(status_ptr + 3 + one, one + src, mask=timed_out)
    tl.atomic_xchg(status_ptr + one, one + 1, mask=timed_out)
    return tl.max(after, axis=0)


@triton.jit
def fence_async_proxy(ON: tl.constexpr):
    """Order this thread's earlier generic-proxy accesses (the acquire of a flag) before its later
    async-proxy ones (TMA loads of the data the flag announces): the PTX memory model orders the two
    proxies only through `fence.proxy.async`. ON=False under the interpreter."""
    if ON:
        tl.inline_asm_elementwise(
            "fence.proxy.async.global;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def signal_peers(pad_ptrs, bar: tl.constexpr, pid, value, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Write `value` into flag (bar, pid, RANK) of every rank's pad (release, system scope). All this
    program's earlier writes must be done: call after `tl.debug_barrier()`."""
    ranks = tl.arange(0, WORLD)
    pads = tl.load(pad_ptrs.to(tl.pointer_type(tl.uint64)) + ranks).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(
        pads + flag_index(bar, pid, RANK), tl.full([WORLD], 0, tl.int32) + value, sem="release", scope="sys"
    )


@triton.jit
def wait_peers(
    pad_ptrs,
    bar: tl.constexpr,
    pid,
    value,
    status_ptr,
    op: tl.constexpr,
    timeout_ns,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
):
    """Wait (acquire, bounded) until flag (bar, pid, r) of this rank's pad reached `value` for every
    rank r; on timeout record (1, op, bar, r) in the status word. Ends with a CTA barrier, so every
    thread of the program may then read what the peers wrote before signalling."""
    ranks = tl.arange(0, WORLD)
    mine = tl.load(pad_ptrs.to(tl.pointer_type(tl.uint64)) + RANK).to(tl.pointer_type(tl.int32))
    failed = tl.load(status_ptr, volatile=True)
    if failed == 0:
        late = _spin_until(
            mine + flag_index(bar, pid, ranks),
            tl.full([WORLD], 0, tl.int32) + value,
            tl.full([WORLD], 0, tl.int64) + timeout_ns,
        )
        missing = tl.max(tl.where(late != 0, ranks, -1), axis=0)
        if missing >= 0:
            record_timeout(status_ptr, op, bar, missing)
    tl.debug_barrier()


@triton.jit
def record_timeout(status_ptr, op, where, missing):
    """Write (1, op, where, missing rank) into the status word (`check_status` turns it into an error)."""
    tl.store(status_ptr + 1, op)
    tl.store(status_ptr + 2, where)
    tl.store(status_ptr + 3, missing)
    tl.atomic_xchg(status_ptr, 1)


@triton.jit
def wait_flag(flag_ptr, value, status_ptr, op, where, src, timeout_ns):
    """Wait (acquire, system scope, bounded) until the int32 at `flag_ptr` reached `value` (signed
    difference >= 0); on timeout record (1, op, where, src) in the status word, `src` being the rank
    whose data the flag announces. Returns without waiting once the status word is set, so a lost peer
    costs one timeout. Ends with a CTA barrier: every thread may then read what the flag guards."""
    failed = tl.load(status_ptr, volatile=True)
    if failed == 0:
        one = tl.zeros([1], tl.int32)  # inline asm wants blocks, not scalars
        late = _spin_until(flag_ptr + one, one + value, one.to(tl.int64) + timeout_ns)
        if tl.max(late, axis=0) != 0:
            record_timeout(status_ptr, op, where, src)
    tl.debug_barrier()


@triton.jit
def barrier(
    pad_ptrs,
    bar: tl.constexpr,
    pid,
    value,
    status_ptr,
    op: tl.constexpr,
    timeout_ns,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
):
    """Program `pid` of every rank meets here: this program's writes (local or remote) before the call
    are visible to program `pid` of every peer after it, and vice versa."""
    tl.debug_barrier()
    signal_peers(pad_ptrs, bar, pid, value, RANK, WORLD)
    wait_peers(pad_ptrs, bar, pid, value, status_ptr, op, timeout_ns, RANK, WORLD)
