"""Matmul + reduce-scatter, bf16, over one node: weft's kernel against cuBLAS + NCCL reduce-scatter,
PyTorch's `fused_matmul_reduce_scatter`, and the cuBLAS matmul alone (the bar: within 1.15x of it).

    torchrun --nproc_per_node=4 benchmarks/bench_matmul_rs.py [--sweep] [--shapes M,K,N ...]

M is the GLOBAL row count and K this rank's inner size: a is [M, K] on every rank, the output shard
[M / W, N]; the weight is an nn.Linear weight [N, K] passed as weight.t() (the model's forward). Every
rank times every implementation with CUDA events around `--reps` back-to-back calls (the host queues
ahead, as in training); the figure is the slowest rank's median per call. Rank 0 writes
benchmarks/results/matmul_rs-<device>.md/.json; `--sweep` also times the GEMM configs of SWEEP
(matmul_rs_sweep-<device>.*), the source of kernels/matmul_rs.py's CONFIGS table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import time_events, write_results
from kernels import matmul_rs as mrs

SHAPES = [(4096, 3584, 4096), (8192, 3584, 4096), (16384, 7168, 8192)]
SWEEP = [
    mrs.GemmConfig(128, 256, 64, 8, 8, 3),
    mrs.GemmConfig(128, 256, 64, 16, 8, 3),
    mrs.GemmConfig(128, 256, 64, 4, 8, 3),
    mrs.GemmConfig(128, 128, 64, 8, 8, 4),
    mrs.GemmConfig(128, 128, 64, 8, 4, 4),
    mrs.GemmConfig(64, 256, 64, 8, 4, 4),
]


def slowest(ms: float) -> float:
    """Max over ranks of a per-rank figure."""
    t = torch.tensor([ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, reps: int, iters: int) -> float:
    """Slowest rank's median milliseconds per call of `fn`, `reps` calls per timed sample."""

    def run() -> None:
        for _ in range(reps):
            fn()

    torch.cuda.synchronize()
    dist.barrier()
    return slowest(time_events(run, iters=iters, warmup=2) / reps)


def bench_shape(m: int, k: int, n: int, group: dist.ProcessGroup, args: argparse.Namespace):
    """(result row, sweep rows) of one M K N."""
    rank, world, name = dist.get_rank(), dist.get_world_size(), group.group_name
    torch.manual_seed(rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(1234 + rank)  # each rank holds its own K shard of the weight
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = weight.t()
    shard = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
    mrs.prepare(a, b, 0, group)

    def ours(config=None):
        return mrs.matmul_reduce_scatter_kernel(a, b, 0, group, config=config)

    def cublas_nccl():
        dist.reduce_scatter_tensor(shard, torch.matmul(a, b), group=group)
        return shard

    def torch_fused():
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, name)

    def cublas():
        return torch.matmul(a, b)

    # Correctness first: a wrong kernel's timing is meaningless.
    out = ours()
    expect = cublas_nccl().float()
    torch.cuda.synchronize()
    mrs.check(group)
    err = ((out.float() - expect).norm() / expect.norm()).item()
    if rank == 0:
        print(f"{m} {k} {n}: rel. error vs cuBLAS + NCCL {err:.2e}", flush=True)
    del out, expect

    ms = {}
    for label, fn in (("ours", ours), ("nccl", cublas_nccl), ("torch", torch_fused), ("cublas", cublas)):
        try:
            ms[label] = timed(fn, args.reps, args.iters)
        except Exception as e:  # one failing peer must not hide the others' figures
            print(f"rank {rank}: {label} at {m} {k} {n} failed: {e}", flush=True)
            ms[label] = float("nan")
    mrs.check(group)
    flops = 2 * m * k * n
    row = {
        "M K N": f"{m} {k} {n}",
        "ours us": ms["ours"] * 1e3,
        "cuBLAS+NCCL us": ms["nccl"] * 1e3,
        "torch fused us": ms["torch"] * 1e3,
        "cuBLAS alone us": ms["cublas"] * 1e3,
        "ours / cuBLAS": ms["ours"] / ms["cublas"],
        "ours / cuBLAS+NCCL": ms["ours"] / ms["nccl"],
        "ours / torch fused": ms["ours"] / ms["torch"],
        "ours TFLOP/s": flops / ms["ours"] / 1e9,
        "cuBLAS TFLOP/s": flops / ms["cublas"] / 1e9,
        "config": " ".join(map(str, dataclasses.astuple(mrs.pick_config(n)))),
        "rel err": err,
    }
    if rank == 0:
        print(row, flush=True)

    sweep = []
    for cfg in SWEEP if args.sweep else ():
        t = timed(lambda cfg=cfg: ours(cfg), args.reps, args.iters)
        sweep.append(
            {
                "M K N": f"{m} {k} {n}",
                "BM BN BK GROUP_M warps stages": " ".join(map(str, dataclasses.astuple(cfg))),
                "us": t * 1e3,
                "/ cuBLAS": t / ms["cublas"],
            }
        )
        if rank == 0:
            print("  sweep", sweep[-1], flush=True)
    mrs.check(group)
    return row, sweep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES], help="M,K,N ...")
    p.add_argument("--reps", type=int, default=3, help="back-to-back calls per timed sample")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--sweep", action="store_true", help="also time every config of SWEEP")
    args = p.parse_args()

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    name = group.group_name
    if hasattr(symm_mem, "is_symm_mem_enabled_for_group") and not symm_mem.is_symm_mem_enabled_for_group(
        name
    ):
        with warnings.catch_warnings():  # torch 2.11 needs it once per group; later versions: a no-op
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(name)

    rows, sweep_rows = [], []
    for spec in args.shapes:
        m, k, n = (int(v) for v in spec.split(","))
        if m % world:
            raise SystemExit(f"M={m} does not split over {world} ranks")
        row, sweep = bench_shape(m, k, n, group, args)
        rows.append(row)
        sweep_rows += sweep
        torch.cuda.empty_cache()

    if rank == 0:
        notes = (
            f"bf16 over {world} GPUs, a [M, K] on every rank (K: this rank's inner size), one weight "
            f"[N, K] used as weight.t(), output shard [M/{world}, N]. Microseconds per call: the slowest "
            f"rank's median of {args.iters} samples of {args.reps} back-to-back calls (CUDA events). "
            "ours: kernels/matmul_rs.py (persistent Triton GEMM pushing tiles to the peers, own rows "
            "reduced in its epilogue); cuBLAS+NCCL: torch.matmul + reduce_scatter_tensor; torch fused: "
            "torch.ops.symm_mem.fused_matmul_reduce_scatter; cuBLAS alone: torch.matmul. Command: torchrun "
            f"--nproc_per_node={world} benchmarks/bench_matmul_rs.py{' --sweep' if args.sweep else ''}"
        )
        write_results("matmul_rs", rows, notes)
        if sweep_rows:
            write_results("matmul_rs_sweep", sweep_rows, "GEMM config sweep of ours; " + notes)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
