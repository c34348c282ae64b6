"""One-shot and two-shot all-reduce (sum) over symmetric memory, in Triton, and the reference.

Both kernels sum in fp32 over ranks 0, 1, ..., W-1 in that order on every rank, so every rank gets
bit-identical results. Data moves as 16-byte vectors (bf16/fp16: 8 elements, fp32: 4); the element
count must make whole vectors (numel * itemsize % 16 == 0). Barriers follow kernels/symm_mem.py's
epoch protocol: no host state, CUDA-graph replayable, bounded waits.

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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels.symm_mem import MAX_BLOCKS, SymmBuffer, advance_epoch, barrier, load_epoch, op_id

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VECTOR_BYTES = 16
ONE_SHOT_OP = op_id("all_reduce one-shot")
TWO_SHOT_OP = op_id("all_reduce two-shot")


@triton.jit
def _peer_base(buf_ptrs, r, region, DT: tl.constexpr):
    """Rank r's buffer base + region, as a 16-byte aligned pointer to DT."""
    base = tl.load(buf_ptrs.to(tl.pointer_type(tl.uint64)) + r).to(tl.int64) + region
    return tl.multiple_of(base.to(tl.pointer_type(DT)), 16)


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
    region = base_off + 2 * slot_bytes if DIRECT else base_off + (epoch & 1).to(tl.int64) * slot_bytes
    rows = tl.arange(0, BLOCK_V)
    cols = tl.arange(0, VEC)
    if not DIRECT:
        mine = _peer_base(buf_ptrs, RANK, region, DT)
        for start in range(pid * BLOCK_V, n_vec, nprog * BLOCK_V):
            v = start + rows
            offs = v[:, None] * VEC + cols[None, :]
            mask = (v < n_vec)[:, None]
            tl.store(mine + offs, tl.load(inp_ptr + offs, mask=mask), mask=mask)
    barrier(pad_ptrs, 0, pid, epoch + 1, status_ptr, OP, timeout_ns, RANK, WORLD)
    for start in range(pid * BLOCK_V, n_vec, nprog * BLOCK_V):
        v = start + rows
        offs = v[:, None] * VEC + cols[None, :]
        mask = (v < n_vec)[:, None]
        acc = tl.zeros([BLOCK_V, VEC], tl.float32)
        for r in tl.static_range(WORLD):
            acc += tl.load(_peer_base(buf_ptrs, r, region, DT) + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(DT), mask=mask)
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
    gather = base_off + (epoch & 1).to(tl.int64) * slot_bytes
    region = base_off + 2 * slot_bytes if DIRECT else gather
    rows = tl.arange(0, BLOCK_V)
    cols = tl.arange(0, VEC)
    chunk = (n_vec + WORLD - 1) // WORLD  # vectors per rank's chunk; the last may be short
    mine = _peer_base(buf_ptrs, RANK, gather, DT)
    # Program pid owns positions [pid * BLOCK_V, ...) of every chunk, the same on every rank.
    if not DIRECT:
        for start in range(pid * BLOCK_V, chunk, nprog * BLOCK_V):
            i = start + rows
            for c in tl.static_range(WORLD):
                v = c * chunk + i
                offs = v[:, None] * VEC + cols[None, :]
                mask = ((i < chunk) & (v < n_vec))[:, None]
                tl.store(mine + offs, tl.load(inp_ptr + offs, mask=mask), mask=mask)
    barrier(pad_ptrs, 0, pid, epoch + 1, status_ptr, OP, timeout_ns, RANK, WORLD)
    # Reduce-scatter: chunk RANK of every rank, summed in rank order; push the sum into chunk RANK of
    # every rank's gather slot (in place when not DIRECT: only this program of this rank reads it).
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
    barrier(pad_ptrs, 1, pid, epoch + 1, status_ptr, OP, timeout_ns, RANK, WORLD)
    # All-gather: the W reduced chunks are now in this rank's gather slot.
    for start in range(pid * BLOCK_V, chunk, nprog * BLOCK_V):
        i = start + rows
        for c in tl.static_range(WORLD):
            v = c * chunk + i
            offs = v[:, None] * VEC + cols[None, :]
            mask = ((i < chunk) & (v < n_vec))[:, None]
            tl.store(out_ptr + offs, tl.load(mine + offs, mask=mask), mask=mask)
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
    kernel[(num_blocks,)](
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


def all_reduce_reference(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The stock path: a copy of `x` summed with `dist.all_reduce` (NCCL on GPU, gloo on CPU)."""
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out
