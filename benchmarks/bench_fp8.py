r"""FP8 decode kernels beside their stock peers, timed as CUDA-graph replays on one GPU.

    python -m benchmarks.bench_fp8              # norm, SwiGLU and GEMM tables
    python -m benchmarks.bench_fp8 --only untuned   # the GEMM on its rule for untuned shapes
    python -m benchmarks.bench_fp8 --tune       # first tune GEMM tiles for this GPU (fp8_gemm_configs.json)
    python -m benchmarks.bench_fp8 --tune --tune-shapes 8192x8192 --only none   # ... and your model's shapes
    python -m benchmarks.bench_fp8 --tune --no-tune-table-shapes --tune-shapes 8192x8192 --tune-buckets 16 \
        --only none                             # only your shapes, decode batches up to 16
    python -m benchmarks.bench_fp8 --sweep-rows # also time the row kernels' launch variants

Norm: residual add + RMSNorm + per-token FP8 quantize of [rows, 16384] (ours, eager torch,
torch.compile); bytes = 2 (x) + 2 + 2 (residual in and out) + 1 (fp8 out) per element.
SwiGLU: [rows, 2 x 14336] -> FP8 [rows, 14336]; bytes = 4 + 1 per output element.
GEMM: FP8 x FP8 -> bf16 at M = 1..64 (ours and torch._scaled_mm, both with per-token x per-channel
scales); bandwidth counts the weight bytes. Weights (norm weights too) and inputs are rotated among
copies that together exceed the L2 cache, so every call reads from HBM. Our kernels are timed with
programmatic dependent launch (as served) and without.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Callable, Sequence
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
# The other FP8 decode GEMMs of Llama-3-8B (serve.py's benchmark model: wo, fused w1|w3, output):
# tuned with the table's shapes so that serving it never falls back to heuristic_config, not tabled.
TUNE_ONLY_NK = [(4096, 4096), (28672, 4096), (128256, 4096)]
# Shapes tuned for nothing, to time heuristic_config, the rule every other shape runs on: Llama-3-70B's
# decode GEMMs whole (wqkv, wo, w1|w3, w2) and split 8 ways by tensor parallelism.
UNTUNED_NK = [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]
UNTUNED_NK += [(1280, 8192), (8192, 1024), (7168, 8192), (8192, 3584)]
UNTUNED_M = [1, 8, 16, 64]
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


def set_pdl(on: bool) -> None:
    fp8.USE_PDL = on


def both_pdl(fns: list[Callable[[], object]]) -> tuple[float, float]:
    """(us with programmatic dependent launch, us without) for our kernels."""
    set_pdl(False)
    plain = time_us(fns)
    set_pdl(True)
    return time_us(fns), plain


def norm_sets(rows: int, hidden: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    nbytes = rows * hidden * 7 + rows * 4 + hidden * 2
    return [
        (
            torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16),
            torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16),
            torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5,
        )
        for _ in range(copies_for(nbytes))
    ]


def bench_norm(hidden: int = 16384) -> list[dict[str, object]]:
    compiled = torch.compile(add_rmsnorm_fp8_reference)
    rows_out = []
    for rows in ROWS:
        nbytes = rows * hidden * 7 + rows * 4
        sets = norm_sets(rows, hidden)
        ours, plain = both_pdl([partial(add_rmsnorm_fp8, x, r, w, 1e-5, None) for x, r, w in sets])
        eager = time_us([partial(add_rmsnorm_fp8_reference, x, r, w, 1e-5, None) for x, r, w in sets])
        comp = time_us([partial(compiled, x, r, w, 1e-5, None) for x, r, w in sets])
        rows_out.append(row("add+rmsnorm+fp8", rows, hidden, nbytes, ours, plain, eager, comp))
        print(rows_out[-1], flush=True)
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
        ours, plain = both_pdl([partial(swiglu_fp8, x, None) for x in inputs])
        eager = time_us([partial(swiglu_fp8_reference, x, None) for x in inputs])
        comp = time_us([partial(compiled, x, None) for x in inputs])
        rows_out.append(row("swiglu+fp8", rows, hidden, nbytes, ours, plain, eager, comp))
        print(rows_out[-1], flush=True)
    return rows_out


def row(
    op: str, rows: int, hidden: int, nbytes: int, ours: float, plain: float, eager: float, comp: float
) -> dict[str, object]:
    return {
        "op": op,
        "rows": rows,
        "hidden": hidden,
        "ours_us": ours,
        "ours_no_pdl_us": plain,
        "eager_us": eager,
        "compile_us": comp,
        "ours_TBps": nbytes / ours / 1e6,
        "ours_no_pdl_TBps": nbytes / plain / 1e6,
        "compile_TBps": nbytes / comp / 1e6,
        "speedup_vs_compile": comp / ours,
    }


def sweep_rows() -> list[dict[str, object]]:
    """Norm and SwiGLU, one program per row, at 1, 256 and 1024 rows for several elements per warp
    (kernels.fp8 knobs), with PDL."""
    defaults = (
        fp8.ELEMENTS_PER_WARP,
        fp8.NORM_ELEMENTS_PER_WARP,
        fp8.PERSISTENT_ROWS_PER_SM,
        fp8.NORM_PERSISTENT_ROWS_PER_SM,
    )
    out = []
    fp8.PERSISTENT_ROWS_PER_SM = fp8.NORM_PERSISTENT_ROWS_PER_SM = 10**9
    for rows in [1, 256, 1024]:
        sets = norm_sets(rows, 16384)
        gate_up = [
            torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16)
            for _ in range(copies_for(rows * 14336 * 5))
        ]
        for per_warp in [512, 1024, 2048]:
            fp8.ELEMENTS_PER_WARP = fp8.NORM_ELEMENTS_PER_WARP = per_warp
            norm_us = time_us([partial(add_rmsnorm_fp8, x, r, w, 1e-5, None) for x, r, w in sets])
            swiglu_us = time_us([partial(swiglu_fp8, x, None) for x in gate_up])
            out.append(
                {
                    "rows": rows,
                    "elements_per_warp": per_warp,
                    "norm_us": norm_us,
                    "norm_TBps": rows * 16384 * 7 / norm_us / 1e6,
                    "swiglu_us": swiglu_us,
                    "swiglu_TBps": rows * 14336 * 5 / swiglu_us / 1e6,
                }
            )
            print(out[-1], flush=True)
    (
        fp8.ELEMENTS_PER_WARP,
        fp8.NORM_ELEMENTS_PER_WARP,
        fp8.PERSISTENT_ROWS_PER_SM,
        fp8.NORM_PERSISTENT_ROWS_PER_SM,
    ) = defaults
    return out


def gemm_operands(m: int, n: int, k: int):
    a, a_scale = quantize_per_token(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    weights = [
        quantize_weight_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        for _ in range(copies_for(n * k))
    ]
    return a, a_scale, weights


def bf16_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies_for(2 * n * k))
    ]
    return a, weights


SkinnyCall = Callable[[gemm.GemmConfig], torch.Tensor]


def skinny_calls(m: int, n: int, k: int, dtype: torch.dtype) -> list[SkinnyCall]:
    """The skinny GEMM on operands of `dtype` (FP8 or bf16), one call per rotated weight copy, each
    taking the tile config to run."""
    if dtype == fp8.FP8:
        a, a_scale, weights = gemm_operands(m, n, k)
        return [partial(gemm.skinny_fp8_gemm, a, a_scale, b, s) for b, s in weights]
    a, weights = bf16_operands(m, n, k)
    return [partial(gemm.skinny_bf16_gemm, a, b) for b in weights]


def scaled_mm(a, a_scale, b, b_scale):
    return torch._scaled_mm(
        a, b.t(), scale_a=a_scale.view(-1, 1), scale_b=b_scale.view(1, -1), out_dtype=torch.bfloat16
    )


def tune_space(bucket: int, element_bytes: int = 1) -> list[gemm.GemmConfig]:
    """Tile configs tried per M bucket (split_k 1 here, swept on top), block_k given for e4m3 and
    divided by `element_bytes` (bf16: 2, tiles of the same bytes). Swapped 64-row weight tiles won
    every shape on H200 (wgmma reads e4m3 from shared memory); at M <= 16, without the early tile,
    256 x 5 and 128 x 11 stages fit two programs per SM."""

    def swapped(bn: int, bk: int, **kwargs) -> gemm.GemmConfig:
        return gemm.GemmConfig(bn, bk // element_bytes, 1, swap_ab=True, **kwargs)

    if bucket <= 16:
        space = [swapped(64, 128, num_stages=st) for st in (3, 4, 6, 8)]
        space += [swapped(64, 256, num_stages=st) for st in (3, 4, 6)]
        space += [swapped(64, 512, num_stages=3), swapped(128, 128, num_stages=4)]
        space += [swapped(128, 256, num_stages=3)]
        space += [swapped(64, bk, num_stages=st, early_tile=False) for bk, st in ((256, 5), (128, 11))]
        return [*space, gemm.GemmConfig(32, 256 // element_bytes, 1, num_stages=4)]
    space = [swapped(bn, bk, num_stages=st) for bn in (64, 128) for bk in (128, 256) for st in (3, 4)]
    return [*space, gemm.GemmConfig(64, 256 // element_bytes, 1, num_stages=4)]


SPLITS = [1, 2, 3, 4, 5, 6, 8, 11, 12, 16]
TUNE_BUCKETS = (16, 32, 64)  # M buckets of kernels.fp8_gemm.m_bucket: decode batches up to 64


def shape_arg(text: str) -> tuple[int, int]:
    """ "NxK" (a weight of N output rows and K inputs, e.g. 4096x14336) as (N, K)."""
    n, sep, k = text.lower().partition("x")
    if not (sep and n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a weight shape NxK such as 4096x14336")
    return int(n), int(k)


def tune_gemm(
    extra_nk: list[tuple[int, int]],
    dtype: torch.dtype = fp8.FP8,
    shapes: list[tuple[int, int]] | None = None,
    buckets: Sequence[int] = TUNE_BUCKETS,
) -> list[dict[str, object]]:
    """Try tile configs per (M bucket, N, K) (with PDL, as served) on operands of `dtype` (FP8 or bf16)
    for `shapes` (default: the table's and TUNE_ONLY_NK) and `extra_nk`, and keep the fastest in
    kernels/fp8_gemm_configs.json, under this GPU's model name (bf16 keys apart: config_key), saved
    after each M bucket."""
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = gemm.gpu_model(device)
    best: dict[str, gemm.GemmConfig] = dict(gemm.TUNED.get(gpu, {}))
    element_bytes = 1 if dtype == fp8.FP8 else 2
    shapes = dict.fromkeys((GEMM_NK + TUNE_ONLY_NK if shapes is None else shapes) + extra_nk)  # each once
    log = []
    for m in buckets:
        calls = {(n, k): skinny_calls(m, n, k, dtype) for n, k in shapes}
        results: dict[tuple[int, int], list[tuple[float, gemm.GemmConfig]]] = {nk: [] for nk in calls}
        # The config in use before this run (tuned earlier, the reference GPU's, or the heuristic).
        before = {}
        for (n, k), fns in calls.items():
            cfg = gemm.config_for(m, n, k, device, dtype)
            before[(n, k)] = cfg, time_us([partial(fn, cfg) for fn in fns])
        for space_cfg in tune_space(m, element_bytes):
            bk = space_cfg.block_k
            for (n, k), fns in calls.items():
                for split in SPLITS:
                    if (split - 1) * bk >= k or (split > 1 and k // split < bk):
                        continue
                    cfg = dataclasses.replace(space_cfg, split_k=split)
                    try:
                        t = time_us([partial(fn, cfg) for fn in fns])
                    except Exception as err:  # a config the compiler rejects (e.g. shared memory)
                        print(f"skip {cfg}: {type(err).__name__}", flush=True)
                        break
                    results[(n, k)].append((t, cfg))
        for (n, k), found in results.items():
            found.sort(key=lambda r: r[0])
            t, cfg = found[0]
            best[gemm.config_key(m, n, k, dtype)] = cfg
            for rank, (tt, cc) in enumerate(found[:5]):
                log.append(
                    {
                        "M_bucket": m,
                        "N": n,
                        "K": k,
                        "rank": rank,
                        "us": tt,
                        "TBps": n * k * element_bytes / tt / 1e6,
                        "config": str(cc),
                        "before_us": before[(n, k)][1],
                        "before_config": str(before[(n, k)][0]),
                    }
                )
            print(
                f"tuned M<={m} N={n} K={k}: {cfg} {t:.2f} us ({n * k * element_bytes / t / 1e6:.2f} TB/s); "
                f"before {before[(n, k)][1]:.2f} us with {before[(n, k)][0]}",
                flush=True,
            )
        gemm.save_tuned(gpu, best)
    return log


def bench_gemm(
    shapes: list[tuple[int, int]] = GEMM_NK, ms: list[int] = GEMM_M, heuristic: bool = False
) -> list[dict[str, object]]:
    """Ours (fp8_gemm, or with `heuristic` the skinny kernel on heuristic_config even where tuned)
    beside torch._scaled_mm at every shape and M."""
    rows_out = []
    for (n, k), m in itertools.product(shapes, ms):
        a, a_scale, weights = gemm_operands(m, n, k)
        if heuristic:
            cfg = gemm.heuristic_config(m, n, k, fp8.programs_cap(a.device))
            ours_fn = partial(gemm.skinny_fp8_gemm, config=cfg)
        else:
            cfg, ours_fn = gemm.config_for(m, n, k, a.device), gemm.fp8_gemm
        ours, plain = both_pdl([partial(ours_fn, a, a_scale, b, s) for b, s in weights])
        peer = time_us([partial(scaled_mm, a, a_scale, b, s) for b, s in weights])
        rows_out.append(
            {
                "M": m,
                "N": n,
                "K": k,
                "ours_us": ours,
                "ours_no_pdl_us": plain,
                "scaled_mm_us": peer,
                "ours_TBps": n * k / ours / 1e6,
                "ours_no_pdl_TBps": n * k / plain / 1e6,
                "scaled_mm_TBps": n * k / peer / 1e6,
                "speedup": peer / ours,
                "config": str(cfg),
            }
        )
        print(rows_out[-1], flush=True)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tune", action="store_true", help="tune GEMM tiles first and save them")
    parser.add_argument(
        "--tune-shapes",
        nargs="+",
        type=shape_arg,
        default=[],
        metavar="NxK",
        help="with --tune, also tune these weight shapes (e.g. your model's: 8192x8192 57344x8192)",
    )
    parser.add_argument(
        "--tune-table-shapes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --tune, tune the tables' shapes (--no-tune-table-shapes: only --tune-shapes)",
    )
    parser.add_argument(
        "--tune-buckets",
        nargs="+",
        type=int,
        choices=TUNE_BUCKETS,
        default=list(TUNE_BUCKETS),
        help="with --tune, the M buckets to tune (16: decode batches up to 16)",
    )
    parser.add_argument(
        "--only", choices=["norm", "swiglu", "gemm", "untuned", "none"], help="run one table (or none)"
    )
    parser.add_argument(
        "--sweep-rows", action="store_true", help="time the row kernels' launch variants (fp8_row_sweep)"
    )
    opts = parser.parse_args()
    if opts.tune_shapes and not opts.tune:
        parser.error("--tune-shapes needs --tune")
    if opts.tune and not (opts.tune_table_shapes or opts.tune_shapes):
        parser.error("--no-tune-table-shapes leaves nothing to tune: name your shapes with --tune-shapes NxK")
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8.py needs a CUDA GPU")
    note = (
        "CUDA-graph replays, inputs and weights rotated beyond L2; ours_us with programmatic dependent "
        "launch (kernels.fp8.USE_PDL, as served), ours_no_pdl_us launched plainly"
    )
    if opts.tune:
        table = None if opts.tune_table_shapes else []
        log = tune_gemm(opts.tune_shapes, shapes=table, buckets=opts.tune_buckets)
        name = "fp8_gemm_tune" if opts.tune_table_shapes else "fp8_gemm_tune_shapes"
        write_results(name, log, notes="best 5 tile configs per shape, M bucket; " + note)
    if opts.only in (None, "gemm"):
        gpu = gemm.gpu_model(torch.device("cuda", torch.cuda.current_device()))
        tuned_on = gpu if gpu in gemm.TUNED else gemm.REFERENCE_GPU
        gemm_note = f"{note}; TB/s of weight reads; configs tuned on {tuned_on}"
        write_results("fp8_gemm", bench_gemm(), notes=gemm_note)
    if opts.only in (None, "untuned"):
        untuned_rows = bench_gemm(UNTUNED_NK, UNTUNED_M, heuristic=True)
        untuned_note = f"{note}; TB/s of weight reads; every shape on kernels.fp8_gemm.heuristic_config"
        write_results("fp8_gemm_untuned", untuned_rows, notes=untuned_note)
    if opts.sweep_rows:
        write_results("fp8_row_sweep", sweep_rows(), notes=note + "; dynamic scales")
    if opts.only in (None, "norm"):
        write_results("fp8_norm", bench_norm(), notes=note + "; dynamic scales")
    if opts.only in (None, "swiglu"):
        write_results("fp8_swiglu", bench_swiglu(), notes=note + "; dynamic scales")


if __name__ == "__main__":
    main()
