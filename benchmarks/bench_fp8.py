"""FP8 decode kernels beside their stock peers, timed as CUDA-graph replays on one GPU.

    python -m benchmarks.bench_fp8              # norm, SwiGLU and GEMM tables
    python -m benchmarks.bench_fp8 --tune       # tune GEMM tiles first (kernels/fp8_gemm_configs.json)

Norm: residual add + RMSNorm + per-token FP8 quantize of [rows, 16384] (ours, eager torch,
torch.compile); bytes = 2 (x) + 2 + 2 (residual in and out) + 1 (fp8 out) per element.
SwiGLU: [rows, 2 x 14336] -> FP8 [rows, 14336]; bytes = 4 + 1 per output element.
GEMM: FP8 x FP8 -> bf16 at M = 1..64 (ours and torch._scaled_mm, both with per-token x per-channel
scales); bandwidth counts the weight bytes. Weights (and inputs) are rotated among copies that
together exceed the L2 cache, so every call reads from HBM.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.common import time_graph, write_results
from kernels import fp8
from kernels import fp8_gemm as gemm
from kernels.fp8 import quantize_per_token, quantize_weight_per_channel
from kernels.fp8_norm import add_rmsnorm_fp8, add_rmsnorm_fp8_reference
from kernels.fp8_swiglu import swiglu_fp8, swiglu_fp8_reference

ROWS = [1, 4, 16, 64, 256, 1024, 2048]
GEMM_M = [1, 2, 4, 8, 16, 32, 64]
GEMM_NK = [(2304, 16384), (13312, 16384), (16384, 6656), (6144, 4096), (4096, 14336)]
ROTATE_BYTES = 256 << 20  # several times the 50-60 MB L2


def copies_for(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // max(nbytes, 1)))


def rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs the next of `fns` on each call: captured into a graph, each captured
    call reads a different copy."""
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()

    return call


def time_us(fns: list[Callable[[], object]]) -> float:
    return time_graph(rotating(fns), calls_per_graph=max(20, len(fns)), replays=20) * 1e3


def bench_norm(hidden: int = 16384) -> list[dict[str, object]]:
    compiled = torch.compile(add_rmsnorm_fp8_reference)
    rows_out = []
    for rows in ROWS:
        nbytes = rows * hidden * 7 + rows * 4
        sets = [
            (
                torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16),
                torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(copies_for(nbytes))
        ]
        weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
        ours = time_us([partial(add_rmsnorm_fp8, x, r, weight, 1e-5, None) for x, r in sets])
        eager = time_us([partial(add_rmsnorm_fp8_reference, x, r, weight, 1e-5, None) for x, r in sets])
        comp = time_us([partial(compiled, x, r, weight, 1e-5, None) for x, r in sets])
        rows_out.append(row("add+rmsnorm+fp8", rows, hidden, nbytes, ours, eager, comp))
    return rows_out


def bench_swiglu(hidden: int = 14336) -> list[dict[str, object]]:
    compiled = torch.compile(swiglu_fp8_reference)
    rows_out = []
    for rows in ROWS:
        nbytes = rows * hidden * 5 + rows * 4
        inputs = [
            torch.randn(rows, 2 * hidden, device="cuda", dtype=torch.bfloat16)
            for _ in range(copies_for(nbytes))
        ]
        ours = time_us([partial(swiglu_fp8, x, None) for x in inputs])
        eager = time_us([partial(swiglu_fp8_reference, x, None) for x in inputs])
        comp = time_us([partial(compiled, x, None) for x in inputs])
        rows_out.append(row("swiglu+fp8", rows, hidden, nbytes, ours, eager, comp))
    return rows_out


def row(
    op: str, rows: int, hidden: int, nbytes: int, ours: float, eager: float, comp: float
) -> dict[str, object]:
    return {
        "op": op,
        "rows": rows,
        "hidden": hidden,
        "ours_us": ours,
        "eager_us": eager,
        "compile_us": comp,
        "ours_TBps": nbytes / ours / 1e6,
        "compile_TBps": nbytes / comp / 1e6,
        "speedup_vs_compile": comp / ours,
    }


def sweep_row_warps() -> None:
    """Norm and SwiGLU at 1, 64, 1024 and 2048 rows for several kernels.fp8.ELEMENTS_PER_WARP."""
    default = fp8.ELEMENTS_PER_WARP
    for per_warp in [256, 512, 1024, 2048]:
        fp8.ELEMENTS_PER_WARP = per_warp
        for rows in [1, 64, 1024, 2048]:
            x, r = (torch.randn(rows, 16384, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            w = torch.rand(16384, device="cuda", dtype=torch.bfloat16)
            gate_up = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16)
            norm_us = time_us([partial(add_rmsnorm_fp8, x, r, w, 1e-5, None)])
            swiglu_us = time_us([partial(swiglu_fp8, gate_up, None)])
            print(
                f"elements/warp {per_warp} rows {rows}: norm {norm_us:.2f} us, swiglu {swiglu_us:.2f} us",
                flush=True,
            )
    fp8.ELEMENTS_PER_WARP = default


def gemm_operands(m: int, n: int, k: int):
    a, a_scale = quantize_per_token(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    weights = [
        quantize_weight_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        for _ in range(copies_for(n * k))
    ]
    return a, a_scale, weights


def scaled_mm(a, a_scale, b, b_scale):
    return torch._scaled_mm(
        a, b.t(), scale_a=a_scale.view(-1, 1), scale_b=b_scale.view(1, -1), out_dtype=torch.bfloat16
    )


def tune_gemm() -> None:
    """Try tile configs per (M bucket, N, K) and keep the fastest in kernels/fp8_gemm_configs.json."""
    best: dict[str, gemm.GemmConfig] = dict(gemm.TUNED)
    for (n, k), m in itertools.product(GEMM_NK, [16, 32, 64]):
        a, a_scale, weights = gemm_operands(m, n, k)
        results = []
        for block_n, block_k, split, stages in itertools.product(
            [32, 64, 128], [128, 256], [1, 2, 4, 8, 16], [4]
        ):
            if split * block_k > k or (m == 64 and block_k == 256 and block_n == 128):
                continue
            cfg = gemm.GemmConfig(block_n, block_k, split, num_warps=4, num_stages=stages)
            try:
                t = time_us([partial(gemm.skinny_fp8_gemm, a, a_scale, b, s, cfg) for b, s in weights])
            except Exception as err:  # a config the compiler rejects (e.g. shared memory): skip it
                print(f"skip {cfg}: {type(err).__name__}", flush=True)
                continue
            results.append((t, cfg))
        t, cfg = min(results, key=lambda r: r[0])
        best[gemm.config_key(m, n, k)] = cfg
        print(f"tuned M<={m} N={n} K={k}: {cfg} {t:.1f} us ({n * k / t / 1e6:.2f} TB/s)", flush=True)
    gemm.save_tuned(best)
    gemm.TUNED.update(best)


def bench_gemm() -> list[dict[str, object]]:
    rows_out = []
    for (n, k), m in itertools.product(GEMM_NK, GEMM_M):
        a, a_scale, weights = gemm_operands(m, n, k)
        ours = time_us([partial(gemm.fp8_gemm, a, a_scale, b, s) for b, s in weights])
        peer = time_us([partial(scaled_mm, a, a_scale, b, s) for b, s in weights])
        rows_out.append(
            {
                "M": m,
                "N": n,
                "K": k,
                "ours_us": ours,
                "scaled_mm_us": peer,
                "ours_TBps": n * k / ours / 1e6,
                "scaled_mm_TBps": n * k / peer / 1e6,
                "speedup": peer / ours,
                "config": str(gemm.config_for(m, n, k)),
            }
        )
        print(rows_out[-1], flush=True)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tune", action="store_true", help="tune GEMM tiles first and save them")
    parser.add_argument("--only", choices=["norm", "swiglu", "gemm"], help="run one table")
    parser.add_argument(
        "--sweep-row-warps", action="store_true", help="time the row kernels at several warp counts"
    )
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8.py needs a CUDA GPU")
    if opts.tune:
        tune_gemm()
    if opts.sweep_row_warps:
        sweep_row_warps()
    if opts.only in (None, "norm"):
        write_results(
            "fp8_norm", bench_norm(), notes="CUDA-graph replays, inputs rotated beyond L2; dynamic scales"
        )
    if opts.only in (None, "swiglu"):
        write_results(
            "fp8_swiglu", bench_swiglu(), notes="CUDA-graph replays, inputs rotated beyond L2; dynamic scales"
        )
    if opts.only in (None, "gemm"):
        write_results(
            "fp8_gemm",
            bench_gemm(),
            notes="CUDA-graph replays, weights rotated beyond L2; TB/s of weight reads",
        )


if __name__ == "__main__":
    main()
