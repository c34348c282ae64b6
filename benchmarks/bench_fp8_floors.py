"""How fast can the bytes of each FP8 benchmark shape move at all? Floors beside our kernels.

    python -m benchmarks.bench_fp8_floors      # one GPU; writes fp8_floors-<device>.{json,md}

A floor is the fastest of several plain streaming kernels that move exactly the bytes of one call
of ours and do nothing else, timed the same way (bench_fp8: CUDA-graph replays of back-to-back
calls, inputs rotated past L2, programmatic dependent launch):

- GEMM N x K: read the N*K weight bytes (a grid of blocks, each reduces its words to one), issued
  before the PDL wait, as a kernel may read weights (no earlier kernel writes them);
- norm rows x 16384: read x and residual (bf16), write a new residual (bf16) and an e4m3 output,
  element by element with no row reduction;
- SwiGLU rows x 14336: read gate and up (bf16), write e4m3, element by element.

The norm and SwiGLU floors read after the wait, since their inputs are the previous kernel's output.
Where a floor sits under a bandwidth bar, no kernel timed this way is likely to meet that bar at
that shape: the per-call costs (DRAM latency before the first bytes land, the drain of the last writes
before the next call may start) are the same for every kernel.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.bench_fp8 import GEMM_NK, copies_for, gemm_operands, norm_sets, time_us
from benchmarks.common import write_results
from kernels import fp8_gemm as gemm
from kernels.fp8 import FP8, launch_options, pdl_for, pdl_wait
from kernels.fp8_norm import add_rmsnorm_fp8
from kernels.fp8_swiglu import swiglu_fp8

BAR_TBPS = 3.6
ROWS = [256, 1024, 2048]
NORM_HIDDEN, SWIGLU_HIDDEN = 16384, 14336
BLOCKS = [2048, 8192, 32768]
WARPS = [4, 8, 16]


@triton.jit
def read_kernel(src_ptr, sink_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(src_ptr + offs, mask=offs < n, other=0)
    pdl_wait(PDL, False)
    tl.store(sink_ptr + tl.program_id(0), tl.xor_sum(words, axis=0))


@triton.jit
def _norm_bytes_kernel(x_ptr, res_ptr, res_out_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL, False)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(x_ptr + offs, mask=mask).to(tl.float32) + tl.load(res_ptr + offs, mask=mask).to(tl.float32)
    tl.store(res_out_ptr + offs, h.to(tl.bfloat16), mask=mask)
    tl.store(out_ptr + offs, tl.clamp(h, -448.0, 448.0).to(tl.float8e4nv), mask=mask)


@triton.jit
def _swiglu_bytes_kernel(x_ptr, out_ptr, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL, False)
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    gate = tl.load(x_ptr + row * 2 * H + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * H + H + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * H + cols, tl.clamp(gate * up, -448.0, 448.0).to(tl.float8e4nv), mask=mask)


Floor = tuple[float, int, int]  # (us, BLOCK, num_warps) of the fastest streaming kernel


def fastest(make: Callable[[int, int], list[Callable[[], object]]]) -> Floor:
    """The fastest (BLOCK, num_warps) for calls built by make(block, warps), with its time."""
    return min(
        (time_us(make(block, warps)), block, warps) for block, warps in itertools.product(BLOCKS, WARPS)
    )


def launch(kernel, grid: tuple[int, ...], *args, block: int, warps: int) -> None:
    device = args[0].device
    kernel[grid](*args, BLOCK=block, PDL=pdl_for(device), num_warps=warps, **launch_options(device))


def read_floor(weights: list[torch.Tensor]) -> Floor:
    words = [w.view(torch.int32).reshape(-1) for w in weights]
    n = words[0].numel()
    sinks = {block: torch.empty(triton.cdiv(n, block), dtype=torch.int32, device="cuda") for block in BLOCKS}
    return fastest(
        lambda block, warps: [
            partial(
                launch, read_kernel, (triton.cdiv(n, block),), w, sinks[block], n, block=block, warps=warps
            )
            for w in words
        ]
    )


def norm_floor(sets: list[tuple[torch.Tensor, ...]]) -> Floor:
    n = sets[0][0].numel()
    outs = [(torch.empty_like(x), torch.empty(n, dtype=FP8, device="cuda")) for x, _, _ in sets]
    return fastest(
        lambda block, warps: [
            partial(
                launch, _norm_bytes_kernel, (triton.cdiv(n, block),), x, r, ro, o, n, block=block, warps=warps
            )
            for (x, r, _), (ro, o) in zip(sets, outs, strict=True)
        ]
    )


def swiglu_floor(inputs: list[torch.Tensor]) -> Floor:
    rows, hidden = inputs[0].shape[0], inputs[0].shape[1] // 2
    outs = [torch.empty(rows, hidden, dtype=FP8, device="cuda") for _ in inputs]
    return fastest(
        lambda block, warps: [
            partial(
                launch,
                _swiglu_bytes_kernel,
                (triton.cdiv(hidden, block), rows),
                x,
                o,
                hidden,
                block=block,
                warps=warps,
            )
            for x, o in zip(inputs, outs, strict=True)
        ]
    )


def result(op: str, shape: str, nbytes: int, floor: Floor, ours_us: float) -> dict[str, object]:
    floor_us, block, warps = floor
    row = {
        "op": op,
        "shape": shape,
        "MB": nbytes / 1e6,
        "floor_us": floor_us,
        "floor_TBps": nbytes / floor_us / 1e6,
        "ours_us": ours_us,
        "ours_TBps": nbytes / ours_us / 1e6,
        "ours_over_floor": ours_us / floor_us,
        "floor_meets_bar": nbytes / floor_us / 1e6 >= BAR_TBPS,
        "floor_config": f"BLOCK={block}, num_warps={warps}",
    }
    print(row, flush=True)
    return row


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # no options: --help, and a clear error for any argument
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench_fp8_floors.py needs a Hopper (or newer) GPU: its kernels launch with PDL")
    rows_out = []
    for n, k in GEMM_NK:
        a, a_scale, weights = gemm_operands(16, n, k)
        floor = read_floor([b for b, _ in weights])
        for m in (1, 16):
            ours = time_us([partial(gemm.fp8_gemm, a[:m], a_scale[:m], b, s) for b, s in weights])
            rows_out.append(result("gemm (weight reads)", f"M={m} N={n} K={k}", n * k, floor, ours))
        del weights
    for rows in ROWS:
        sets = norm_sets(rows, NORM_HIDDEN)
        ours = time_us([partial(add_rmsnorm_fp8, x, r, w, 1e-5, None) for x, r, w in sets])
        nbytes = rows * NORM_HIDDEN * 7 + rows * 4
        rows_out.append(result("add+rmsnorm+fp8", f"{rows} x {NORM_HIDDEN}", nbytes, norm_floor(sets), ours))
        del sets
        inputs = [
            torch.randn(rows, 2 * SWIGLU_HIDDEN, device="cuda", dtype=torch.bfloat16)
            for _ in range(copies_for(rows * SWIGLU_HIDDEN * 5))
        ]
        ours = time_us([partial(swiglu_fp8, x, None) for x in inputs])
        nbytes = rows * SWIGLU_HIDDEN * 5 + rows * 4
        rows_out.append(result("swiglu+fp8", f"{rows} x {SWIGLU_HIDDEN}", nbytes, swiglu_floor(inputs), ours))
        del inputs
    write_results(
        "fp8_floors",
        rows_out,
        notes=(
            "floor: the fastest plain streaming kernel moving the same bytes (BLOCK x num_warps swept), "
            "ours: weft's kernel at the shape; both CUDA-graph replays of back-to-back calls with PDL, "
            f"inputs rotated past L2; floor_meets_bar: floor >= {BAR_TBPS} TB/s"
        ),
    )


if __name__ == "__main__":
    main()
