"""The floor under the all-to-all: how fast a rank can push bytes into all its peers' symmetric buffers
at once when the push does nothing else (contiguous 256-byte rows, no layout change, no flags, no
copy-out), by SM stores, by TMA bulk stores and by copy engines.

    torchrun --nproc_per_node=4 benchmarks/bench_push_floor.py [--mib-per-peer 16]

Every rank pushes `--mib-per-peer` MiB to each peer at the same time (the traffic of an all-to-all);
GB/s per rank = bytes leaving a rank / GPU time (the slowest rank's median, the variants interleaved,
each call queued behind a GPU sleep). Before timing, every rank checks what each peer's stores and TMA
pushes left in its buffer. Rank 0 writes benchmarks/results/push_floor-<device>.{json,md}: the number
beside which kernels/all_to_all.py's bandwidth is read (bench_all_to_all.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import init_gpu_ranks, positive, time_ranks_interleaved, write_results
from kernels.symm_mem import get_symm_buffer

COLS = 128  # bf16 elements a row: 256 bytes, a head of Llama's attention
DTYPE = torch.bfloat16


@triton.jit
def _store_push(src, peer_addrs, rows, row0, PEERS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Program i takes tiles i, i + G, ... of the (row tile, peer) pairs, peers fastest (so every peer
    receives at every moment), and stores each tile of src ([PEERS * rows, COLS], peer p's block p)
    into its peer's buffer at rows row0 + ..., 16-byte stores."""
    pid = tl.program_id(0)
    for t in range(pid, PEERS * (rows // ROWS), tl.num_programs(0)):
        p = t % PEERS
        offs = ((t // PEERS) * ROWS + tl.arange(0, ROWS))[:, None] * COLS + tl.arange(0, COLS)[None, :]
        x = tl.load(src + p.to(tl.int64) * rows * COLS + offs)
        dst = tl.load(peer_addrs + p).to(tl.pointer_type(tl.bfloat16)) + row0.to(tl.int64) * COLS
        tl.store(dst + offs, x)


MAX_PEERS = 7  # world size 8; Triton 3.6 launches no tuple of tensor descriptors, so they are 7 arguments


@triton.jit
def _tma_push(src_desc, d0, d1, d2, d3, d4, d5, d6, rows, row0, PEERS: tl.constexpr, ROWS: tl.constexpr):
    """`_store_push` through TMA: each tile loaded by a bulk copy and stored by one into peer p's
    buffer through descriptor d<p> (the arguments past PEERS are unused)."""
    pid = tl.program_id(0)
    for t in range(pid, PEERS * (rows // ROWS), tl.num_programs(0)):
        p = t % PEERS
        x = src_desc.load([p * rows + (t // PEERS) * ROWS, 0])
        at = [row0 + (t // PEERS) * ROWS, 0]
        if p == 0:
            d0.store(at, x)
        if p == 1:
            d1.store(at, x)
        if PEERS > 2 and p == 2:
            d2.store(at, x)
        if PEERS > 3 and p == 3:
            d3.store(at, x)
        if PEERS > 4 and p == 4:
            d4.store(at, x)
        if PEERS > 5 and p == 5:
            d5.store(at, x)
        if PEERS > 6 and p == 6:
            d6.store(at, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib-per-peer", type=positive, default=16)
    parser.add_argument("--iters", type=positive, default=10)
    args = parser.parse_args()

    group = init_gpu_ranks()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit(
            "needs at least 2 ranks: torchrun --nproc_per_node=<GPUs> benchmarks/bench_push_floor.py"
        )
    rows = (args.mib_per_peer << 20) // (COLS * DTYPE.itemsize)
    peers = [(rank + i) % world for i in range(1, world)]
    # Each rank's buffer holds a block per source rank, so that no two sources write the same rows.
    buf = get_symm_buffer(group, world * rows * COLS * DTYPE.itemsize, tag="push_floor")
    offset = buf.base_offset // DTYPE.itemsize
    peer_views = [buf.handle.get_buffer(p, [world * rows, COLS], DTYPE, offset) for p in peers]
    peer_addrs = torch.tensor([v.data_ptr() for v in peer_views], dtype=torch.int64, device="cuda")
    src = torch.empty(len(peers) * rows, COLS, dtype=DTYPE, device="cuda")
    row0 = rank * rows
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    fns = {}
    for block in (32, 64):
        for grid in (sms, 2 * sms):
            fns["SM stores", block, grid] = lambda block=block, grid=grid: _store_push[(grid,)](
                src, peer_addrs, rows, row0, PEERS=len(peers), ROWS=block, COLS=COLS, num_warps=4
            )
    for block in (32, 64):
        src_desc = TensorDescriptor(src, list(src.shape), [COLS, 1], [block, COLS])
        dst_descs = [TensorDescriptor(v, list(v.shape), [COLS, 1], [block, COLS]) for v in peer_views]
        dst_descs += dst_descs[:1] * (MAX_PEERS - len(dst_descs))
        for grid in (sms, 2 * sms):
            fns["TMA stores", block, grid] = lambda s=src_desc, d=dst_descs, block=block, grid=grid: (
                _tma_push[(grid,)](s, *d, rows, row0, PEERS=len(peers), ROWS=block, num_warps=4)
            )
    streams = [torch.cuda.Stream() for _ in peers]

    def copy_engines() -> None:
        main = torch.cuda.current_stream()
        for i, (stream, view) in enumerate(zip(streams, peer_views, strict=True)):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                view[row0 : row0 + rows].copy_(src[i * rows : (i + 1) * rows])
        for stream in streams:
            main.wait_stream(stream)

    fns["copy engines", 0, 0] = copy_engines

    # What landed: source s fills its block for its peer index i with 4 s + i.
    for i in range(len(peers)):
        src[i * rows : (i + 1) * rows].fill_(4 * rank + i)
    mine = buf.tensor[: world * rows * COLS * DTYPE.itemsize].view(DTYPE).view(world, rows, COLS)
    for key, fn in fns.items():
        mine.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        wrong = [
            s
            for s in range(world)
            if s != rank and not bool((mine[s] == 4 * s + (rank - s) % world - 1).all())
        ]
        if wrong:
            raise RuntimeError(f"rank {rank}: {key} left wrong rows from sources {wrong}")
    src.normal_()

    times = time_ranks_interleaved(fns, args.iters)
    nbytes = len(peers) * rows * COLS * DTYPE.itemsize
    rows_out = [
        {
            "how": how,
            "rows per tile": block or "",
            "programs": grid or "",
            "MiB leaving": nbytes / 2**20,
            "us": t.gpu_ms * 1e3,
            "GB/s": nbytes / t.gpu_ms / 1e6,
        }
        for (how, block, grid), t in sorted(times.items(), key=lambda kv: kv[1].gpu_ms)
    ]
    if rank == 0:
        notes = (
            f"{world} ranks, each pushing {args.mib_per_peer} MiB of contiguous 256-byte rows into each "
            "peer's symmetric buffer at once; GPU time, the slowest rank's median, variants interleaved, "
            "each call queued behind a GPU sleep and a one-word all-reduce that aligns the ranks; what "
            "landed checked on every rank first. 4 warps a program. Command: torchrun --nproc_per_node="
            f"{world} benchmarks/bench_push_floor.py --mib-per-peer {args.mib_per_peer}"
        )
        write_results("push_floor", rows_out, notes)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
