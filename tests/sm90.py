"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU, so that CPU tests can check
their PTX: that data moves in 16-byte vectors, flags are released and acquired at system scope, waits
are bounded, and shared memory fits.

Triton's interpreter (TRITON_INTERPRET=1, which the CPU test runs set) replaces @triton.jit, so a test
runs its checks in a child process without it:

    def test_kernel_compiles_for_sm90() -> None:
        run_without_interpreter("tests.test_matmul_rs")     # calls tests.test_matmul_rs.check_sm90_ptx()
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_SHARED_BYTES = 227 * 1024  # H100 / H200 shared memory per block


def compile_ptx(
    kernel,
    signature: dict[str, object],
    constexprs: dict[str, object],
    aligned: Iterable[str | tuple[str, int]] = (),
    **options: int,
) -> str:
    """PTX of `kernel` for sm_90 with the given argument types and constexpr values. `aligned` names the
    arguments (or (tuple argument, element)) a launch specializes as divisible by 16; `options` are
    launch options (num_warps, num_stages)."""
    return compile_sm90(kernel, signature, constexprs, aligned, **options).asm["ptx"]


def compile_sm90(
    kernel,
    signature: dict[str, object],
    constexprs: dict[str, object],
    aligned: Iterable[str | tuple[str, int]] = (),
    **options: int,
):
    """`kernel` compiled for sm_90 as compile_ptx does: `.asm["ptx"]`, `.metadata.shared` (bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    attrs = {
        (names.index(a),) if isinstance(a, str) else (names.index(a[0]), a[1]): [["tt.divisibility", 16]]
        for a in aligned
    }
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    shared = compiled.metadata.shared
    assert shared <= MAX_SHARED_BYTES, f"{kernel.__name__} {options}: {shared} bytes of shared memory"
    return compiled


def ptxas_log(ptx: str) -> str:
    """What Triton's ptxas reports (-v) assembling `ptx` for sm_90a, e.g. that it had to serialize the
    kernel's wgmma instructions."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "kernel.ptx")
        src.write_text(ptx)
        done = subprocess.run(
            [
                knobs.nvidia.ptxas.path,
                "-v",
                "--gpu-name=sm_90a",
                str(src),
                "-o",
                str(Path(tmp, "kernel.cubin")),
            ],
            capture_output=True,
            text=True,
        )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def spill_stores(log: str) -> int:
    """Bytes of spill stores in a `ptxas_log` (the sum over its functions)."""
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


def run_without_interpreter(module: str, function: str = "check_sm90_ptx") -> None:
    """Call `module.function()` in a child process without TRITON_INTERPRET; fail with its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from {module} import {function}; {function}()"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
