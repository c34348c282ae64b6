"""Decode attention for one new token per sequence, fused: rotary embedding of q and the new k, the
KV-cache write, and split-KV ("flash-decoding") attention over the cached positions, with the output
in bf16 or quantized to e4m3 (the kernels.fp8 rule) with one scale per token and kv head, which the FP8
wo GEMM applies to its group of K (kernels/fp8_gemm.py).

    q [B, 1, Hq * D], k, v [B, 1, Hkv * D]   (rows may be column slices of one fused qkv output)
    rope [max_seq_len, D / 2, 2]             (the model's whole rotary table, fp32 or cast with the
                                              model; read at the position)
    input_pos [1] int64 on the device        (every sequence at the same position, read in-kernel;
                                              outside [0, L) the output is NaN and the cache untouched)
    k_cache, v_cache [B, Hkv, L, D]          (rotated k and v written at the position)
    -> out [B, 1, Hq * D] bf16, or (e4m3 [B, 1, Hq * D], fp32 scales [B, Hkv])

One kernel, one launch, a program per (sequence, kv head, split of the positions): it rotates the
G = Hq / Hkv query heads of its kv head in registers and scores them together with tl.dot (G padded to
16 rows, the smallest MMA), keeping an online softmax in fp32 over its share of the cached positions;
the program whose share holds the current position also rotates the new k, writes k and v to the cache
and folds them in from registers, so no program reads a cache row written in the same launch. Each
program stores its partial output, running max and sum to a small fp32 workspace and counts itself in
with an atomic; the last split of a (sequence, kv head) to arrive reads every split's partials back and
weighs them into the output ("split-K with last-arriver reduction"; with one split its program writes
the output directly). For FP8 that program quantizes its kv head's G x D outputs with one scale, their
amax / 448: a scale per token and kv head rather than per token, because one per token needs every kv
head's output, i.e. a second count per sequence and the bf16 row written and read back. Against that
earlier form, on one H200 (Llama-3-8B, 640 positions): one layer 6.01 -> 4.94 us at batch 1 and 12.49
-> 11.50 us at batch 8 (bench_decode_attention), the compiled FP8 decode step 2.447 -> 2.423 and 2.773
-> 2.739 ms (bench_decode --fp8-only --compile). The counts live in a persistent zeroed per-device
workspace (arrival_counters) that each last arriver sets back to 0, so a CUDA graph's replays reuse it
as is.

Why this shape:
- Reading the cache is the whole cost (Llama-3-8B, 640 positions: 2.6 MB a layer, about 0.9 us on an
  H100), and one program per (sequence, kv head) would use 8 of 132 SMs at batch 1. The number of
  splits is fixed at launch (CUDA graphs replay one launch; it comes from the batch, kv heads, cache
  length and SM count), while each split's share is cdiv(pos + 1, splits), computed in-kernel from the
  position: the work stays spread over every split as the sequence grows, and nothing past the
  position is read (the stock path reads the whole static cache and masks it).
- Grouping the G query heads of a kv head into one program reads each cached row once for all of them.
- The position, the rotary rows and the cache rows before the position are no output of the kernel
  before this op (the cache was written at earlier steps), so under programmatic dependent launch
  (kernels.fp8) the kernel issues them, its first tile of keys and values included, before it waits on
  the qkv projection: at batch 1 and short caches, where each split is one tile, the whole cache read
  overlaps the projection's tail.
- Split counts are powers of two: about SPLIT_PROGRAMS_PER_SM programs per SM (as launched at head dim
  128, the kernel takes 155-168 registers a thread at 4 warps and, its loop on 4 cp.async stages, 102
  KiB of shared memory, so two fit an SM), no share of the full cache below
  MIN_POSITIONS_PER_SPLIT, and at most what the combining program loads at once (COMBINE_ELEMENTS
  partial outputs, MAX_SPLITS). These trade occupancy against the combine's reads
  (B * Hq * splits * D * 4 bytes). Swept on one H100 with the earlier two-launch form
  (bench_decode_attention --sweep, Llama-3-8B heads, decode_attention_sweep-h100.md): 32 rather than
  64 positions per split at least takes batch 1 at 640 positions from 8.58 to 7.40 us (16 splits, each
  one tile, all loaded before the PDL wait) and is as fast elsewhere; 32-position tiles gain there too
  (7.14 us) but lose 5% at 4096 positions; 4 programs per SM lose at batch 8. Re-swept on one H200
  with the one-launch form (decode_attention_sweep-h200.md): these settings are the fastest or within
  1.5% of it at batch 1 and 8, 640 and 4096 positions.
- One launch rather than two. In the earlier form (a split kernel, then a combine kernel per
  (sequence, kv head)) the op was latency-bound at decode sizes, the second launch and its dependent
  loads a large part of it. One layer of Llama-3-8B at 640 positions (bench_decode_attention, bf16):
  batch 1 8.5 -> 5.7 us (H100) and 7.3 -> 5.6 us (H200), batch 8 15.7 -> 14.3 and 14.1 -> 12.9 us. In
  the compiled decode step on one H200 (bench_decode --fp8 --compile, ms per token at batch 1 / 8): FP8
  2.565 / 2.866 -> 2.534 / 2.841, bf16 4.199 / 4.538 -> 4.210 / 4.524 (unchanged). The price is a fence
  (barrier + acquire-release atomic) per program and the partials read back from L2 by the last arriver
  instead of by a second grid that stream order makes wait.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8 import (
    FP8,
    INTERPRETED,
    check_one_device,
    downcast,
    launch_options,
    pdl_for,
    pdl_wait,
    programs_cap,
    quantize_reference,
    to_fp8,
)
from kernels.workspace import Workspaces, persistent_workspace
from model.llama import apply_rope

BLOCK_N = 64  # cached positions per tile
MIN_POSITIONS_PER_SPLIT = 32
SPLIT_PROGRAMS_PER_SM = 2
NUM_WARPS = 4
# cp.async stages of the loop over a split's later tiles (its first tile is loaded before the PDL wait,
# outside the loop): see pipeline_stages.
PIPELINE_STAGES = 4
# fp32 partial outputs the combining program of a kv head loads at once, and its splits. At 4 warps
# that is 128 a thread, yet ptxas (sm_90) holds the whole [G, splits, D] load without spilling: as
# launched (16-byte aligned arguments) the kernel takes 155 registers with one split and 158-168 with
# the most at head dim 128, 91 / 96 at 64 (254-255 without the alignment; check_sm90_ptx in
# tests/test_decode_attention.py compiles both). So it stays one load rather than a loop over the
# splits, which would add an L2 round trip per step to the last arriver's latency.
COMBINE_ELEMENTS = 16384
MAX_SPLITS = 64
# The running max of a split that has seen no position yet: finite, so that exp2(m_old - m_new) is 0
# rather than NaN when a split turns out empty; the combine gives such a split zero weight.
EMPTY_MAX = tl.constexpr(-1e30)
LOG2E = 1.4426950408889634
_COUNTERS: Workspaces = {}


def num_splits(
    batch: int, n_kv_heads: int, group: int, head_dim: int, cache_len: int, device: torch.device
) -> int:
    """Splits of the positions per (sequence, kv head): a power of two, about SPLIT_PROGRAMS_PER_SM
    programs per SM, none with a share of the full cache below MIN_POSITIONS_PER_SPLIT, and few enough
    that the combining program loads a kv head's partial outputs (group x splits x head_dim) at once."""
    wanted = triton.cdiv(programs_cap(device) * SPLIT_PROGRAMS_PER_SM, batch * n_kv_heads)
    wanted = min(wanted, triton.cdiv(cache_len, MIN_POSITIONS_PER_SPLIT))
    return _floor_power_of_2(max(1, min(wanted, max_splits(group, head_dim))))


def pipeline_stages(cache_len: int, splits: int) -> int:
    """num_stages of the kernel: 1 where a split's share of the full cache is one tile, so that its
    loop never runs and a pipeline's shared memory and prologue would only cost it; else
    PIPELINE_STAGES. On one H200 (Llama-3-8B heads, bf16, back-to-back calls with PDL), against
    Triton's default of 3 for every shape: batch 1 x 640 positions (16 splits of 40) 5.60 -> 4.89 us,
    batch 8 x 640 (4 splits of 160) 12.80 -> 11.35 us, batch 8 x 4096 46.6 -> 38.3 us."""
    return 1 if triton.cdiv(cache_len, splits) <= BLOCK_N else PIPELINE_STAGES


def max_splits(group: int, head_dim: int) -> int:
    """The most splits the combining program takes: MAX_SPLITS, or fewer for a large group x head dim."""
    # (At least one: a group x head dim past COMBINE_ELEMENTS runs unsplit.)
    fit = COMBINE_ELEMENTS // (triton.next_power_of_2(group) * head_dim)
    return _floor_power_of_2(max(1, min(MAX_SPLITS, fit)))


def _floor_power_of_2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def fused_decode_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether decode_attention runs here: a CUDA device (or the CPU under TRITON_INTERPRET=1), a bf16 or
    fp16 cache, a head dim that is a power of two >= 16."""
    return (
        (device.type == "cuda" or INTERPRETED)
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


@triton.jit
def _rotate(ptr, offsets, mask, cos, signed_sin, dim):
    """fp32 rotary rotation of interleaved pairs: x[d] * cos + x[d ^ 1] * (-sin for even d, +sin odd)."""
    x = tl.load(ptr + offsets + dim[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptr + offsets + (dim ^ 1)[None, :], mask=mask, other=0.0).to(tl.float32)
    return x * cos[None, :] + partner * signed_sin[None, :]


@triton.jit
def _load_tile(k_cache_ptr, v_cache_ptr, cache, first, stop, dim, D: tl.constexpr, BLOCK: tl.constexpr):
    """Keys and values [BLOCK, D] of the cached positions first .. first + BLOCK - 1 below `stop`."""
    positions = first + tl.arange(0, BLOCK)
    inside = (positions < stop)[:, None]
    tile = cache + positions.to(tl.int64)[:, None] * D + dim[None, :]
    keys = tl.load(k_cache_ptr + tile, mask=inside, other=0.0)
    values = tl.load(v_cache_ptr + tile, mask=inside, other=0.0)
    return keys, values


@triton.jit
def _attend_tile(
    q, keys, values, first, stop, m_i, l_i, acc, qk_scale, BLOCK: tl.constexpr, SNAP: tl.constexpr
):
    """One tile of the online softmax: (running max, running sum, unnormalised output) after it."""
    dtype = keys.dtype
    if SNAP:
        # Triton 3.6's interpreter multiplies the raw bits of bf16 operands in tl.dot: dot in fp32.
        keys = keys.to(tl.float32)
    scores = tl.dot(q, tl.trans(keys)) * qk_scale
    scores = tl.where((first + tl.arange(0, BLOCK) < stop)[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # P is rounded to the cache's dtype for the second MMA, as flash attention does.
    p = downcast(p, dtype, SNAP)
    if SNAP:
        p = p.to(tl.float32)
        values = values.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, values)
    return m_new, l_i, acc


@triton.jit
def _combine_splits(o_part_ptr, m_part_ptr, l_part_ptr, heads, row_mask, dim, SPLITS: tl.constexpr,
                    D: tl.constexpr):  # fmt: skip
    """The attention output [rows, D] of the query heads `heads` from their splits' partials: each
    split weighed by exp2(its max - the overall max), over the splits' weighted sums. .cg: read from
    L2, where the other programs' stores are, not from this SM's L1."""
    splits = tl.arange(0, SPLITS)
    part = heads[:, None] * SPLITS + splits[None, :]
    mask = row_mask[:, None]
    m = tl.load(m_part_ptr + part, mask=mask, other=EMPTY_MAX, cache_modifier=".cg")
    l_split = tl.load(l_part_ptr + part, mask=mask, other=0.0, cache_modifier=".cg")
    weight = tl.exp2(m - tl.max(m, axis=1)[:, None])
    # Padding rows (past G) have no sum: 1 rather than 0 / 0.
    total = tl.where(row_mask, tl.sum(l_split * weight, axis=1), 1.0)
    o = tl.load(
        o_part_ptr + part[:, :, None] * D + dim[None, None, :],
        mask=mask[:, :, None],
        other=0.0,
        cache_modifier=".cg",
    )
    return tl.sum(o * weight[:, :, None], axis=1) / total[:, None]


@triton.jit
def _write_output(out, rows, out_ptr, scale_ptr, b, h, n_kv_heads, in_cache, G: tl.constexpr,
                  D: tl.constexpr, FP8_OUT: tl.constexpr, SNAP: tl.constexpr):  # fmt: skip
    """Store a kv head's output rows [rows, D] (fp32, rows past G padding) into the sequence's row of
    out_ptr: in its dtype, or for FP8 as e4m3 with one scale for the kv head at scale_ptr[b, h]. The
    values are rounded to bf16 first, as the stock path's attention output is. All NaN (values and
    scale) unless `in_cache`, the position being inside the cache."""
    out_row = out_ptr + b.to(tl.int64) * n_kv_heads * G * D
    ptrs = out_row + (h * G + rows)[:, None] * D + tl.arange(0, D)[None, :]
    valid = (rows < G)[:, None]
    if FP8_OUT:
        out = downcast(out, tl.bfloat16, SNAP).to(tl.float32)
        amax = tl.max(tl.max(tl.where(valid, tl.abs(out), 0.0), axis=1), axis=0)
        scale = tl.maximum(amax, 1e-12 * 448.0) / 448.0  # kernels.fp8's rule
        tl.store(scale_ptr + b * n_kv_heads + h, tl.where(in_cache, scale, float("nan")))
        # The e4m3 bits, NaN (0x7F) set after the clamp to the e4m3 range, which need not keep a NaN.
        bits = to_fp8(out, 1.0 / scale, SNAP).to(tl.uint8, bitcast=True)
        bits = tl.where(in_cache, bits, 0x7F)
        tl.store(ptrs, bits.to(tl.float8e4nv, bitcast=True), mask=valid)
    else:
        out = tl.where(in_cache, out, float("nan"))
        tl.store(ptrs, downcast(out, out_ptr.dtype.element_ty, SNAP), mask=valid)


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    rope_ptr,
    pos_ptr,
    k_cache_ptr,
    v_cache_ptr,
    o_part_ptr,
    m_part_ptr,
    l_part_ptr,
    out_ptr,
    scale_ptr,
    counter_ptr,
    n_kv_heads,
    cache_len,
    stride_q,
    stride_k,
    stride_v,
    stride_rope,
    stride_cb,
    stride_ch,
    qk_scale,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    G_ROWS: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_OUT: tl.constexpr,
    SNAP: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // n_kv_heads
    h = pid % n_kv_heads
    dim = tl.arange(0, D)
    rows = tl.arange(0, G_PAD)
    pos = tl.load(pos_ptr)
    # A position outside the cache (a caller's error, on the device so unchecked on the host) reads and
    # writes nothing out of bounds: the kernel runs at position 0 (in every table and cache, and the
    # least work), writes no cache row and outputs NaN, where the stock path raises an IndexError.
    in_cache = (pos >= 0) & (pos < cache_len)
    pos = tl.where(in_cache, pos, 0)
    # This split's share of the positions 0 .. pos.
    n_positions = pos + 1
    share = tl.cdiv(n_positions, SPLITS)
    start = split * share
    end = tl.minimum(start + share, n_positions)
    holds_pos = (start <= pos) & (pos < end)
    # Cached positions of the share: all but the current one, which comes from registers below.
    stop = tl.minimum(end, pos)
    cache = b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch
    # Interleaved pairs: element d is rotated by angle d // 2 of the position's row.
    pair = (dim // 2) * 2
    cos = tl.load(rope_ptr + pos * stride_rope + pair).to(tl.float32)
    sin = tl.load(rope_ptr + pos * stride_rope + pair + 1).to(tl.float32)
    signed_sin = tl.where(dim % 2 == 0, -sin, sin)
    # The position, the rotary rows and the cache rows before the position are no output of the kernel
    # before this one (the cache was written at earlier steps), so the first tile's loads are issued
    # before waiting on it; q, k and v are its output.
    keys, values = _load_tile(k_cache_ptr, v_cache_ptr, cache, start, stop, dim, D, BLOCK)
    pdl_wait(PDL, False)

    dtype = k_cache_ptr.dtype.element_ty
    b64 = b.to(tl.int64)
    row_mask = (rows < G)[:, None]
    # The rotated q and k are rounded to the cache's dtype, as the stock path's apply_rope does.
    q = _rotate(q_ptr, b64 * stride_q + ((h * G + rows) * D)[:, None], row_mask, cos, signed_sin, dim)
    q = downcast(q, dtype, SNAP)
    k_new = _rotate(k_ptr, b64 * stride_k + h * D, dim[None, :] < D, cos, signed_sin, dim)
    k_new = downcast(k_new, dtype, SNAP)
    v_new = tl.load(v_ptr + b64 * stride_v + h * D + dim[None, :])
    if SNAP:
        q = q.to(tl.float32)
    if holds_pos & in_cache:
        tl.store(k_cache_ptr + cache + pos * D + dim[None, :], k_new)
        tl.store(v_cache_ptr + cache + pos * D + dim[None, :], v_new)

    m_i = tl.full([G_PAD], EMPTY_MAX, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    if start < stop:
        m_i, l_i, acc = _attend_tile(q, keys, values, start, stop, m_i, l_i, acc, qk_scale, BLOCK, SNAP)
    for first in range(start + BLOCK, stop, BLOCK):
        keys, values = _load_tile(k_cache_ptr, v_cache_ptr, cache, first, stop, dim, D, BLOCK)
        m_i, l_i, acc = _attend_tile(q, keys, values, first, stop, m_i, l_i, acc, qk_scale, BLOCK, SNAP)

    # The current position, from registers, in the split that holds it. A branch, so that the other
    # splits skip its products and cross-thread sums: one H100, FP8 output, alone 1-5% faster at batch 1
    # (640 and 4096 positions) and batch 8 x 640, unchanged at batch 8 x 4096 and in the decode step.
    if holds_pos:
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * qk_scale
        m_new = tl.maximum(m_i, score)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(score - m_new)
        l_i = l_i * alpha + p
        p = downcast(p, dtype, SNAP).to(tl.float32)
        acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)
        m_i = m_new

    if SPLITS == 1:
        l_i = tl.where(rows < G, l_i, 1.0)  # padding rows: 1 rather than 0 / 0
        out = acc / l_i[:, None]
        _write_output(out, rows, out_ptr, scale_ptr, b, h, n_kv_heads, in_cache, G, D, FP8_OUT, SNAP)
    else:
        heads = (b64 * n_kv_heads + h) * G + rows
        part = heads * SPLITS + split
        tl.store(o_part_ptr + part[:, None] * D + dim[None, :], acc, mask=row_mask)
        tl.store(m_part_ptr + part, m_i, mask=rows < G)
        tl.store(l_part_ptr + part, l_i, mask=rows < G)
        # The last split of this kv head to get here (one count per (sequence, kv head)) weighs them all
        # together. The barrier orders every thread's stores before the count; acquire-release makes
        # them visible to that program.
        tl.debug_barrier()
        split_counter_ptr = counter_ptr + pid
        arrived = tl.atomic_add(split_counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            tl.store(split_counter_ptr, 0)
            out_rows = tl.arange(0, G_ROWS)
            out_heads = (b64 * n_kv_heads + h) * G + out_rows
            out = _combine_splits(o_part_ptr, m_part_ptr, l_part_ptr, out_heads, out_rows < G, dim, SPLITS, D)
            _write_output(out, out_rows, out_ptr, scale_ptr, b, h, n_kv_heads, in_cache, G, D, FP8_OUT, SNAP)


def _check(q, k, v, rope, input_pos, k_cache, v_cache) -> None:
    """Refuse what the kernel cannot take: called by the ops and by their fake implementations, which a
    call with a meta tensor among its inputs is sent to (they would return empty tensors on the other
    inputs' device: garbage, without a word). Under torch.compile every fake tensor reports one device."""
    check_one_device(k_cache=k_cache, v_cache=v_cache, q=q, k=k, v=v, rope=rope, input_pos=input_pos)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [B, Hkv, L, D], got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")
    batch, n_kv_heads, _, head_dim = k_cache.shape
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"decode attention needs a head dim that is a power of two >= 16, got {head_dim}")
    if q.dim() != 3 or q.shape[1] != 1:
        raise ValueError(
            f"decode attention takes one new token per sequence (q [B, 1, Hq * D]), got q of shape "
            f"{tuple(q.shape)}: run prompts (seqlen > 1) through the stock attention path"
        )
    if q.shape[0] != batch or q.shape[2] % head_dim:
        raise ValueError(
            f"q {tuple(q.shape)} does not match the cache's batch {batch} and head dim {head_dim}"
        )
    n_heads = q.shape[2] // head_dim
    if n_heads % n_kv_heads:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of key/value heads ({n_kv_heads})")
    for name, t in (("k", k), ("v", v)):
        if t.shape != (batch, 1, n_kv_heads * head_dim):
            raise ValueError(
                f"{name} must be [{batch}, 1, {n_kv_heads * head_dim}] to match the cache, "
                f"got {tuple(t.shape)}"
            )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 or t.dtype != k_cache.dtype:
            raise ValueError(f"{name} must have contiguous rows in the cache's dtype {k_cache.dtype}")
    if k_cache.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"decode attention runs on a bf16 or fp16 KV cache, got {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if rope.dim() != 3 or rope.shape[1:] != (head_dim // 2, 2) or not rope.is_floating_point():
        raise ValueError(
            f"rope must be the rotary table [max_seq_len, {head_dim // 2}, 2], got {tuple(rope.shape)} "
            f"{rope.dtype}"
        )
    if not rope.is_contiguous():
        raise ValueError("rope must be contiguous")
    if rope.shape[0] < k_cache.shape[2]:
        # The kernel reads the row at the position (which it keeps in [0, L)): past the table's end that
        # would be other memory, and the output garbage.
        raise ValueError(
            f"rope has {rope.shape[0]} positions for a cache of {k_cache.shape[2]}: pass the model's whole "
            "rotary table"
        )
    if input_pos.shape != (1,) or input_pos.dtype != torch.int64:
        raise ValueError(
            f"input_pos must be one int64 position [1] (every sequence at the same position), got "
            f"{tuple(input_pos.shape)} {input_pos.dtype}"
        )


def arrival_counters(device: torch.device, numel: int) -> torch.Tensor:
    """The int32 arrival counts of `device`, zero wherever no call is in flight (the last arriver
    stores 0 back): kernels.workspace.persistent_workspace."""
    return persistent_workspace(_COUNTERS, device, numel, 0, 4096, "decode attention's arrival counts")


def _launch(q, k, v, rope, input_pos, k_cache, v_cache, out, scales) -> None:
    batch, n_kv_heads, cache_len, head_dim = k_cache.shape
    if batch == 0:
        return  # no sequences: nothing to attend or write (and no programs to split the cache among)
    group = q.shape[2] // head_dim // n_kv_heads
    splits = num_splits(batch, n_kv_heads, group, head_dim, cache_len, q.device)
    group_rows = triton.next_power_of_2(group)
    rows = batch * n_kv_heads * group
    # Every element of the partials is written before it is read (one split uses none).
    o_part = torch.empty(rows * splits * head_dim, dtype=torch.float32, device=q.device)
    m_part = torch.empty(rows * splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    counters = arrival_counters(q.device, batch * n_kv_heads)
    _decode_attention_kernel[(batch * n_kv_heads, splits)](
        q, k, v, rope, input_pos, k_cache, v_cache, o_part, m_part, l_part, out,
        scales if scales is not None else m_part, counters, n_kv_heads, cache_len, q.stride(0),
        k.stride(0), v.stride(0), rope.stride(0), k_cache.stride(0), k_cache.stride(1),
        LOG2E / math.sqrt(head_dim),
        G=group, G_PAD=max(16, group_rows), G_ROWS=group_rows, D=head_dim, SPLITS=splits,
        BLOCK=BLOCK_N, FP8_OUT=scales is not None,
        SNAP=INTERPRETED, PDL=pdl_for(q.device), num_warps=NUM_WARPS,
        num_stages=pipeline_stages(cache_len, splits), **launch_options(q.device),
    )  # fmt: skip


@torch.library.custom_op("weft::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention_bf16(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: torch.Tensor,
    input_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Attention output [B, 1, Hq * D] in the cache's dtype (module docstring; see decode_attention)."""
    _check(q, k, v, rope, input_pos, k_cache, v_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(q, k, v, rope, input_pos, k_cache, v_cache, out, None)
    return out


@decode_attention_bf16.register_fake
def _(q, k, v, rope, input_pos, k_cache, v_cache):
    _check(q, k, v, rope, input_pos, k_cache, v_cache)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# Named for its scales' shape: torch.compile's FX graph cache does not key on an op's fake function, so
# a graph compiled against the per-token scales of before would be replayed with the wrong shape.
@torch.library.custom_op("weft::decode_attention_fp8_head_scales", mutates_args=("k_cache", "v_cache"))
def decode_attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: torch.Tensor,
    input_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output quantized: e4m3 [B, 1, Hq * D] and fp32 scales [B, Hkv], one per token and kv
    head (the G * D elements of the row that the kv head's query heads output)."""
    _check(q, k, v, rope, input_pos, k_cache, v_cache)
    out = torch.empty(q.shape, dtype=FP8, device=q.device)
    scales = torch.empty(q.shape[0], k_cache.shape[1], dtype=torch.float32, device=q.device)
    _launch(q, k, v, rope, input_pos, k_cache, v_cache, out, scales)
    return out, scales


@decode_attention_fp8.register_fake
def _(q, k, v, rope, input_pos, k_cache, v_cache):
    _check(q, k, v, rope, input_pos, k_cache, v_cache)
    return q.new_empty(q.shape, dtype=FP8), q.new_empty(q.shape[0], k_cache.shape[1], dtype=torch.float32)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: torch.Tensor,
    input_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    fp8: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new token per sequence at position input_pos [1] over the KV cache, which it
    updates: q [B, 1, Hq * D], k, v [B, 1, Hkv * D] as projected (not yet rotated), rope the model's
    whole rotary table. Returns [B, 1, Hq * D] in the cache's dtype, or with `fp8` the e4m3 values and
    their fp32 scales [B, Hkv] (scale = amax / 448 of each kv head's G * D outputs; fp8_gemm takes them
    as scales per token and group of K). A position outside [0, L) (unchecked on the host: it lives on
    the device) leaves the cache as it is and makes the output, and scales, all NaN."""
    op = decode_attention_fp8 if fp8 else decode_attention_bf16
    return op(q, k, v, rope, input_pos, k_cache, v_cache)


def decode_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: torch.Tensor,
    input_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    fp8: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The stock path decode_attention fuses, same signature: apply_rope, the cache write
    (index_copy_) and SDPA over the whole cache with the position mask."""
    _check(q, k, v, rope, input_pos, k_cache, v_cache)
    batch, n_kv_heads, cache_len, head_dim = k_cache.shape
    angles = rope[input_pos]
    q = apply_rope(q.view(batch, 1, -1, head_dim), angles).transpose(1, 2)
    k = apply_rope(k.view(batch, 1, n_kv_heads, head_dim), angles).transpose(1, 2)
    k_cache.index_copy_(2, input_pos, k)
    v_cache.index_copy_(2, input_pos, v.view(batch, 1, n_kv_heads, head_dim).transpose(1, 2))
    mask = torch.arange(cache_len, device=q.device)[None, :] <= input_pos[:, None]
    grouped = q.shape[1] != n_kv_heads
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=grouped)
    out = out.transpose(1, 2).reshape(batch, 1, -1)
    if not fp8:
        return out
    values, scales = quantize_reference(out.view(batch, n_kv_heads, -1))
    return values.view(out.shape), scales
