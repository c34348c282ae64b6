"""Matmul + reduce-scatter, bf16, over one node: weft's kernel against cuBLAS + NCCL reduce-scatter,
PyTorch's `fused_matmul_reduce_scatter`, and the cuBLAS matmul alone (the bar: within 1.15x of it).

    torchrun --nproc_per_node=4 benchmarks/bench_matmul_rs.py [--sweep] [--shapes M,K,N ...]
    python -m benchmarks.bench_matmul_rs --gemm-alone [--world 4] [--sweep] [--shapes M,K,N ...]

M is the GLOBAL row count and K this rank's inner size: a is [M, K] on every rank, the output shard
[M / W, N]; the weight is an nn.Linear weight [N, K] passed as weight.t() (the model's forward). Every
rank times every implementation alike, interleaved, on the GPU and on the host (gemm_comm.measure); the
figure is the slowest rank's median per call. Rank 0 writes
benchmarks/results/matmul_rs-<device>.md/.json; `--sweep` also times the GEMM configs of SWEEP
(matmul_rs_sweep-<device>.*), the source of kernels/matmul_rs.py's CONFIGS table. `--gemm-alone` (one
GPU, no torchrun) times the kernel of one rank's call with its pushes landing in local memory and the
peers' partials already in place against torch.matmul on the same operands
(matmul_rs_gemm-<device>.*; see benchmarks/gemm_comm.py). `--world 1` times the same kernels with no
peers, so no staging and no reduction: the tile schedule and its epilogue alone
(matmul_rs_gemm_world1-<device>.*).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import gemm_comm
from kernels import matmul_rs as mrs

SHAPES = [(8192, 3584, 4096), (16384, 7168, 8192), (4096, 4096, 7168), (16384, 14336, 8192)]
# What else was swept (tiles 128x128, 64x256, 128x256x32, two programs per SM, TMA stores for the pushes
# and for the staging) and lost: benchmarks/results/matmul_rs_gemm-h100.md. group_m also sets the
# copies' chunks.
SWEEP = [
    mrs.GemmConfig(128, 256, 64, 2, 8, 4),
    mrs.GemmConfig(128, 256, 64, 4, 8, 4),
    mrs.GemmConfig(128, 256, 64, 16, 8, 4),
    mrs.GemmConfig(128, 256, 64, 8, 8, 3),
]


def make_case(m: int, k: int, n: int, group: dist.ProcessGroup) -> gemm_comm.Case:
    rank, world = dist.get_rank(), dist.get_world_size()
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
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group.group_name)

    def cublas():
        return torch.matmul(a, b)

    out = ours()
    expect = cublas_nccl().float()
    torch.cuda.synchronize()
    mrs.check(group)
    err = ((out.float() - expect).norm() / expect.norm()).item()
    if rank == 0:
        print(f"{m} {k} {n}: rel. error vs cuBLAS + NCCL {err:.2e}", flush=True)
    return gemm_comm.Case(
        ours=ours,
        peers={"cuBLAS+NCCL": cublas_nccl, "torch fused": torch_fused, "cuBLAS alone": cublas},
        check=lambda: mrs.check(group),
        error=err,
        checks={},
        config=mrs.pick_config(mrs.scatter_layout(a.shape, 0, n, world)),
    )


def make_alone(m: int, k: int, n: int, world: int, rank: int) -> gemm_comm.AloneCase:
    """The kernel of rank `rank`'s call, pushes into local memory, against torch.matmul (the full
    product; ours keeps this rank's rows of it, the peers' partials being zeros)."""
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).t()

    def ours(config):
        alone = mrs.GemmAlone(a, b, 0, rank, world, config)
        return alone.run, alone.config, alone

    def own_rows(product: torch.Tensor) -> torch.Tensor:
        return product.view(world, m // world, n)[rank]

    return gemm_comm.AloneCase(ours=ours, cublas=lambda: torch.matmul(a, b), expected=own_rows)


def notes(world: int, args: argparse.Namespace) -> str:
    return (
        f"bf16 over {world} GPUs, a [M, K] on every rank (K: this rank's inner size), one weight "
        f"[N, K] used as weight.t(), output shard [M/{world}, N]. {gemm_comm.timing_note(args)} "
        "ours: kernels/matmul_rs.py (persistent Triton GEMMs: the peers' tiles staged locally and "
        "moved by copy engines as chunks complete, own rows reduced in the second GEMM's epilogue); "
        "cuBLAS+NCCL: torch.matmul + reduce_scatter_tensor; torch fused: "
        "torch.ops.symm_mem.fused_matmul_reduce_scatter; cuBLAS alone: torch.matmul. Command: torchrun "
        f"--nproc_per_node={world} benchmarks/bench_matmul_rs.py{' --sweep' if args.sweep else ''}"
    )


if __name__ == "__main__":
    gemm_comm.main("matmul_rs", __doc__.split("\n\n")[0], SHAPES, SWEEP, make_case, notes, make_alone)
