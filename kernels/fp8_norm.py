"""Residual add + RMSNorm (+ FP8 quantize) in one pass over each row.

    residual' = residual + x                        (a new tensor, rounded to residual's dtype)
    y        =  residual * rsqrt(mean(residual^2) + eps) * weight
    out      =  e4m3(y / scale)   with a static scale, or a per-row scale = amax(|y|) / 448
                or y itself in bf16 for the bf16 decode path

A program holds a whole row in registers, so each element is read once and written once: 2 bytes
of x, 2 of residual in, 2 of residual out and 1 (or 2) of output per element. The mean square and
the row's amax come out of one reduction (amax |residual * weight| times rstd is amax |y|), so a
dynamic scale costs no second pass over the row's warps. Few rows: one program per row. Many rows:
one program per SM (kernels.fp8.row_grid) walks whole rounds of rows, loading row i+1 while it
finishes row i, and each row of the last, ragged round gets a program of its own.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import fp8
from kernels.fp8 import (
    FP8,
    INTERPRETED,
    check_one_device,
    check_static_scale,
    downcast,
    launch_options,
    pdl_for,
    pdl_wait,
    quantize_reference,
    row_grid,
    row_launch,
    static_inv_scale,
    to_fp8,
)

QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC = 0, 1, 2


@triton.jit
def _sum_and_max(s1, m1, s2, m2):
    return s1 + s2, tl.maximum(m1, m2)


@triton.jit
def _load_x(x_ptr, row, stride_x, stride_xs, cols, mask, X_SLICES: tl.constexpr, DT: tl.constexpr,
            SNAP: tl.constexpr):  # fmt: skip
    """Row `row` of x: loaded, or with X_SLICES the sum of its split-K partials (fp32, slice order)
    rounded to DT, as the GEMM that left them would have rounded it (kernels.fp8_gemm.fp8_gemm_partials)."""
    ptrs = x_ptr + tl.cast(row, tl.int64) * stride_x + cols
    if X_SLICES == 0:
        return tl.load(ptrs, mask=mask, other=0.0)
    if X_SLICES == 1:  # an unsplit GEMM rounds its sum as it is (a -0.0 stays -0.0)
        return downcast(tl.load(ptrs, mask=mask, other=0.0), DT, SNAP)
    # From zero, as the GEMM's last slice sums: bit for bit its output, signed zeros included.
    total = tl.zeros(cols.shape, tl.float32)
    for s in tl.static_range(X_SLICES):
        total += tl.load(ptrs + s * stride_xs, mask=mask, other=0.0)
    return downcast(total, DT, SNAP)


@triton.jit
def _norm_row(
    x,
    r,
    w,
    row,
    cols,
    mask,
    res_out_ptr,
    out_ptr,
    scale_ptr,
    inv_static,
    N,
    eps,
    stride_ro,
    stride_o,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    SNAP: tl.constexpr,
):
    """Finish one row from its loaded x and residual (`w` the fp32 weight)."""
    row = tl.cast(row, tl.int64)
    if HAS_RESIDUAL:
        h = x.to(tl.float32) + r.to(tl.float32)
        # Normalise the stored (rounded) residual, as the next layer will see it.
        h = downcast(h, res_out_ptr.dtype.element_ty, SNAP)
        tl.store(res_out_ptr + row * stride_ro + cols, h, mask=mask)
        h = h.to(tl.float32)
    else:
        h = x.to(tl.float32)
    out_ptrs = out_ptr + row * stride_o + cols
    if QUANT == 2:
        hw = h * w
        sum_sq, amax_hw = tl.reduce((h * h, tl.abs(hw)), 0, _sum_and_max)
        rstd = tl.rsqrt(sum_sq / N + eps)
        scale = tl.maximum(amax_hw * rstd, 1e-12 * 448.0) / 448.0
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptrs, to_fp8(h * rstd * w, 1.0 / scale, SNAP), mask=mask)
    else:
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        y = h * rstd * w
        if QUANT == 1:
            tl.store(out_ptrs, to_fp8(y, inv_static, SNAP), mask=mask)
        else:
            tl.store(out_ptrs, downcast(y, out_ptr.dtype.element_ty, SNAP), mask=mask)


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    n_walked,
    walkers,
    N,
    eps,
    stride_x,
    stride_xs,
    stride_r,
    stride_ro,
    stride_o,
    HAS_RESIDUAL: tl.constexpr,
    X_SLICES: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    PERSISTENT: tl.constexpr,
    SNAP: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    DT: tl.constexpr = res_out_ptr.dtype.element_ty  # x's dtype, or its partials' sum's
    if PERSISTENT:
        pdl_wait(PDL, True)
        inv_static = static_inv_scale(scale_ptr, QUANT)
        # The first `walkers` programs walk rows pid, pid + walkers, ... below n_walked; each program
        # after them takes one row of the last, ragged round. The hardware starts those on whichever
        # SMs free up first, so an SM that streamed slowly takes fewer of them (on H200, 1024 rows of
        # 16384: 33.05 -> 32.00 us against two walkers per SM and no one-row programs; fp8-notes.md).
        walker = pid < walkers
        first = tl.where(walker, pid, n_walked + pid - walkers)
        end = tl.where(walker, n_walked, first + 1)
        step = tl.where(walker, walkers, 1)
        x = _load_x(x_ptr, first, stride_x, stride_xs, cols, mask, X_SLICES, DT, SNAP)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + tl.cast(first, tl.int64) * stride_r + cols, mask=mask, other=0.0)
        else:
            r = x
        for row in range(first, end, step):
            # Issue the next row's loads first: they stream from HBM while this row is finished.
            nxt = tl.cast(row + step, tl.int64)
            more = mask & (nxt < end)
            x_next = _load_x(x_ptr, nxt, stride_x, stride_xs, cols, more, X_SLICES, DT, SNAP)
            if HAS_RESIDUAL:
                r_next = tl.load(res_ptr + nxt * stride_r + cols, mask=more, other=0.0)
            else:
                r_next = x_next
            # The weight is re-read per row (from L1/L2) rather than held in registers across rows.
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            _norm_row(
                x, r, w, row, cols, mask, res_out_ptr, out_ptr, scale_ptr, inv_static, N, eps, stride_ro,
                stride_o, HAS_RESIDUAL, QUANT, SNAP,
            )  # fmt: skip
            x = x_next
            r = r_next
    else:
        # The weight is no earlier kernel's output: load it before waiting on the previous kernel.
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        pdl_wait(PDL, True)
        inv_static = static_inv_scale(scale_ptr, QUANT)
        x = _load_x(x_ptr, pid, stride_x, stride_xs, cols, mask, X_SLICES, DT, SNAP)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + tl.cast(pid, tl.int64) * stride_r + cols, mask=mask, other=0.0)
        else:
            r = x
        _norm_row(
            x, r, w, pid, cols, mask, res_out_ptr, out_ptr, scale_ptr, inv_static, N, eps, stride_ro,
            stride_o, HAS_RESIDUAL, QUANT, SNAP,
        )  # fmt: skip


def _check(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None = None,
) -> None:
    """x [rows, hidden] in residual's 16-bit dtype, or (with a residual) fp32 split-K partials
    [slices, rows, hidden] (kernels.fp8_gemm.fp8_gemm_partials), summed before the add. Also run by the
    ops' fake implementations (check_one_device)."""
    check_one_device(x=x, residual=residual, weight=weight, scale=scale)
    if not eps > 0:  # rsqrt(mean square + eps) of an all-zero row would be inf, its output NaN
        raise ValueError(f"eps must be > 0, got {eps}")
    partials = residual is not None and x.dim() == 3
    if partials and (x.dtype != torch.float32 or not x.is_contiguous()):
        raise ValueError(
            f"x as split-K partials must be a contiguous fp32 [slices, rows, hidden], got {x.dtype}"
        )
    dtype = residual.dtype if partials else x.dtype
    if dtype not in (torch.bfloat16, torch.float16) or (residual is not None and residual.dtype != dtype):
        dtypes = f"x {x.dtype}" + (f", residual {residual.dtype}" if residual is not None else "")
        raise ValueError(f"x and residual must share a 16-bit float dtype, got {dtypes}")
    rows = x[0] if partials else x
    if rows.dim() != 2 or rows.stride(-1) != 1:
        raise ValueError(f"x must be a row-contiguous [rows, hidden] tensor, got shape {tuple(x.shape)}")
    if weight.shape != (rows.shape[1],) or weight.stride(0) != 1:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {rows.shape[1]}")
    if residual is not None and (residual.shape != rows.shape or residual.stride(-1) != 1):
        raise ValueError(
            f"residual shape {tuple(residual.shape)} must equal x's rows {tuple(rows.shape)}, rows contiguous"
        )


def _launch(x, residual, residual_out, weight, eps, out, scale, quant: int) -> None:
    slices = x.shape[0] if x.dim() == 3 else 0  # split-K partials to sum (_check)
    rows, hidden = x.shape[-2:]
    if rows == 0:
        return
    walkers, persistent = row_grid(rows, x.device, fp8.NORM_PERSISTENT_ROWS_PER_SM)
    walked = rows - rows % walkers if persistent else rows
    block, warps = row_launch(hidden, None if persistent else fp8.NORM_ELEMENTS_PER_WARP)
    _add_rmsnorm_kernel[(walkers + rows - walked,)](
        x,
        residual if residual is not None else x,
        residual_out if residual_out is not None else x,
        weight,
        out,
        scale,
        walked,
        walkers,
        hidden,
        eps,
        x.stride(-2),
        x.stride(0) if slices else 0,
        residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual_out is not None else 0,
        out.stride(0),
        HAS_RESIDUAL=residual is not None,
        X_SLICES=slices,
        QUANT=quant,
        BLOCK=block,
        PERSISTENT=persistent,
        SNAP=INTERPRETED,
        PDL=pdl_for(x.device),
        num_warps=warps,
        **launch_options(x.device),
    )


def _fp8_outputs(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(e4m3 output, scales, QUANT mode): a scale per row to fill, or the static one (copied out, as a
    custom op may not return its input)."""
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    if scale is None:
        return out, torch.empty(x.shape[0], dtype=torch.float32, device=x.device), QUANT_DYNAMIC
    check_static_scale(scale)
    return out, scale.clone(), QUANT_STATIC


# The ops return the new residual rather than updating `residual` in place: the kernel moves the same
# bytes either way, and torch.compile needs no functionalization copies around a pure op.
@torch.library.custom_op("weft::add_rmsnorm_fp8", mutates_args=())
def add_rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [M, N], fp32 scales, residual + x) with RMSNorm(residual + x) * weight quantized: with the
    static per-tensor `scale`, or (None) one scale per row. x: bf16 [M, N], or fp32 split-K partials
    [S, M, N] (kernels.fp8_gemm.fp8_gemm_partials), summed in slice order and rounded first.

    Scale convention (kernels.fp8): scale = amax / 448, q = e4m3(y / scale), y ~= q * scale."""
    _check(x, residual, weight, eps, scale)
    out, scales, quant = _fp8_outputs(residual, scale)
    new_residual = torch.empty_like(residual)
    _launch(x, residual, new_residual, weight, eps, out, scales if scale is None else scale, quant)
    return out, scales, new_residual


@add_rmsnorm_fp8.register_fake
def _(x, residual, weight, eps, scale):
    _check(x, residual, weight, eps, scale)
    scales = x.new_empty(residual.shape[0], dtype=torch.float32) if scale is None else torch.empty_like(scale)
    return x.new_empty(residual.shape, dtype=FP8), scales, torch.empty_like(residual)


@torch.library.custom_op("weft::rmsnorm_fp8", mutates_args=())
def rmsnorm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, N], fp32 scales) of RMSNorm(x) * weight quantized (scales as add_rmsnorm_fp8)."""
    _check(x, None, weight, eps, scale)
    out, scales, quant = _fp8_outputs(x, scale)
    _launch(x, None, None, weight, eps, out, scales if scale is None else scale, quant)
    return out, scales


@rmsnorm_fp8.register_fake
def _(x, weight, eps, scale):
    _check(x, None, weight, eps, scale)
    scales = x.new_empty(x.shape[0], dtype=torch.float32) if scale is None else torch.empty_like(scale)
    return x.new_empty(x.shape, dtype=FP8), scales


@torch.library.custom_op("weft::add_rmsnorm", mutates_args=())
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 path: (RMSNorm(residual + x) * weight in residual's dtype, residual + x); x as in
    add_rmsnorm_fp8."""
    _check(x, residual, weight, eps)
    out, new_residual = torch.empty_like(residual), torch.empty_like(residual)
    _launch(x, residual, new_residual, weight, eps, out, out, QUANT_NONE)
    return out, new_residual


@add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    _check(x, residual, weight, eps)
    return torch.empty_like(residual), torch.empty_like(residual)


@torch.library.custom_op("weft::rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The bf16 path without a residual: RMSNorm(x) * weight in x's dtype."""
    _check(x, None, weight, eps)
    out = torch.empty_like(x)
    _launch(x, None, None, weight, eps, out, out, QUANT_NONE)
    return out


@rmsnorm.register_fake
def _(x, weight, eps):
    _check(x, None, weight, eps)
    return torch.empty_like(x)


def add_rmsnorm_fp8_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Plain torch: (e4m3 values, scales, new residual); inputs are left untouched."""
    y, new_residual = _rmsnorm_reference(x, residual, weight, eps)
    q, scales = quantize_reference(y, scale)
    return q, scales, new_residual


def add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    y, new_residual = _rmsnorm_reference(x, residual, weight, eps)
    return y.to(residual.dtype if residual is not None else x.dtype), new_residual


def _rmsnorm_reference(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() == 3:  # split-K partials: summed in slice order, rounded as the GEMM would
        x = functools.reduce(torch.add, x.unbind(0)).to(residual.dtype)
    new_residual = x + residual if residual is not None else None
    h = (new_residual if residual is not None else x).float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y, new_residual
