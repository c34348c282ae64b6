"""SwiGLU (+ FP8 quantize): [gate | up] -> silu(gate) * up -> e4m3 with a static scale or a per-row
scale (amax / 448), or bf16. Reads 4 bytes and writes 1 (or 2) per output element.

Few rows: one program holds a whole row in registers. Many rows: the row goes in chunks so that many
rows stream through each SM; a per-row scale then takes a first pass for the amax, and the second
recomputes silu(gate) * up from inputs that the first pass left in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8, INTERPRETED, downcast, quantize_reference, row_launch, store_row, to_fp8

QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC = 0, 1, 2
# From this many rows on, the chunked kernel runs (about two rows per SM on an H100/H200).
CHUNKED_MIN_ROWS = 256
CHUNK = 2048


@triton.jit
def _swiglu_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    H,
    stride_x,
    stride_o,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    SNAP: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + H + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    store_row(y, out_ptr, row, stride_o, cols, mask, scale_ptr, QUANT, SNAP)


@triton.jit
def _swiglu_chunked_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    H,
    stride_x,
    stride_o,
    QUANT: tl.constexpr,
    CHUNK: tl.constexpr,
    SNAP: tl.constexpr,
):
    row = tl.program_id(0)
    inv_scale = 1.0
    if QUANT == 1:
        inv_scale = 1.0 / tl.load(scale_ptr)
    if QUANT == 2:
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for start in range(0, H, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            mask = cols < H
            gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + row * stride_x + H + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(gate * tl.sigmoid(gate) * up))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12 * 448.0) / 448.0
        tl.store(scale_ptr + row, scale)
        inv_scale = 1.0 / scale
    for start in range(0, H, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        mask = cols < H
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + H + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
        if QUANT == 0:
            tl.store(out_ptr + row * stride_o + cols, downcast(y, out_ptr.dtype.element_ty, SNAP), mask=mask)
        else:
            tl.store(out_ptr + row * stride_o + cols, to_fp8(y, inv_scale, SNAP), mask=mask)


def _launch(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, quant: int) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"swiglu takes bf16 or fp16 input, got {x.dtype}")
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % 2:
        raise ValueError(f"x must be a row-contiguous [rows, 2 * hidden] tensor, got shape {tuple(x.shape)}")
    hidden = x.shape[1] // 2
    if x.shape[0] >= CHUNKED_MIN_ROWS:
        _swiglu_chunked_kernel[(x.shape[0],)](
            x,
            out,
            scale,
            hidden,
            x.stride(0),
            out.stride(0),
            QUANT=quant,
            CHUNK=CHUNK,
            SNAP=INTERPRETED,
            num_warps=4,
        )
        return
    block, warps = row_launch(hidden)
    _swiglu_kernel[(x.shape[0],)](
        x,
        out,
        scale,
        hidden,
        x.stride(0),
        out.stride(0),
        QUANT=quant,
        BLOCK=block,
        SNAP=INTERPRETED,
        num_warps=warps,
    )


@torch.library.custom_op("weft::swiglu_fp8", mutates_args=())
def swiglu_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2H] = [gate | up] -> (e4m3 [M, H], fp32 scales): static `scale`, or per row when None."""
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=FP8, device=x.device)
    if scale is None:
        scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        _launch(x, out, scales, QUANT_DYNAMIC)
        return out, scales
    _launch(x, out, scale, QUANT_STATIC)
    return out, scale.clone()


@swiglu_fp8.register_fake
def _(x, scale):
    scales = x.new_empty(x.shape[0], dtype=torch.float32) if scale is None else torch.empty_like(scale)
    return x.new_empty(x.shape[0], x.shape[1] // 2, dtype=FP8), scales


@torch.library.custom_op("weft::swiglu", mutates_args=())
def swiglu(x: torch.Tensor) -> torch.Tensor:
    """The bf16 path: silu(gate) * up in x's dtype."""
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    _launch(x, out, out, QUANT_NONE)
    return out


@swiglu.register_fake
def _(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def swiglu_fp8_reference(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_reference(swiglu_reference(x), scale)
