"""All-gather + matmul, bf16, over one node: weft's kernel against NCCL all-gather + cuBLAS, PyTorch's
`fused_all_gather_matmul`, and cuBLAS alone on the already-gathered input (the bar: within 1.10x).

    torchrun --nproc_per_node=4 benchmarks/bench_ag_matmul.py [--sweep] [--shapes M,K,N ...]
    python -m benchmarks.bench_ag_matmul --gemm-alone [--world 4] [--sweep] [--shapes M,K,N ...]

M is the GLOBAL row count (a_shard is [M / W, K]); N the columns of this rank's weight, an nn.Linear
weight [N, K] passed as weight.t() (the model's forward). Every rank times every implementation alike,
interleaved, on the GPU and on the host (gemm_comm.measure); the figure is the slowest rank's median
per call. Rank 0 writes benchmarks/results/ag_matmul-<device>.md/.json;
`--sweep` also times the GEMM configs of SWEEP (ag_matmul_sweep-<device>.*), the source of
kernels/ag_matmul.py's CONFIGS table. `--gemm-alone` (one GPU, no torchrun) times the kernel's GEMM of
one rank's call with every peer's rows already in place against torch.matmul on the same gathered A
(ag_matmul_gemm-<device>.*; see benchmarks/gemm_comm.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import gemm_comm
from kernels import ag_matmul as ag

SHAPES = [(4096, 4096, 7168), (8192, 4096, 7168), (16384, 8192, 14336), (16384, 8192, 2560)]
SWEEP = [
    ag.GemmConfig(128, 256, 64, 8, 8, 3, 4),
    ag.GemmConfig(128, 256, 64, 8, 8, 3, 2),
    ag.GemmConfig(128, 256, 64, 16, 8, 3, 4),
    ag.GemmConfig(128, 256, 64, 4, 8, 3, 4),
    ag.GemmConfig(128, 128, 64, 8, 8, 4, 4),
    ag.GemmConfig(128, 128, 64, 8, 4, 4, 4),
    ag.GemmConfig(128, 128, 64, 8, 4, 5, 4),
    ag.GemmConfig(64, 256, 64, 8, 4, 4, 4),
    # The C tile stored in two halves: 32 KiB less epilogue staging, room for a fourth stage.
    ag.GemmConfig(128, 256, 64, 8, 8, 3, 4, epilogue_split=2),
    ag.GemmConfig(128, 256, 64, 8, 8, 4, 4, epilogue_split=2),
    ag.GemmConfig(128, 256, 64, 16, 8, 4, 4, epilogue_split=2),
    ag.GemmConfig(128, 128, 64, 8, 4, 5, 4, epilogue_split=2),
    # The flattened, software-pipelined loop: the next tile's loads in flight during the epilogue.
    ag.GemmConfig(128, 256, 64, 8, 8, 3, 4, flatten=True),
    ag.GemmConfig(128, 256, 64, 8, 8, 3, 4, flatten=True, epilogue_split=2),
    ag.GemmConfig(128, 256, 64, 8, 8, 4, 4, flatten=True, epilogue_split=2),
    ag.GemmConfig(128, 256, 64, 16, 8, 4, 4, flatten=True, epilogue_split=2),
    ag.GemmConfig(128, 128, 64, 8, 4, 4, 4, flatten=True),
    ag.GemmConfig(128, 128, 64, 8, 8, 4, 4, flatten=True),
    ag.GemmConfig(128, 128, 64, 8, 4, 5, 4, flatten=True, epilogue_split=2),
    # The default with fewer copy-engine chunks per peer: fewer host operations per call (13 copies and
    # 12 flag writes at 4 splits on 4 GPUs), coarser arrival of the peers' rows.
    ag.GemmConfig(128, 256, 64, 8, 8, 4, 1, flatten=True, epilogue_split=2),
    ag.GemmConfig(128, 256, 64, 8, 8, 4, 2, flatten=True, epilogue_split=2),
]


def make_case(m: int, k: int, n: int, group: dist.ProcessGroup) -> gemm_comm.Case:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    shard = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(1234)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = weight.t()
    gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    ag.prepare(group, shard.numel() * shard.element_size())

    def ours(config=None):
        return ag.all_gather_matmul_kernel(shard, [b], 0, group, config=config)

    def nccl_cublas():
        dist.all_gather_into_tensor(gathered, shard, group=group)
        return torch.matmul(gathered, b)

    def torch_fused():
        return torch.ops.symm_mem.fused_all_gather_matmul(shard, [b], 0, group.group_name, return_A=True)

    def cublas():
        return torch.matmul(gathered, b)

    a, (out,) = ours()
    expect = nccl_cublas().float()
    torch.cuda.synchronize()
    ag.check(group)
    gather_ok = torch.equal(a, gathered)
    err = ((out.float() - expect).norm() / expect.norm()).item()
    if rank == 0:
        print(f"{m} {k} {n}: gathered A equal: {gather_ok}, rel. error vs cuBLAS {err:.2e}", flush=True)
    return gemm_comm.Case(
        ours=ours,
        peers={"NCCL+cuBLAS": nccl_cublas, "torch fused": torch_fused, "cuBLAS (gathered)": cublas},
        check=lambda: ag.check(group),
        error=err,
        checks={"A equal": gather_ok},
        config=ag.pick_config(n),
    )


def make_alone(m: int, k: int, n: int, world: int, rank: int) -> gemm_comm.AloneCase:
    """The GEMM of rank `rank`'s call with every shard gathered, against torch.matmul on that A."""
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).t()

    def ours(config):
        alone = ag.GemmAlone(a, [b], 0, rank, world, config)
        return (lambda: alone.run()[0]), alone.config, alone

    return gemm_comm.AloneCase(ours=ours, cublas=lambda: torch.matmul(a, b), expected=lambda out: out)


def notes(world: int, args: argparse.Namespace) -> str:
    return (
        f"bf16 over {world} GPUs, a_shard [M/{world}, K] gathered on dim 0, one weight [N, K] used "
        f"as weight.t(). {gemm_comm.timing_note(args)} ours: "
        "kernels/ag_matmul.py (copy-engine gather + persistent Triton GEMM); NCCL+cuBLAS: "
        "all_gather_into_tensor + torch.matmul; torch fused: torch.ops.symm_mem.fused_all_gather_matmul; "
        "cuBLAS: torch.matmul on the already-gathered A. Command: torchrun --nproc_per_node="
        f"{world} benchmarks/bench_ag_matmul.py{' --sweep' if args.sweep else ''}"
    )


if __name__ == "__main__":
    gemm_comm.main("ag_matmul", __doc__.split("\n\n")[0], SHAPES, SWEEP, make_case, notes, make_alone)
