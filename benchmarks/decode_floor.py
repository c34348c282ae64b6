"""The floor of a decode step built of one kernel per op: how close to the roofline can such a step get?

    python -m benchmarks.decode_floor --model llama3_8b --batch-sizes 1 8    # one Hopper GPU

Each kernel of serve.py's decode step (model/decode.py's structure) is replaced one for one by a plain
streaming kernel that moves exactly its bytes and does nothing else (bench_fp8_floors' kernels), in the
step's order and with programmatic dependent launch as served:
- a GEMM reads its weight (N * K bytes in e4m3, twice that in bf16), before the PDL wait, as weights are
  no earlier kernel's output;
- attention reads the batch's whole static KV cache (what the roofline counts), also before the wait, as
  earlier steps wrote it; its combine launch, where there is one, reads the fp32 partials after it;
- an add + RMSNorm reads the pending output and the residual and writes the residual and the normalized
  row, SwiGLU reads gate and up and writes their product, both after the wait.
Every layer has buffers of its own (nothing is served from L2 that a real step would read from DRAM).
The chain is one CUDA graph, timed by replays. No kernel doing the real work with this launch
structure can beat it, so roofline / floor is the most of the roofline such a step can reach.

Rows per (dtype, batch), by launch structure:
- "2-launch attention, SwiGLU kernel": per layer add+norm, qkv, attention split + combine, wo, add+norm,
  w13, SwiGLU, w2; then add+norm and the output projection (weft's step before decode attention ran
  in one launch);
- "1-launch attention, SwiGLU kernel": the combine folded into the attention kernel (weft's step as it
  runs);
- "1-launch attention, SwiGLU in w13": also no SwiGLU kernel;
- "GEMMs and attention only": every glue kernel gone (norms fused into the GEMMs as well);
- "one kernel": all the step's bytes read by one launch.

The roofline is bench_decode's: weights and KV cache over the measured copy bandwidth (serve.py), here
counted from the model's shapes (the norm weights and FP8 scales, under 0.1%, left out).
Writes benchmarks/results/decode_floor-<model>-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.bench_bf16_gemm import gemms_of, preset_args
from benchmarks.bench_fp8_floors import BLOCKS, WARPS, launch, read_floor, read_kernel
from benchmarks.common import add_decode_shape_args, time_graph, write_results
from kernels.decode_attention import num_splits
from kernels.fp8 import FP8, pdl_wait
from model.args import ModelArgs
from serve import memory_bandwidth

ROWS_BLOCK, ROWS_WARPS = 1024, 4  # the row kernels move a few KiB to a few hundred: latency-bound


@triton.jit
def _rows_kernel(
    a_ptr, b_ptr, out_ptr, out2_ptr, n, TWO_OUTPUTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """Reads a and b (the previous kernel's outputs), writes their sum to out (and out2)."""
    pdl_wait(PDL, False)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(a_ptr + offs, mask=mask).to(tl.float32) + tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)
    if TWO_OUTPUTS:
        tl.store(out2_ptr + offs, x.to(out2_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Op:
    """One kernel of the step: `reads` bytes before the PDL wait (weights, KV cache), or a row op."""

    name: str
    reads: int = 0  # bytes read before the wait
    rows: int = 0  # elements of each input of a row op (read after the wait)
    row_dtype: torch.dtype = torch.bfloat16  # its (first) output's dtype
    two_outputs: bool = False


def step_ops(
    args: ModelArgs, batch: int, cache_len: int, fp8: bool, structure: str, device: torch.device
) -> list[Op]:
    """The kernels of one decode step of `args` on `device` under launch `structure` (module
    docstring)."""
    weight_bytes = 1 if fp8 else 2
    act = FP8 if fp8 else torch.bfloat16
    kv = 2 * batch * args.n_kv_heads * cache_len * args.head_dim * 2
    group = args.n_heads // args.n_kv_heads
    splits = num_splits(batch, args.n_kv_heads, group, args.head_dim, cache_len, device)
    partials = batch * args.n_heads * splits * args.head_dim  # fp32 partial outputs of the splits
    glue = structure != "GEMMs and attention only"
    norm = Op("add+norm", rows=batch * args.dim, row_dtype=act, two_outputs=True)
    gemm = {name: Op(name, reads=n * k * weight_bytes) for name, n, k in gemms_of(args)}
    layer = [norm] if glue else []
    layer += [gemm["wqkv"], Op("attention", reads=kv)]
    if structure.startswith("2-launch"):
        layer.append(Op("attention combine", rows=partials))  # two bf16 inputs: the fp32 bytes
    layer.append(gemm["wo"])
    layer += [norm] if glue else []
    layer.append(gemm["w13"])
    if structure.endswith("SwiGLU kernel"):
        layer.append(Op("SwiGLU", rows=batch * args.ffn_hidden, row_dtype=act))
    layer.append(gemm["w2"])
    return layer * args.n_layers + ([norm] if glue else []) + [gemm["output"]]


def best_read_config(nbytes: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the fastest plain read of `nbytes`, timed alone (bench_fp8_floors)."""
    copies = max(2, -(-(1 << 30) // nbytes))
    words = [torch.empty(nbytes // 4, dtype=torch.int32, device="cuda") for _ in range(copies)]
    _, block, warps = read_floor(words)
    return block, warps


def chain(ops: list[Op], configs: dict[int, tuple[int, int]]) -> Callable[[], None]:
    """One callable launching a streaming kernel per op, each op on buffers of its own."""
    calls = []
    sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    for op in ops:
        if op.reads:
            n = op.reads // 4
            block, warps = configs[op.reads]
            src = torch.empty(n, dtype=torch.int32, device="cuda")
            calls.append(
                partial(launch, read_kernel, (triton.cdiv(n, block),), src, sink, n, block=block, warps=warps)
            )
        else:
            a, b = (torch.zeros(op.rows, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            out = torch.empty(op.rows, dtype=op.row_dtype, device="cuda")
            out2 = torch.empty(op.rows, dtype=torch.bfloat16, device="cuda")
            calls.append(
                partial(
                    launch, _rows_kernel, (triton.cdiv(op.rows, ROWS_BLOCK),), a, b, out, out2, op.rows,
                    op.two_outputs, block=ROWS_BLOCK, warps=ROWS_WARPS,
                )
            )  # fmt: skip

    def run() -> None:
        for call in calls:
            call()

    return run


STRUCTURES = [
    "2-launch attention, SwiGLU kernel",
    "1-launch attention, SwiGLU kernel",
    "1-launch attention, SwiGLU in w13",
    "GEMMs and attention only",
]


def floor_rows(
    args: ModelArgs, batch: int, cache_len: int, fp8: bool, bandwidth: float
) -> list[dict[str, object]]:
    """One row per launch structure (and one for a single read of every byte): the chain's time beside
    the roofline of the same bytes at `bandwidth` (bytes/s)."""
    ops = {s: step_ops(args, batch, cache_len, fp8, s, torch.device("cuda")) for s in STRUCTURES}
    read_bytes = sum(op.reads for op in ops[STRUCTURES[0]])
    configs = {size: best_read_config(size) for size in {op.reads for op in ops[STRUCTURES[0]] if op.reads}}
    roofline_us = read_bytes / bandwidth * 1e6
    timed = {
        s: (len(o), time_graph(chain(o, configs), calls_per_graph=2, replays=10) * 1e3)
        for s, o in ops.items()
    }
    n = read_bytes // 4
    words = torch.empty(n, dtype=torch.int32, device="cuda")
    sink = torch.empty(triton.cdiv(n, min(BLOCKS)), dtype=torch.int32, device="cuda")
    one = min(
        time_graph(
            partial(launch, read_kernel, (triton.cdiv(n, b),), words, sink, n, block=b, warps=w), 2, 10
        )
        for b in BLOCKS
        for w in WARPS
    )
    timed["one kernel"] = (1, one * 1e3)
    rows = []
    for structure, (kernels, floor_us) in timed.items():
        rows.append(
            {
                "dtype": "fp8" if fp8 else "bf16",
                "batch": batch,
                "structure": structure,
                "kernels": kernels,
                "floor_us": floor_us,
                "roofline_us": roofline_us,
                "max_of_roofline": roofline_us / floor_us,
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_decode_shape_args(parser, [1, 8])
    opts = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("decode_floor.py needs a Hopper (or newer) GPU: its kernels launch with PDL")
    args = preset_args(opts.model)
    cache_len = opts.prompt_len + opts.decode_steps
    bandwidth = memory_bandwidth(torch.device("cuda"))
    rows = []
    for fp8 in (False, True):
        for batch in opts.batch_sizes:
            rows += floor_rows(args, batch, cache_len, fp8, bandwidth)
            torch.cuda.empty_cache()
    write_results(
        f"decode_floor-{opts.model}",
        rows,
        notes=(
            f"`python -m benchmarks.decode_floor --model {opts.model} --batch-sizes "
            f"{' '.join(map(str, opts.batch_sizes))}`: cache {cache_len} positions; floor_us: the step's "
            "kernels replaced one for one by plain streaming kernels moving their bytes (module docstring), "
            "one CUDA graph with PDL; roofline_us: weights + KV cache over the copy bandwidth "
            f"({bandwidth / 1e12:.2f} TB/s); max_of_roofline: the most of the roofline a step of that launch "
            "structure can reach"
        ),
    )


if __name__ == "__main__":
    main()
