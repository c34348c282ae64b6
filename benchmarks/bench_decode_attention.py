"""Decode attention, one new token per sequence: weft's fused kernel (kernels/decode_attention.py) beside
the stock path it replaces, timed as CUDA-graph replays on one GPU.

    python -m benchmarks.bench_decode_attention            # Llama-3-8B and 70B heads, batch 1 and 8
    python -m benchmarks.bench_decode_attention --sweep    # ... and ours at other tile / split settings
    python -m benchmarks.bench_decode_attention --smoke    # one tiny shape, any device (CPU: interpreter)

Each row: one layer's attention at the last slot of a cache of `cache_len` positions (so every path
reads the whole cache), output in bf16 or quantized to FP8 per token for the wo GEMM. Stock: rotary +
index_copy_ into the cache + SDPA with the position mask (decode_attention_reference), eager and
torch.compile'd; for FP8 followed by kernels.fp8.quantize_per_token, as the FP8 block ran it before.
Ours with programmatic dependent launch (as served) and without. floor_us: the layer's KV bytes over
the measured copy bandwidth (serve.memory_bandwidth: bytes read plus written per second). Caches,
q/k/v and positions are rotated among copies that together exceed the L2 cache, so every call reads
the cache from HBM. --sweep also times ours (bf16 out) at every (BLOCK_N, MIN_POSITIONS_PER_SPLIT,
SPLIT_PROGRAMS_PER_SM) of SWEEP (decode_attention_sweep-<device>), to choose kernels/decode_attention.py's
constants by.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.common import time_graph, write_results
from kernels import decode_attention as da
from kernels import fp8
from kernels.fp8 import quantize_per_token

HEADS = {"llama3_8b": (32, 8, 128), "llama3_70b": (64, 8, 128)}
BATCHES = [1, 8]
CACHE_LENS = [640, 4096, 32768]
ROTATE_BYTES = 256 << 20  # several times the 50-60 MB L2
# (BLOCK_N, MIN_POSITIONS_PER_SPLIT, SPLIT_PROGRAMS_PER_SM) settings --sweep times ours at.
SWEEP = list(itertools.product([32, 64], [32, 64, 128], [1, 2, 4]))


def rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs the next of `fns` on each call: captured into a graph, each captured call
    reads a different copy."""
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()

    return call


def time_us(fns: list[Callable[[], object]], device: torch.device) -> float:
    """Median microseconds per call: CUDA-graph replays on a GPU, wall clock elsewhere (smoke runs)."""
    call = rotating(fns)
    if device.type == "cuda":
        return time_graph(call, calls_per_graph=max(20, len(fns)), replays=20) * 1e3
    call()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second by a large device copy."""
    if device.type == "cuda":
        from serve import memory_bandwidth

        return memory_bandwidth(device)
    src = torch.empty(1 << 24, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return 2 * src.numel() / (time.perf_counter() - start)


def operand_sets(
    batch: int, n_heads: int, n_kv_heads: int, head_dim: int, cache_len: int, device, copies: int
):
    """`copies` independent argument tuples of decode_attention: q, k, v as column slices of one qkv
    output (as the FP8 block passes them), the rotary table, the position (the cache's last slot) and
    the caches."""
    sets = []
    rope = torch.randn(cache_len, head_dim // 2, 2, device=device)
    for _ in range(copies):
        qkv = torch.randn(
            batch, 1, (n_heads + 2 * n_kv_heads) * head_dim, device=device, dtype=torch.bfloat16
        )
        q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
        shape = (batch, n_kv_heads, cache_len, head_dim)
        caches = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(2)]
        sets.append((q, k, v, rope, torch.tensor([cache_len - 1], device=device), *caches))
    return sets


def stock_fp8(attend: Callable[..., torch.Tensor], *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = attend(*args)
    return quantize_per_token(out.view(out.shape[0], -1))


Shapes = dict[str, tuple[int, int, int]]  # model name -> (query heads, kv heads, head dim)


def cases(heads: Shapes, batches: list[int], cache_lens: list[int], device: torch.device):
    """(model, batch, cache length, heads, KV bytes, operand sets) of every shape, operands rotated."""
    for model, batch, cache_len in ((m, b, c) for m in heads for b in batches for c in cache_lens):
        n_heads, n_kv_heads, head_dim = heads[model]
        kv_bytes = 2 * batch * n_kv_heads * cache_len * head_dim * 2
        copies = max(2, -(-ROTATE_BYTES // kv_bytes)) if device.type == "cuda" else 1
        sets = operand_sets(batch, n_heads, n_kv_heads, head_dim, cache_len, device, copies)
        yield model, batch, cache_len, heads[model], kv_bytes, sets


def splits_of(batch: int, cache_len: int, heads: tuple[int, int, int], device: torch.device) -> int:
    n_heads, n_kv_heads, head_dim = heads
    return da.num_splits(batch, n_kv_heads, n_heads // n_kv_heads, head_dim, cache_len, device)


def bench(
    heads: Shapes, batches: list[int], cache_lens: list[int], device: torch.device
) -> list[dict[str, object]]:
    """Rows of the table for every (model's heads, batch, cache length) and output dtype."""
    bandwidth = copy_bandwidth(device)
    compiled = torch.compile(da.decode_attention_reference, dynamic=False, fullgraph=True)
    rows = []
    for model, batch, cache_len, shape, kv_bytes, sets in cases(heads, batches, cache_lens, device):
        for out in ("bf16", "fp8"):
            ours_fn = partial(da.decode_attention, fp8=out == "fp8")
            stock_eager = da.decode_attention_reference
            stock_compiled = compiled
            if out == "fp8":
                stock_eager, stock_compiled = partial(stock_fp8, stock_eager), partial(stock_fp8, compiled)
            timings, served = {}, fp8.USE_PDL
            for pdl in (True, False):
                fp8.USE_PDL = pdl
                timings[pdl] = time_us([partial(ours_fn, *s) for s in sets], device)
            fp8.USE_PDL = served
            eager = time_us([partial(stock_eager, *s) for s in sets], device)
            comp = time_us([partial(stock_compiled, *s) for s in sets], device)
            floor = kv_bytes / bandwidth * 1e6
            rows.append(
                {
                    "model": model,
                    "batch": batch,
                    "cache_len": cache_len,
                    "out": out,
                    "splits": splits_of(batch, cache_len, shape, device),
                    "ours_us": timings[True],
                    "ours_no_pdl_us": timings[False],
                    "eager_us": eager,
                    "compile_us": comp,
                    "floor_us": floor,
                    "ours_TBps": kv_bytes / timings[True] / 1e6,
                    "ours_of_floor": floor / timings[True],
                    "speedup_vs_compile": comp / timings[True],
                }
            )
            print(rows[-1], flush=True)
    return rows


def sweep(
    heads: Shapes,
    batches: list[int],
    cache_lens: list[int],
    device: torch.device,
    settings: list[tuple[int, int, int]],
) -> list[dict[str, object]]:
    """Ours (bf16 out, as served) at each (BLOCK_N, MIN_POSITIONS_PER_SPLIT, SPLIT_PROGRAMS_PER_SM)."""
    bandwidth = copy_bandwidth(device)
    served = da.BLOCK_N, da.MIN_POSITIONS_PER_SPLIT, da.SPLIT_PROGRAMS_PER_SM
    rows = []
    try:
        for model, batch, cache_len, shape, kv_bytes, sets in cases(heads, batches, cache_lens, device):
            for block, min_positions, per_sm in settings:
                da.BLOCK_N, da.MIN_POSITIONS_PER_SPLIT, da.SPLIT_PROGRAMS_PER_SM = (
                    block,
                    min_positions,
                    per_sm,
                )
                us = time_us([partial(da.decode_attention, *s) for s in sets], device)
                rows.append(
                    {
                        "model": model,
                        "batch": batch,
                        "cache_len": cache_len,
                        "block_n": block,
                        "min_positions_per_split": min_positions,
                        "programs_per_sm": per_sm,
                        "splits": splits_of(batch, cache_len, shape, device),
                        "ours_us": us,
                        "ours_of_floor": kv_bytes / bandwidth * 1e6 / us,
                    }
                )
                print(rows[-1], flush=True)
    finally:
        da.BLOCK_N, da.MIN_POSITIONS_PER_SPLIT, da.SPLIT_PROGRAMS_PER_SM = served
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=sorted(HEADS), default=sorted(HEADS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=BATCHES)
    parser.add_argument("--cache-lens", nargs="+", type=int, default=CACHE_LENS)
    parser.add_argument(
        "--sweep", action="store_true", help="also time ours at every setting of SWEEP (a second table)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny shape on any device (the CPU through TRITON_INTERPRET=1), printed, not written",
    )
    opts = parser.parse_args(argv)
    torch._dynamo.config.recompile_limit = 64  # one compiled stock path per shape
    if opts.smoke:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if not da.fused_decode_supported(device, torch.bfloat16, 16):
            raise SystemExit("--smoke on the CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
        tiny = {"tiny": (4, 2, 16)}
        rows = bench(tiny, [2], [64], device)
        return rows + (sweep(tiny, [2], [64], device, [(16, 8, 2), (32, 64, 1)]) if opts.sweep else [])
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention.py needs a CUDA GPU (--smoke runs anywhere)")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = bench({m: HEADS[m] for m in opts.models}, opts.batch_sizes, opts.cache_lens, device)
    note = (
        "one layer at the last slot of the cache; CUDA-graph replays, caches rotated beyond L2; ours_us "
        "with programmatic dependent launch (as served), ours_no_pdl_us launched plainly; stock = rotary + "
        "index_copy_ + SDPA with the position mask (+ quantize_per_token for fp8), eager and "
        "torch.compile'd; floor_us = KV bytes / measured copy bandwidth"
    )
    write_results("decode_attention", rows, notes=note)
    if opts.sweep:
        settings = sweep({m: HEADS[m] for m in opts.models}, opts.batch_sizes, opts.cache_lens, device, SWEEP)
        write_results("decode_attention_sweep", settings, notes=note)
    return rows


if __name__ == "__main__":
    main()
