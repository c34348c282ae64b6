"""Command-line arguments of the benchmarks, and the smoke runs, that a CPU can check."""

import argparse

import pytest
import torch

from benchmarks import bench_decode_attention
from benchmarks.bench_fp8 import shape_arg


def test_tune_shapes_parse_and_reject_clearly() -> None:
    assert shape_arg("4096x14336") == (4096, 14336)
    assert shape_arg("8192X8192") == (8192, 8192)
    for bad in ("8192by8192", "8192x", "x4096", "0x4096", "-1x8", "4096x14336x2"):
        with pytest.raises(argparse.ArgumentTypeError, match="NxK"):
            shape_arg(bad)


def test_decode_attention_benchmark_smoke_run() -> None:
    """--smoke runs every path of the benchmark (ours with and without PDL, stock eager and compiled,
    bf16 and FP8 outputs) at one tiny shape, on CPU through the interpreter."""
    rows = bench_decode_attention.main(["--smoke"])
    assert [row["out"] for row in rows] == ["bf16", "fp8"]
    for row in rows:
        for key in ("ours_us", "ours_no_pdl_us", "eager_us", "compile_us", "floor_us"):
            assert row[key] > 0 and torch.isfinite(torch.tensor(row[key])), (key, row)


def test_bf16_gemm_benchmark_shapes_come_from_the_presets() -> None:
    """bench_bf16_gemm times the fused weights serve.py's bf16 decode path reads, per preset."""
    from benchmarks.bench_bf16_gemm import decode_gemms

    layers, gemms = decode_gemms("llama3_8b")
    assert layers == 32
    assert gemms == [
        ("wqkv", 6144, 4096),
        ("wo", 4096, 4096),
        ("w13", 28672, 4096),
        ("w2", 4096, 14336),
        ("output", 128256, 4096),
    ]
    assert decode_gemms("llama3_70b")[1][2] == ("w13", 57344, 8192)
