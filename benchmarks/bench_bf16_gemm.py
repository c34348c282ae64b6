"""The bf16 skinny GEMM (weft::bf16_gemm: kernels/fp8_gemm.py's kernel on bf16 operands) beside cuBLAS
(F.linear) at the decode GEMMs of Llama-3-8B and 70B, timed as CUDA-graph replays on one GPU.

    python -m benchmarks.bench_bf16_gemm                      # bf16_gemm-<device>.{json,md}
    python -m benchmarks.bench_bf16_gemm --models llama3_8b   # one model's shapes
    python -m benchmarks.bench_bf16_gemm --tune               # first tune tiles for this GPU's model

Shapes are the weights of serve.py's bf16 decode path (model/decode.py), N x K: [wq|wk|wv], wo, [w1|w3],
w2 and the output projection; M = 1, 8, 16 and 64 tokens. Weights are rotated among copies that together
exceed the L2 cache, so every call reads from HBM (bench_fp8). Beside each GEMM its floors: the roofline
(the weight bytes at the device's measured copy bandwidth, serve.memory_bandwidth, as serve.py's decode
roofline counts them) and the read floor (the fastest plain kernel reading the same bytes,
bench_fp8_floors). A "step" row per model and M sums its GEMMs over the layers plus the output
projection: the GEMM share of one decode step. --tune (long: many configs per shape) keeps the fastest
tiles in kernels/fp8_gemm_configs.json under "bf16," keys.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from benchmarks.bench_fp8 import bf16_operands, both_pdl, time_us, tune_gemm
from benchmarks.bench_fp8_floors import read_floor
from benchmarks.common import write_results
from kernels import fp8_gemm as gemm
from model.args import ModelArgs
from serve import memory_bandwidth

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MODELS = ["llama3_8b", "llama3_70b"]


def preset_args(preset: str) -> ModelArgs:
    """The ModelArgs of a model preset (configs/model/<preset>.yaml)."""
    preset_cfg = OmegaConf.load(CONFIGS / "model" / f"{preset}.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelArgs), preset_cfg))


def gemms_of(args: ModelArgs) -> list[tuple[str, int, int]]:
    """[(name, N, K)] of a model's decode GEMMs: the fused weights of a block, then the output
    projection."""
    heads_dim = args.n_heads * args.head_dim
    return [
        ("wqkv", heads_dim + 2 * args.n_kv_heads * args.head_dim, args.dim),
        ("wo", args.dim, heads_dim),
        ("w13", 2 * args.ffn_hidden, args.dim),
        ("w2", args.dim, args.ffn_hidden),
        ("output", args.vocab_size, args.dim),
    ]


def decode_gemms(preset: str) -> tuple[int, list[tuple[str, int, int]]]:
    """(layers, [(name, N, K)]) of a model preset's bf16 decode GEMMs (gemms_of)."""
    args = preset_args(preset)
    return args.n_layers, gemms_of(args)


M_VALUES = [1, 8, 16, 64]


def bench_model(model: str, bandwidth: float) -> list[dict[str, object]]:
    layers, gemms = decode_gemms(model)
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    step = {m: {"ours_us": 0.0, "linear_us": 0.0, "roofline_us": 0.0} for m in M_VALUES}
    for name, n, k in gemms:
        count = 1 if name == "output" else layers
        nbytes = 2 * n * k
        a, weights = bf16_operands(max(M_VALUES), n, k)
        floor_us, _, _ = read_floor(weights)
        roofline_us = nbytes / bandwidth * 1e6
        for m in M_VALUES:
            x = a[:m]
            ours, plain = both_pdl([partial(gemm.bf16_gemm, x, b) for b in weights])
            linear = time_us([partial(F.linear, x, b) for b in weights])
            rows.append(
                {
                    "model": model,
                    "gemm": name,
                    "M": m,
                    "N": n,
                    "K": k,
                    "ours_us": ours,
                    "ours_no_pdl_us": plain,
                    "linear_us": linear,
                    "speedup": linear / ours,
                    "ours_TBps": nbytes / ours / 1e6,
                    "linear_TBps": nbytes / linear / 1e6,
                    "roofline_us": roofline_us,
                    "read_floor_us": floor_us,
                    "ours_of_roofline": roofline_us / ours,
                    "linear_of_roofline": roofline_us / linear,
                    "ours_of_read_floor": floor_us / ours,
                    "config": str(gemm.config_for(m, n, k, device, torch.bfloat16)),
                }
            )
            print(rows[-1], flush=True)
            step[m]["ours_us"] += count * ours
            step[m]["linear_us"] += count * linear
            step[m]["roofline_us"] += count * roofline_us
        del a, weights
        torch.cuda.empty_cache()
    for m, total in step.items():
        rows.append(
            {
                "model": model,
                "gemm": f"step ({layers} layers + output)",
                "M": m,
                **total,
                "speedup": total["linear_us"] / total["ours_us"],
                "ours_of_roofline": total["roofline_us"] / total["ours_us"],
                "linear_of_roofline": total["roofline_us"] / total["linear_us"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    parser.add_argument(
        "--tune", action="store_true", help="tune the models' bf16 GEMM tiles first and save them"
    )
    opts = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench_bf16_gemm.py needs a Hopper (or newer) GPU: the read floor launches with PDL")
    note = (
        "CUDA-graph replays, weights rotated beyond L2; ours_us with programmatic dependent launch "
        "(kernels.fp8.USE_PDL, as served), ours_no_pdl_us launched plainly; linear: F.linear (cuBLAS); "
        "TB/s of weight reads; roofline: the weight bytes at the measured copy bandwidth; read floor: "
        "the fastest plain kernel reading them (bench_fp8_floors)"
    )
    if opts.tune:
        shapes = [(n, k) for model in opts.models for _, n, k in decode_gemms(model)[1]]
        log = tune_gemm([], torch.bfloat16, shapes)
        write_results("bf16_gemm_tune", log, notes="best 5 tile configs per shape, M bucket; " + note)
    bandwidth = memory_bandwidth(torch.device("cuda", torch.cuda.current_device()))
    rows = [row for model in opts.models for row in bench_model(model, bandwidth)]
    notes = f"{note}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; config: tuned, else heuristic_config"
    write_results("bf16_gemm", rows, notes=notes)


if __name__ == "__main__":
    main()
