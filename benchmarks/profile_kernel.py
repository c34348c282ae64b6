r"""One of weft's kernels called a few times on fresh random operands, for a profiler to catch.

    S="--clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats
       --section Occupancy --section LaunchStats"
    ncu $S -k regex:decode_attention --launch-skip 3 --launch-count 1 \
        python -m benchmarks.profile_kernel attention --batch 8 --cache-len 640
    ncu $S -k "regex:matmul_rs|nvjet|gemm" --launch-skip 3 --launch-count 3 \
        python -m benchmarks.profile_kernel matmul-rs --shape 4096 4096 7168
    ncu $S -k regex:skinny --launch-skip 3 --launch-count 1 \
        python -m benchmarks.profile_kernel fp8-gemm --shape 1 28672 4096

Each subcommand runs its kernel --calls times (the first call compiles it: skip at least one launch):
* attention: decode_attention at the last slot of a cache of --cache-len positions (--heads: query
  heads, kv heads, head dim; Llama-3-8B's by default), bf16 or FP8 output;
* matmul-rs: the GEMM of matmul-reduce-scatter's call of rank --rank of --world with the communication
  taken out (kernels.matmul_rs.GemmAlone: its stage and own launches), then torch.matmul on the same
  operands (cuBLAS), each call;
* fp8-gemm: skinny_fp8_gemm of per-token quantized activations [M, K] and a per-channel quantized
  weight [N, K].
For the stall samples of each instruction add `--section SourceCounters -o report`, then
`ncu -i report.ncu-rep --page source --csv --print-source sass`. ncu runs each kernel alone with the
caches flushed, so nothing overlaps it as programmatic dependent launch does in the decode step. The
profiles quoted in matmul_rs_gemm-h100.md, decode_attention-h100.md and decode_tune-llama3_8b-h100.md
were taken this way. Without a GPU (or with --device cpu) it runs only under TRITON_INTERPRET=1, as a
smoke run.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_decode_attention import operand_sets
from benchmarks.common import positive
from kernels import decode_attention as da
from kernels import matmul_rs as mrs
from kernels.fp8 import INTERPRETED, quantize_per_token, quantize_weight_per_channel
from kernels.fp8_gemm import skinny_fp8_gemm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=positive, default=6, help="calls of the kernel (the first compiles)")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu: a smoke run through the interpreter (TRITON_INTERPRET=1)",
    )
    kernels = parser.add_subparsers(dest="kernel", required=True)
    attention = kernels.add_parser("attention", help="kernels/decode_attention.py")
    attention.add_argument("--batch", type=positive, default=8)
    attention.add_argument("--cache-len", type=positive, default=640)
    attention.add_argument(
        "--heads", type=positive, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D")
    )
    attention.add_argument("--out", choices=["bf16", "fp8"], default="fp8")
    rs = kernels.add_parser("matmul-rs", help="kernels/matmul_rs.py's GEMM alone, then cuBLAS")
    rs.add_argument("--shape", type=positive, nargs=3, default=[4096, 4096, 7168], metavar=("M", "K", "N"))
    rs.add_argument("--world", type=positive, default=4)
    rs.add_argument("--rank", type=int, default=0)
    gemm = kernels.add_parser("fp8-gemm", help="kernels/fp8_gemm.py's skinny GEMM")
    gemm.add_argument("--shape", type=positive, nargs=3, default=[1, 28672, 4096], metavar=("M", "N", "K"))
    return parser.parse_args(argv)


def attention(args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    n_heads, n_kv_heads, head_dim = args.heads
    if n_heads % n_kv_heads:
        raise SystemExit(f"--heads: {n_heads} query heads do not share {n_kv_heads} kv heads evenly")
    operands = operand_sets(args.batch, n_heads, n_kv_heads, head_dim, args.cache_len, device, 1)[0]
    for _ in range(args.calls):
        out = da.decode_attention(*operands, fp8=args.out == "fp8")
    return out[0] if isinstance(out, tuple) else out


def matmul_rs(args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    m, k, n = args.shape
    # bf16 as served; the interpreter (a CPU smoke run) reads no bf16 through tensor descriptors.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    a = torch.randn(m, k, device=device, dtype=dtype)
    weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    b = weight.t()  # as the model passes an nn.Linear weight
    # On the CPU (a smoke run) there is no SM count to read: 4 programs.
    alone = mrs.GemmAlone(a, b, 0, args.rank, args.world, num_sms=None if device.type == "cuda" else 4)
    for _ in range(args.calls):
        out = alone.run()
        torch.matmul(a, b)
    return out


def fp8_gemm(args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    m, n, k = args.shape
    w, w_scale = quantize_weight_per_channel(torch.randn(n, k, device=device, dtype=torch.bfloat16))
    x, x_scale = quantize_per_token(torch.randn(m, k, device=device, dtype=torch.bfloat16))
    for _ in range(args.calls):
        out = skinny_fp8_gemm(x, x_scale, w, w_scale)
    return out


KERNELS = {"attention": attention, "matmul-rs": matmul_rs, "fp8-gemm": fp8_gemm}


def main(argv: list[str] | None = None) -> torch.Tensor:
    """Runs the kernel; returns its last output."""
    args = parse_args(argv)
    if args.device == "cpu" and not INTERPRETED:
        raise SystemExit(
            "profile_kernel runs on the CPU only through the interpreter: set TRITON_INTERPRET=1"
        )
    device = torch.device(args.device)
    torch.manual_seed(0)
    try:
        out = KERNELS[args.kernel](args, device)
    except ValueError as err:  # the kernels' own checks of a shape or layout they do not take
        raise SystemExit(f"{args.kernel}: {err}") from None
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"{args.kernel}: {args.calls} calls, output {tuple(out.shape)} {out.dtype}", flush=True)
    return out


if __name__ == "__main__":
    main()
