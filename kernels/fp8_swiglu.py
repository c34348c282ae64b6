"""SwiGLU (+ FP8 quantize) in one pass over each row: [gate | up] -> silu(gate) * up -> e4m3 with a
static scale or a per-row scale (amax / 448), or bf16. Reads 4 bytes and writes 1 (or 2) per output
element; a program holds a whole row in registers. Few rows: one program per row; many rows: one
program per SM walks the rows, loading the next row while it finishes the current one.

Scale convention (kernels.fp8): scale = amax / 448, q = e4m3(y / scale), y ~= q * scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import (
    FP8,
    INTERPRETED,
    check_one_device,
    check_static_scale,
    launch_options,
    pdl_for,
    pdl_wait,
    quantize_reference,
    row_grid,
    row_launch,
    static_inv_scale,
    store_row,
)

QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC = 0, 1, 2
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _sigmoid(x, INTERPRETED: tl.constexpr):
    """1 / (1 + 2^(-x log2 e)) with one ex2.approx and one rcp.approx, in place of tl.sigmoid's
    full-range division. At many rows SwiGLU was bound by that division, not by HBM: on H200, 1024 rows
    of 2 x 14336 took 21.07 -> 18.90 us and 1 row 2.90 -> 2.61 us, with per-row scales within 3e-6 of
    the reference (fp8-notes.md). The interpreter runs no PTX and takes tl.sigmoid."""
    if INTERPRETED:
        return tl.sigmoid(x)
    e = tl.inline_asm_elementwise(
        "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * -LOG2E], dtype=tl.float32, is_pure=True, pack=1
    )
    return tl.inline_asm_elementwise(
        "rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _swiglu_row(
    gate,
    up,
    row,
    cols,
    mask,
    out_ptr,
    scale_ptr,
    inv_static,
    stride_o,
    QUANT: tl.constexpr,
    SNAP: tl.constexpr,
):
    gate = gate.to(tl.float32)
    y = gate * _sigmoid(gate, SNAP) * up.to(tl.float32)  # SNAP: set exactly under the interpreter
    store_row(y, out_ptr, tl.cast(row, tl.int64), stride_o, cols, mask, scale_ptr, inv_static, QUANT, SNAP)


@triton.jit
def _swiglu_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    n_rows,
    H,
    stride_x,
    stride_o,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    PERSISTENT: tl.constexpr,
    EVICT: tl.constexpr,
    SNAP: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    pdl_wait(PDL, False)
    inv_static = static_inv_scale(scale_ptr, QUANT)
    row_ptr = x_ptr + tl.cast(pid, tl.int64) * stride_x
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICT)
    up = tl.load(row_ptr + H + cols, mask=mask, other=0.0, eviction_policy=EVICT)
    if PERSISTENT:
        # One program per SM walks the rows, loading row i + step while it finishes row i.
        step = tl.num_programs(0)
        for row in range(pid, n_rows, step):
            nxt = tl.cast(row + step, tl.int64)
            more = mask & (nxt < n_rows)
            gate_next = tl.load(x_ptr + nxt * stride_x + cols, mask=more, other=0.0, eviction_policy=EVICT)
            up_next = tl.load(x_ptr + nxt * stride_x + H + cols, mask=more, other=0.0, eviction_policy=EVICT)
            _swiglu_row(gate, up, row, cols, mask, out_ptr, scale_ptr, inv_static, stride_o, QUANT, SNAP)
            gate = gate_next
            up = up_next
    else:
        _swiglu_row(gate, up, pid, cols, mask, out_ptr, scale_ptr, inv_static, stride_o, QUANT, SNAP)


def _check(x: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Refuse what the kernel cannot take; called before the output is allocated from x's shape, and by
    the fake implementations, which a call with a meta tensor among its inputs is sent to (they would
    return empty tensors on x's device: garbage, without a word). Under torch.compile every fake tensor
    reports one device."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"swiglu takes bf16 or fp16 input, got {x.dtype}")
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % 2:
        raise ValueError(f"x must be a row-contiguous [rows, 2 * hidden] tensor, got shape {tuple(x.shape)}")
    check_one_device(x=x, scale=scale)
    if scale is not None:
        check_static_scale(scale)


def _launch(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, quant: int) -> None:
    rows, hidden = x.shape[0], x.shape[1] // 2
    if rows == 0:
        return
    block, warps = row_launch(hidden)
    programs, persistent = row_grid(rows, x.device)
    _swiglu_kernel[(programs,)](
        x,
        out,
        scale,
        rows,
        hidden,
        x.stride(0),
        out.stride(0),
        QUANT=quant,
        BLOCK=block,
        PERSISTENT=persistent,
        # Streamed rows marked first to evict from L2: on H200 at 1024 rows of 2 x 14336,
        # 21.9 -> 21.2 us (fp8-notes.md); the norm loses 5% with the same hint, so it has none.
        EVICT="evict_first" if persistent else "",
        SNAP=INTERPRETED,
        PDL=pdl_for(x.device),
        num_warps=warps,
        **launch_options(x.device),
    )


@torch.library.custom_op("weft::swiglu_fp8", mutates_args=())
def swiglu_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2H] = [gate | up] -> (e4m3 [M, H], fp32 scales): static `scale`, or per row when None."""
    _check(x, scale)
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=FP8, device=x.device)
    if scale is None:
        scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        _launch(x, out, scales, QUANT_DYNAMIC)
        return out, scales
    _launch(x, out, scale, QUANT_STATIC)
    return out, scale.clone()


@swiglu_fp8.register_fake
def _(x, scale):
    _check(x, scale)
    scales = x.new_empty(x.shape[0], dtype=torch.float32) if scale is None else torch.empty_like(scale)
    return x.new_empty(x.shape[0], x.shape[1] // 2, dtype=FP8), scales


@torch.library.custom_op("weft::swiglu", mutates_args=())
def swiglu(x: torch.Tensor) -> torch.Tensor:
    """The bf16 path: silu(gate) * up in x's dtype."""
    _check(x)
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    _launch(x, out, out, QUANT_NONE)
    return out


@swiglu.register_fake
def _(x):
    _check(x)
    return x.new_empty(x.shape[0], x.shape[1] // 2)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def swiglu_fp8_reference(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_reference(swiglu_reference(x), scale)
