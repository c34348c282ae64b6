"""Command-line arguments of the benchmarks that a CPU can check."""

import argparse

import pytest

from benchmarks.bench_fp8 import shape_arg


def test_tune_shapes_parse_and_reject_clearly() -> None:
    assert shape_arg("4096x14336") == (4096, 14336)
    assert shape_arg("8192X8192") == (8192, 8192)
    for bad in ("8192by8192", "8192x", "x4096", "0x4096", "-1x8", "4096x14336x2"):
        with pytest.raises(argparse.ArgumentTypeError, match="NxK"):
            shape_arg(bad)
