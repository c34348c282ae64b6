"""FP8 (e4m3) conventions shared by weft's FP8 kernels, their references, and a per-token quantize
kernel.

Scales follow one rule everywhere: `scale = amax / 448`, `q = clamp(x / scale, -448, 448)` cast to
e4m3, and `x ≈ q * scale`. Activations get a scale per token (row), per token and group of K (the
decode attention's output: one per kv head's slice of the row) or one static scale; weights get a scale
per output channel (row of the [N, K] weight) or one per tensor.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.symm_mem import sm_count

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Triton 3.6's interpreter casts fp32 to bf16 by truncation and to fp8 without carrying a rounded-up
# mantissa into the exponent (126.8 becomes 64): under it, kernels first snap values onto the target
# grid (round to nearest) so that its cast is exact. Compiled kernels cast natively.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MIN_SCALE = 1e-12

# Programmatic dependent launch (PDL, Hopper and newer). Every FP8 kernel here is launched so that it
# may start while the kernel before it in the stream is still running: it loads what no earlier kernel
# writes (the norm weight, the first tiles of a GEMM weight) at once, then waits (`griddepcontrol.wait`:
# the previous grid complete and its writes visible) before touching anything else, and lets the next
# kernel launch (before or after that wait: pdl_wait). Inside a CUDA graph this hides most of the
# launch gap between dependent kernels. Contract: a tensor read before the wait (weights) must not
# be written by the kernel that immediately precedes the call. Set to False to launch plainly
# (bench_fp8 times both).
USE_PDL = os.environ.get("WEFT_FP8_PDL", "1") != "0"


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_for(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (USE_PDL, compiled, compute capability >= 9.0)."""
    if not USE_PDL or INTERPRETED or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def launch_options(device: torch.device) -> dict[str, object]:
    """Extra launch keyword arguments: `launch_pdl` where PDL is on (the interpreter takes none)."""
    return {"launch_pdl": True} if pdl_for(device) else {}


def programs_cap(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (persistent grids); a small number elsewhere."""
    if device.type != "cuda":
        return 4
    return sm_count(device)


@triton.jit
def pdl_wait(PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr):
    """Wait for the previous kernel (its writes visible) and let the next one launch: before the
    wait with EARLY_TRIGGER, else after it; the next kernel's own wait covers this kernel's writes
    either way.

    An early trigger lets the next kernel's programs take free SM slots and load their weights while
    this one runs, but each of those may trigger early too, so a chain of kernels can park programs on
    SMs that the running one needs. Measured on H200 with back-to-back calls in a CUDA graph: the norm
    (which loads its weight before the wait) gains with it (1 row of 16384: 3.03 -> 2.95 us, 64 rows
    4.29 -> 4.18); SwiGLU (nothing to load before its wait) loses (64 rows of 14336: 3.39 -> 4.65 us);
    the GEMM is unchanged. So only the norm triggers early."""
    if PDL:
        if EARLY_TRIGGER:
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()


@triton.jit
def snap_to_e4m3(x):
    """Round fp32 values (|x| <= 448) to the nearest e4m3 value, in fp32 arithmetic."""
    a = tl.abs(x)
    exponent = tl.floor(tl.log2(tl.maximum(a, 0.015625)))  # 2^-6: subnormals share its spacing
    step = tl.exp2(exponent - 3.0)
    snapped = tl.floor(a / step + 0.5) * step
    return tl.where(x < 0, -snapped, snapped)


@triton.jit
def downcast(x, dtype: tl.constexpr, SNAP: tl.constexpr):
    """fp32 -> `dtype`, rounding to nearest even (by bit arithmetic for bf16 when SNAP is set)."""
    if SNAP and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def to_fp8(y, inv_scale, SNAP: tl.constexpr):
    """fp32 values times 1/scale, clamped to the e4m3 range, as e4m3."""
    q = tl.clamp(y * inv_scale, -448.0, 448.0)
    if SNAP:
        q = snap_to_e4m3(q)
    return q.to(tl.float8e4nv)


@triton.jit
def static_inv_scale(scale_ptr, QUANT: tl.constexpr):
    """1 / the static scale at scale_ptr (QUANT 1), loaded once at a kernel's start; else 1."""
    if QUANT == 1:
        return 1.0 / tl.load(scale_ptr)
    else:
        return 1.0


@triton.jit
def store_row(
    y, out_ptr, row, stride_o, cols, mask, scale_ptr, inv_static, QUANT: tl.constexpr, SNAP: tl.constexpr
):
    """Write one fp32 row: as out_ptr's dtype (QUANT 0), or as e4m3 with the static scale
    (QUANT 1, `inv_static` = 1 / scale) or a per-row scale amax / 448 stored at scale_ptr[row] (QUANT 2)."""
    out_ptrs = out_ptr + row * stride_o + cols
    if QUANT == 0:
        tl.store(out_ptrs, downcast(y, out_ptr.dtype.element_ty, SNAP), mask=mask)
    elif QUANT == 1:
        tl.store(out_ptrs, to_fp8(y, inv_static, SNAP), mask=mask)
    else:
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12 * 448.0) / 448.0
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptrs, to_fp8(y, 1.0 / scale, SNAP), mask=mask)


def check_static_scale(scale: torch.Tensor) -> None:
    """A static activation scale is one number for the whole tensor: the kernels read its first element
    only, so per-row scales passed as one would quantize every row with row 0's."""
    if scale.numel() != 1:
        raise ValueError(
            f"a static scale is one number per tensor, got shape {tuple(scale.shape)}: pass None for "
            "scales per row"
        )


def quantize_reference(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 values, fp32 scales [...]): one scale per row, or the given static scale."""
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax(dim=-1).clamp(min=MIN_SCALE * FP8_MAX) / FP8_MAX).float()
        q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q, scale
    return (xf / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.float()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 values [..., K] times their per-row [...], per-group [..., G] (each row in G groups of K / G
    elements) or per-tensor scale, in fp32."""
    scale = scale.float()
    if scale.numel() == 1:
        return q.float() * scale
    if scale.dim() == q.dim():
        return (q.float().unflatten(-1, (scale.shape[-1], -1)) * scale.unsqueeze(-1)).flatten(-2)
    return q.float() * scale.unsqueeze(-1)


def quantize_weight_per_channel(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight [N, K] -> e4m3 [N, K] and fp32 scales [N], one per output channel. `amax` [N]:
    the channels' largest magnitudes over the full weight when `weight` is a shard of its K (row
    parallelism), so that the shards quantize as the unsplit weight does."""
    if amax is None:
        return quantize_reference(weight)
    scale = (amax.float().clamp(min=MIN_SCALE * FP8_MAX) / FP8_MAX).float()
    return (weight.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    K,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    SNAP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL, False)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    store_row(x, out_ptr, row, stride_o, cols, mask, scale_ptr, 1.0, QUANT=2, SNAP=SNAP)


# Elements of a row each warp holds in the row kernels (sets num_warps; bench_fp8 --sweep-rows). The
# norm's one-program-per-row launch does better with 1024 (16 warps: 3.05 vs 3.30 us at 1 row of
# 16384 on H200, 10.8 vs 11.2 us at 256 rows); its persistent launch and SwiGLU with 512.
ELEMENTS_PER_WARP = 512
NORM_ELEMENTS_PER_WARP = 1024


def row_launch(n_cols: int, per_warp: int | None = None) -> tuple[int, int]:
    """(BLOCK, num_warps) for kernels that keep one whole row in registers, up to 32 warps, with
    `per_warp` (default ELEMENTS_PER_WARP) elements of the row per warp."""
    if n_cols < 1:
        raise ValueError(f"rows must have at least one element, got rows of {n_cols} elements")
    block = triton.next_power_of_2(n_cols)
    if block > 65536:
        raise ValueError(
            f"rows of {n_cols} elements exceed the 65536 these FP8 row kernels hold in registers"
        )
    return block, max(1, min(32, block // (per_warp or ELEMENTS_PER_WARP)))


# Many rows: one program per SM loops over the rows and issues the loads of its next row before it
# reduces and writes the current one, so HBM reads never pause for a row's reduction or a program's
# launch. Taken when there are more than PERSISTENT_ROWS_PER_SM rows per SM (the norm:
# NORM_PERSISTENT_ROWS_PER_SM); fewer rows get one program per row (the shortest latency at decode).
# A program keeps whole rows in registers: for rows of 16384 a norm program is 32 warps of 64
# registers (ptxas, sm_90), a whole register file, so a second program on an SM could only start when
# the first ends. On H200 two SwiGLU programs per SM cost 3.42 -> 3.26 TB/s at 1024 rows.
PERSISTENT_ROWS_PER_SM = 2
NORM_PERSISTENT_ROWS_PER_SM = 4


def row_grid(rows: int, device: torch.device, min_rows_per_sm: int | None = None) -> tuple[int, bool]:
    """(programs, persistent) for a row kernel over `rows` rows: one program per SM when there are
    more than `min_rows_per_sm` (default PERSISTENT_ROWS_PER_SM) rows per SM, else one per row."""
    sms = programs_cap(device)
    if rows > sms * (min_rows_per_sm or PERSISTENT_ROWS_PER_SM):
        return sms, True
    return max(rows, 1), False


@torch.library.custom_op("weft::quantize_per_token", mutates_args=())
def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32) -> e4m3 [M, K] and fp32 per-row scales [M]."""
    _check_rows(x)
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    block, warps = row_launch(x.shape[1])
    _quantize_rows_kernel[(x.shape[0],)](
        x,
        out,
        scale,
        x.shape[1],
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        SNAP=INTERPRETED,
        PDL=pdl_for(x.device),
        num_warps=warps,
        **launch_options(x.device),
    )
    return out, scale


def check_one_device(**tensors: torch.Tensor | None) -> None:
    """ValueError unless every tensor given (None: absent) is on the first one's device. A call with a
    meta tensor among its inputs goes to an op's fake implementation, which returns uninitialized
    tensors on the other inputs' device: the ops check this in their fakes too (under torch.compile
    every fake tensor reports one device)."""
    given = {name: t for name, t in tensors.items() if t is not None}
    first, device = next((name, t.device) for name, t in given.items())
    elsewhere = [name for name, t in given.items() if t.device != device]
    if elsewhere:
        got = ", ".join(str(given[name].device) for name in elsewhere)
        raise ValueError(f"{', '.join(elsewhere)} must be on {first}'s device {device}, got {got}")


def _check_rows(x: torch.Tensor) -> None:
    """quantize_per_token's input check, also run by its fake implementation (meta or compiled calls)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"quantize_per_token takes a row-contiguous [M, K] tensor, got shape {tuple(x.shape)}"
        )


@quantize_per_token.register_fake
def _(x):
    _check_rows(x)
    return torch.empty(x.shape, dtype=FP8, device=x.device), x.new_empty(x.shape[0], dtype=torch.float32)
