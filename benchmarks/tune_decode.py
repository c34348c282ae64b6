"""Tune the decode GEMMs' tile configs inside the decode step: each weight shape's config is the one with
the fastest whole step (CUDA graph, random weights), one shape at a time. FP8 by default; `--dtype bf16`
tunes the bf16 decode path's GEMMs (the same kernel, model.decode_kernels), kept under "bf16," keys.

    python -m benchmarks.tune_decode --model llama3_8b [--batch-sizes 1 8] [--shapes 6144x4096 ...]
    python -m benchmarks.tune_decode --model llama3_8b --dtype bf16 --shapes 28672x4096

`bench_fp8 --tune` times each GEMM in back-to-back calls, where the kernel before it is another GEMM
holding every SM's shared memory. In the decode step the kernel before a GEMM is a norm, the attention
or SwiGLU, which leave SMs free, so a config that loads more of its weight before the PDL wait can win
there and lose back to back. On one H100 (Llama-3-8B, compiled FP8 step) a qkv projection config it
found (6 stages, early tile) ran batch 1 at 3.087 against 3.119 ms and batch 8 at 3.375 against 3.437
ms, alternated twice; later runs kept a 3-stage one within 8 us of it (decode_tune-llama3_8b-h100.md).

The batch sizes must share one M bucket (kernels.fp8_gemm.m_bucket): a config serves every M of its
bucket, so each candidate is judged by the sum of their step times. Candidates: bench_fp8's tune
space with K split 1-4 ways, at most two programs per SM. A candidate replaces the config in use only
if it saves more than --min-gain-us on that sum, in the sweep and again in each of --confirm rounds
that alternate it with the config in use (pick_config): one config's summed steps moved 18 us on an
H100 (FP8), 27 us (FP8) and 14-36 us (bf16) on an H200 between two measurements of one run without
them (the rows of a config measured twice in the result files), enough for a sweep to keep noise.
The winners go into kernels/fp8_gemm_configs.json under this GPU's model, after each shape (so a run
cut short keeps what it found); every candidate's step times go to
benchmarks/results/decode_tune-<model>-<device>.{json,md} (bf16: decode_tune_bf16-...), beside the
rows of shapes an earlier run tuned (each row dated).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial

import torch
from torch import nn

import kernels.fp8_gemm as gemm
from benchmarks.bench_fp8 import shape_arg, tune_space
from benchmarks.common import RESULTS_DIR, add_decode_shape_args, device_name, preset_args, write_results
from kernels.fp8 import FP8, programs_cap
from model.decode import Bf16Weight
from model.fp8 import Fp8Weight
from serve import benchmark_decode, build_model

SPLITS = (1, 2, 3, 4)


def decode_gemm_shapes(model: nn.Module, weight_type: type[nn.Module] = Fp8Weight) -> list[tuple[int, int]]:
    """The (N, K) of the model's decode GEMM weights (Fp8Weight or Bf16Weight modules), each once, in
    the order the step first runs them."""
    shapes = (tuple(m.weight.shape) for m in model.modules() if isinstance(m, weight_type))
    return list(dict.fromkeys(shapes))


def candidates(bucket: int, n: int, k: int, sm_count: int, element_bytes: int = 1) -> list[gemm.GemmConfig]:
    """bench_fp8's tune space for the M bucket (bf16: `element_bytes` 2, tiles of the same bytes), each
    with every split of K into 1-4 slices that gives each slice at least one K tile and launches at most
    two programs per SM (a single slice always)."""
    found = []
    for config in tune_space(bucket, element_bytes):
        tiles = -(-n // config.block_n)
        for split in SPLITS:
            if split > 1 and (k // split < config.block_k or tiles * split > 2 * sm_count):
                continue
            found.append(dataclasses.replace(config, split_k=split))
    return found


def pick_config(
    in_use: gemm.GemmConfig,
    configs: list[gemm.GemmConfig],
    measure: Callable[[gemm.GemmConfig], list[float]],
    min_gain_us: float,
    confirm: int,
    out_of_time: Callable[[], bool],
) -> tuple[gemm.GemmConfig, list[tuple[gemm.GemmConfig, list[float]]]]:
    """The config to keep, and every (config, step ms per batch size) measured, in order. The sweep
    measures `in_use`, then each other config until `out_of_time`, and takes one over the best so far
    where it saves more than `min_gain_us` on the summed steps (a config `measure` fails on, e.g. one
    the compiler rejects, is skipped). A winner other than `in_use` is then measured `confirm` more
    times, alternating with `in_use`, and kept only if it saves that much in every round: a step's
    time drifts between measurements, and the sweep measured `in_use` first."""

    def gain_us(slower: list[float], faster: list[float]) -> float:
        return (sum(slower) - sum(faster)) * 1e3

    best, best_ms = in_use, measure(in_use)
    tried = [(in_use, best_ms)]
    for config in configs:
        if config == in_use or out_of_time():
            continue
        try:
            ms = measure(config)
        except Exception as err:  # a config the compiler rejects (e.g. shared memory)
            print(f"skip {config}: {type(err).__name__}", flush=True)
            continue
        tried.append((config, ms))
        if gain_us(best_ms, ms) > min_gain_us:
            best, best_ms = config, ms
    for _ in range(confirm if best != in_use else 0):
        pair = [(in_use, measure(in_use)), (best, measure(best))]
        tried += pair
        if gain_us(pair[0][1], pair[1][1]) <= min_gain_us:
            return in_use, tried
    return best, tried


def check_one_bucket(batch_sizes: list[int]) -> int:
    """The M bucket every batch size falls in; an error naming the buckets where they differ."""
    buckets = {b: gemm.m_bucket(b) for b in batch_sizes}
    if len(set(buckets.values())) != 1:
        raise SystemExit(
            f"the batch sizes fall in different M buckets ({buckets}): a config serves one bucket, so tune "
            "each bucket's batch sizes in a run of their own"
        )
    if max(batch_sizes) > gemm.MAX_M:
        raise SystemExit(f"the skinny GEMM runs up to M = {gemm.MAX_M}; got batch {max(batch_sizes)}")
    return buckets[batch_sizes[0]]


def earlier_rows(name: str, bucket: int) -> list[dict[str, object]]:
    """This device's rows of an earlier run of the same model and M bucket, if any."""
    path = RESULTS_DIR / f"{name}-{device_name()}.json"
    if not path.is_file():
        return []
    return [r for r in json.loads(path.read_text())["rows"] if r.get("M_bucket") == bucket]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_decode_shape_args(parser, [1, 8])
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=shape_arg,
        help="weights NxK to tune (default: every decode GEMM weight of the model)",
    )
    parser.add_argument(
        "--dtype",
        choices=["fp8", "bf16"],
        default="fp8",
        help="the decode path whose GEMMs to tune: model.fp8, or bf16 on weft's kernels",
    )
    parser.add_argument(
        "--min-gain-us", type=float, default=10.0, help="the least saving kept, per step summed"
    )
    parser.add_argument(
        "--confirm", type=int, default=2, help="rounds of the winner against the config in use"
    )
    parser.add_argument(
        "--budget-s", type=float, default=0, help="stop trying candidates after this long (0: none)"
    )
    opts = parser.parse_args(argv)
    bucket = check_one_bucket(opts.batch_sizes)
    if not torch.cuda.is_available():
        raise SystemExit("tune_decode.py needs a CUDA GPU")
    start = time.monotonic()
    device = torch.device("cuda", torch.cuda.current_device())
    args = preset_args(opts.model)
    args.fp8 = opts.dtype == "fp8"
    args.decode_kernels = True
    dtype, element_bytes = (FP8, 1) if args.fp8 else (torch.bfloat16, 2)
    model = build_model(args, None, device, torch.bfloat16)
    shapes = decode_gemm_shapes(model, Fp8Weight if args.fp8 else Bf16Weight)
    unknown = [f"{n}x{k}" for n, k in opts.shapes or [] if (n, k) not in shapes]
    if unknown:
        raise SystemExit(
            f"{', '.join(unknown)}: not a weight of {opts.model}'s {opts.dtype} decode step "
            f"({', '.join(f'{n}x{k}' for n, k in shapes)})"
        )
    gpu = gemm.gpu_model(device)
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    table = dict(gemm.TUNED.get(gpu, {}))

    def step_ms() -> list[float]:
        return [
            benchmark_decode(model, b, opts.prompt_len, opts.decode_steps, True, device)["ms_per_token"]
            for b in opts.batch_sizes
        ]

    def measure(key: str, config: gemm.GemmConfig) -> list[float]:
        """The step times with `config` serving weight `key` and the table's configs the rest."""
        gemm.TUNED[gpu] = {**table, key: config}
        return step_ms()

    name = f"decode_tune-{opts.model}" if args.fp8 else f"decode_tune_bf16-{opts.model}"
    tuned = opts.shapes or shapes
    rows = [r for r in earlier_rows(name, bucket) if (r["N"], r["K"]) not in tuned]
    batches = " ".join(map(str, opts.batch_sizes))
    notes = (
        f"`python -m benchmarks.tune_decode --model {opts.model} --batch-sizes {batches} "
        f"--dtype {opts.dtype}`: {opts.dtype} decode step (prompt {opts.prompt_len}, {opts.decode_steps} "
        "steps timed, CUDA graph, not compiled) per "
        f"candidate config of each weight shape, M bucket {bucket}; ms per step at batch {batches}; "
        "'kept' marks each shape's config after the run; a config's later rows are the confirm rounds "
        "against the config in use"
    )
    for n, k in tuned:
        key = gemm.config_key(bucket, n, k, dtype)
        best, tried = pick_config(
            gemm.config_for(bucket, n, k, device, dtype),
            candidates(bucket, n, k, programs_cap(device), element_bytes),
            partial(measure, key),
            opts.min_gain_us,
            opts.confirm,
            lambda: bool(opts.budget_s) and time.monotonic() - start > opts.budget_s,
        )
        best_ms = next(ms for config, ms in reversed(tried) if config == best)
        table[key] = best
        gemm.save_tuned(gpu, table)
        print(f"{n}x{k}: {best} ({' / '.join(f'{t:.4f}' for t in best_ms)} ms)", flush=True)
        for config, ms in tried:
            row = {
                "date": today,
                "M_bucket": bucket,
                "N": n,
                "K": k,
                "config": str(config),
                "kept": config == best,
            }
            rows.append(row | {f"ms_batch_{b}": t for b, t in zip(opts.batch_sizes, ms, strict=True)})
        write_results(name, rows, notes)


if __name__ == "__main__":
    main()
