"""Skinny GEMM for decode, FP8 or bf16: out[M, N] = (A[M, K] * a_scale) @ (B[N, K] * b_scale)^T in bf16,
for M <= 64 tokens, A and B in e4m3, A scaled per token (or per tensor), B per output channel (or per
tensor); or A and B in bf16 without scales (`bf16_gemm`, the bf16 decode path's linear layers). One
kernel serves both: a bf16 tile of the same bytes has half the K, so bf16 configs take half the block_k.

At decode M is tiny, so the time is the time to read B (N * K bytes) once. The grid spreads B over
many programs: columns in tiles of BLOCK_N, and K in `split_k` slices so that even a narrow N keeps
every SM streaming. Each program accumulates [BLOCK_M, BLOCK_N] in fp32 on the tensor cores (M padded
to BLOCK_M >= 16 by masking). With `swap_ab` the kernel computes out^T = B @ A^T instead, so that
the weight tile (>= 64 rows) is the MMA's M side: on Hopper that is wgmma, which reads e4m3 straight
from shared memory, where the unswapped [16, K] x [K, BLOCK_N] tile goes through mma.sync with both
operands converted to fp16 in registers. With split_k > 1 the other slices write fp32 partials into a
workspace kept at a sentinel (EMPTY) between calls, and the last slice of each column tile reads them
as they land (each element its own arrival flag), sums them in slice order and re-arms the workspace:
one launch, a deterministic result, no zero-fill and no counter round trip.

Hopper's e4m3 wgmma does not keep a full fp32 sum across a chain of instructions: left to run over
all of K, all-positive operands came out 4-19% low at K = 4096-16384 on H200 (torch._scaled_mm:
0.2% off). So each K tile's dot starts from zero and is added to the accumulator in fp32 registers,
which brings the error to torch._scaled_mm's. (Triton's own promotion, `max_num_imprecise_acc`,
adds inside the MMA chain, and ptxas then serializes every wgmma of the kernel: up to 35% slower at
M = 64; fp8-notes.md.)

Tile configs are tuned per GPU model and (M bucket, N, K) by `benchmarks/bench_fp8.py --tune` and kept in
fp8_gemm_configs.json beside this file, so serving never autotunes (triton.autotune would time configs
inside the first call, i.e. inside a CUDA-graph warm-up, and its choice would differ run to run). A GPU
model with no configs of its own uses the reference GPU's (REFERENCE_GPU); untuned shapes use a
heuristic. The weight's scales, and in most configs its first K tile, are loaded before the kernel
waits on the previous one (programmatic dependent launch, kernels.fp8.USE_PDL): weights and their
scales must not be written by the kernel right before the call.
Beyond M = 64 the work is no longer weight-bound and `torch._scaled_mm` (bf16: F.linear) takes over.

Two modes fuse a decode MLP's SwiGLU into its GEMMs (two launches instead of three):
- SwiGLU epilogue (`skinny_swiglu_fp8_gemm`, `skinny_swiglu_bf16_gemm`) for the [w1|w3] weight, its gate
  and up rows interleaved (`gate_up_rows`: row 2i gate i, row 2i + 1 up i, per-channel scales alike), so
  that every tile of any even BLOCK_N holds whole pairs. The epilogue (after the split-K sum, in the
  last slice) splits the fp32 tile into its column pairs and stores silu(gate) * up in bf16, [M, N / 2],
  with kernels/fp8_swiglu.py's fast sigmoid. On e4m3 operands it also folds each token's largest |value|
  as stored into the amax workspace (`atomic_max` of fp32 bit patterns, which order as the values do).
- Quantized A (`skinny_quantizing_fp8_gemm`) for w2: A is that bf16 output; after the PDL wait the kernel
  reads the amax workspace, takes scale = amax / 448 per token (kernels.fp8's rule), quantizes each A
  tile to e4m3 in registers before the dot and scales the result in its epilogue as usual. Every program
  then counts itself in on the workspace's arrival counter (barrier, acq_rel atomic), and the last one
  stores 0 back to the amax and the counter: the workspace is 0 between calls without a memset launch.
  The bf16 A tiles take twice the shared memory of e4m3 ones, so a 5-stage config at M <= 16 no longer
  fits two programs per SM.

bf16 wgmma keeps a full fp32 sum, so bf16 alone would not need the per-tile restart; the kernel keeps the
same loop for both dtypes, so that one pipeline is tuned and tested.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8 import (
    FP8,
    INTERPRETED,
    downcast,
    launch_options,
    pdl_for,
    pdl_wait,
    programs_cap,
    to_fp8,
)
from kernels.fp8_swiglu import fast_sigmoid
from kernels.workspace import Workspaces, persistent_workspace

MAX_M = 64
CONFIG_FILE = Path(__file__).with_name("fp8_gemm_configs.json")


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = False  # weight tile as the MMA's M side (wgmma on Hopper); needs block_n >= 64
    # The first weight tile loaded before the PDL wait. It takes a shared-memory buffer of its own for
    # the whole call, which without it can hold one more pipeline stage instead.
    early_tile: bool = True


def m_bucket(m: int) -> int:
    """BLOCK_M for M tokens: the tensor-core minimum of 16, else the next power of two."""
    return max(16, triton.next_power_of_2(m))


def heuristic_config(m: int, n: int, k: int, sm_count: int = 132, element_bytes: int = 1) -> GemmConfig:
    """Swapped tiles of 64 weight rows x 256 bytes of K (wgmma on Hopper: 256 of K in e4m3, 128 in
    bf16, `element_bytes` 2), and K split by how many column tiles there are per SM:
    - fewer tiles than SMs: split until the programs fill the SMs at most once (36 tiles: 3; 64: 2);
    - one to two tiles per SM, M <= 16: the smallest split whose last wave is 90% full (160: 3);
    - otherwise no split (larger M makes the partials dearer than the balance they buy).
    Each slice keeps at least 2 KiB of each weight row (2048 of K in e4m3). On H200 this came within
    8% of the best of a 12-config sweep at 12 shapes x M = 1 / 16 / 64 (e4m3); "about two programs per
    SM", the rule before it, was up to 2.8x slower. Where the programs fill the SMs at most once and
    M <= 16, the loop runs 5 stages with no early tile (the same shared memory as 4 stages with it,
    two programs per SM): on H200 3-12% faster at 32 of 33 such (shape, M), where past one wave it
    ranged from 6% slower to 3% faster (fp8-notes.md). The bf16 tiles hold the same bytes, so the
    same shared memory and waves: the rule carries over untuned."""
    block_n, block_k = 64, 256 // element_bytes
    tiles = triton.cdiv(n, block_n)
    max_split = max(1, k * element_bytes // 2048)
    split = 1
    if tiles < sm_count:
        split = sm_count // tiles
    elif tiles < 2 * sm_count and m_bucket(m) <= 16:
        while split < max_split and tiles * split / (triton.cdiv(tiles * split, sm_count) * sm_count) < 0.9:
            split += 1
    split = min(split, max_split)
    if m_bucket(m) <= 16 and tiles * split <= sm_count:
        return GemmConfig(block_n, block_k, split, num_stages=5, swap_ab=True, early_tile=False)
    return GemmConfig(block_n, block_k, split, num_stages=4, swap_ab=True)


# The GPU the benchmarks and bars are measured on; its configs also serve GPU models tuned for nothing.
REFERENCE_GPU = "NVIDIA H200"


def _load_tuned() -> dict[str, dict[str, GemmConfig]]:
    """{GPU model name: {config_key: GemmConfig}} from CONFIG_FILE."""
    if not CONFIG_FILE.is_file():
        return {}
    sections = json.loads(CONFIG_FILE.read_text())
    if any("block_n" in cfgs for cfgs in sections.values()):
        raise ValueError(
            f"{CONFIG_FILE} holds configs keyed by shape only (the format before GPU models): nest them "
            'under the name of the GPU they were tuned on, e.g. {"NVIDIA H200": {...}}, or re-run '
            "python -m benchmarks.bench_fp8 --tune"
        )
    return {gpu: {key: GemmConfig(**cfg) for key, cfg in cfgs.items()} for gpu, cfgs in sections.items()}


TUNED = _load_tuned()


def config_key(m: int, n: int, k: int, dtype: torch.dtype = FP8) -> str:
    """The tuned-config key: "M bucket,N,K" for e4m3 operands (the format before bf16), prefixed
    "bf16," for bf16 ones."""
    key = f"{m_bucket(m)},{n},{k}"
    return key if dtype == FP8 else f"bf16,{key}"


@cache
def gpu_model(device: torch.device) -> str:
    """The name configs are kept under: the CUDA device's name, REFERENCE_GPU off CUDA (interpreter)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else REFERENCE_GPU


def config_for(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = FP8) -> GemmConfig:
    """The tuned config of `device`'s GPU model, else the reference GPU's, else heuristic_config, for
    operands of `dtype` (FP8 or bf16)."""
    key = config_key(m, n, k, dtype)
    for gpu in (gpu_model(device), REFERENCE_GPU):
        if key in TUNED.get(gpu, {}):
            return TUNED[gpu][key]
    element_bytes = 1 if dtype == FP8 else 2
    if device.type != "cuda":
        return heuristic_config(m, n, k, element_bytes=element_bytes)
    return heuristic_config(m, n, k, programs_cap(device), element_bytes)


def save_tuned(gpu: str, configs: dict[str, GemmConfig]) -> None:
    """Keep `configs` as GPU model `gpu`'s in TUNED and CONFIG_FILE (other models' stay as they are)."""
    TUNED[gpu] = dict(sorted(configs.items()))
    everything = {name: {k: asdict(v) for k, v in cfgs.items()} for name, cfgs in sorted(TUNED.items())}
    CONFIG_FILE.write_text(json.dumps(everything, indent=1) + "\n")


@triton.jit
def _tile_dot(x, y, UPCAST: tl.constexpr):
    """x @ y with an fp32 result. UPCAST (bf16 under the interpreter): the operands widened to fp32
    first, as Triton 3.6's interpreter multiplies bf16 dot operands as their raw 16-bit patterns."""
    return tl.dot(x.to(tl.float32), y.to(tl.float32)) if UPCAST else tl.dot(x, y)


@triton.jit
def _load_a(ptrs, mask, inv_scale, QUANTIZE_A: tl.constexpr, SNAP: tl.constexpr):
    """A tile as stored, or (QUANTIZE_A) bf16 values times 1 / their token's scale as e4m3."""
    a = tl.load(ptrs, mask=mask, other=0.0)
    if QUANTIZE_A:
        a = to_fp8(a.to(tl.float32), inv_scale, SNAP)
    return a


@triton.jit
def _token_scales_and_rearm(amax_ptr, offs_m, M):
    """Per-token scales [BLOCK_M, 1] = amax / 448 (kernels.fp8's rule and guard) from the amax workspace
    the SwiGLU epilogue filled; the last program of the grid to read it stores 0 back (re-arm)."""
    amax = tl.load(amax_ptr + offs_m, mask=offs_m < M, other=0).to(tl.float32, bitcast=True)
    scale = tl.maximum(amax, 1e-12 * 448.0) / 448.0  # kernels.fp8's MIN_SCALE and FP8_MAX
    # Every thread's read of amax comes before this program counts itself in (barrier, then a
    # release); the last to arrive (acquire) has seen every program's count, so every read is done.
    tl.debug_barrier()
    arrived = tl.atomic_add(amax_ptr + AMAX_SLOTS, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.store(amax_ptr + offs_m, tl.zeros_like(offs_m), mask=offs_m < M)
        tl.store(amax_ptr + AMAX_SLOTS, 0)
    return scale[:, None]


@triton.jit
def _store_out(
    acc,
    out_ptr,
    amax_ptr,
    offs_m,
    pid_n,
    M,
    N,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SWIGLU: tl.constexpr,
    OUT_AMAX: tl.constexpr,
    SNAP: tl.constexpr,
):
    """Write the fp32 tile [BLOCK_M, BLOCK_N] of out[:, pid_n * BLOCK_N:] as out's dtype; with SWIGLU,
    its column pairs (gate, up) as silu(gate) * up into out[:, pid_n * BLOCK_N / 2:], and with OUT_AMAX
    each token's largest |value| as stored into the amax workspace."""
    if SWIGLU:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        acc = gate * fast_sigmoid(gate, SNAP) * up
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        N = N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = downcast(acc, out_ptr.dtype.element_ty, SNAP)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)
    if OUT_AMAX:
        # |values| >= 0 order as their fp32 bit patterns do: an integer max over the programs.
        row_amax = tl.max(tl.where(mask, tl.abs(out.to(tl.float32)), 0.0), axis=1)
        tl.atomic_max(amax_ptr + offs_m, row_amax.to(tl.int32, bitcast=True), mask=offs_m < M, sem="relaxed")


@triton.jit
def _skinny_gemm_kernel(
    a_ptr,
    b_ptr,
    a_scale_ptr,
    b_scale_ptr,
    out_ptr,
    partial_ptr,
    amax_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_am,
    stride_bn,
    stride_om,
    SCALED: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    B_PER_CHANNEL: tl.constexpr,
    QUANTIZE_A: tl.constexpr,
    SWIGLU: tl.constexpr,
    OUT_AMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    EARLY_TILE: tl.constexpr,
    SPLIT: tl.constexpr,
    SNAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * k_per_split + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :]
    # The weight is no earlier kernel's output: its scales, and with EARLY_TILE its first tile, stream
    # in before the wait on the previous kernel (PDL), overlapping that kernel's tail; the activations
    # are read after it. The early tile is multiplied last, so the pipelined loop over the other tiles
    # never waits for it (on H200 up to 2.5% faster than multiplying it first); its shared-memory
    # buffer can instead hold one more stage, which wins at the narrow shapes (fp8-notes.md). The
    # scales are loaded here rather than after the loop, where their DRAM latency would lengthen every
    # program's tail by about 0.5 us (on H200 1-5% faster at the narrow shapes).
    if EARLY_TILE:
        b_first = tl.load(b_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
    else:  # the loop starts with the first tile
        a_ptrs -= BLOCK_K
        b_ptrs -= BLOCK_K
        offs_k -= BLOCK_K
    if SCALED:  # e4m3 operands; bf16 ones have no scales
        if B_PER_CHANNEL:
            b_scale = tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        else:
            b_scale = tl.load(b_scale_ptr)
    pdl_wait(PDL, False)
    # A, its scales and the amax workspace are the previous kernel's outputs: read after the wait.
    a_inv_scale = 1.0
    if QUANTIZE_A:  # bf16 A, quantized per token here with the amax its producer left
        a_scale = _token_scales_and_rearm(amax_ptr, offs_m, M)
        a_inv_scale = 1.0 / a_scale
    if EARLY_TILE:
        a_first = _load_a(
            a_ptrs, (offs_m[:, None] < M) & (offs_k[None, :] < K), a_inv_scale, QUANTIZE_A, SNAP
        )
    if SCALED and not QUANTIZE_A:
        if A_PER_TOKEN:
            a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
        else:
            a_scale = tl.load(a_scale_ptr)
    if SWAP_AB:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(EARLY_TILE, tl.cdiv(k_per_split, BLOCK_K)):
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        offs_k += BLOCK_K
        in_k = offs_k[None, :] < K
        a = _load_a(a_ptrs, (offs_m[:, None] < M) & in_k, a_inv_scale, QUANTIZE_A, SNAP)
        b = tl.load(b_ptrs, mask=(offs_n[:, None] < N) & in_k, other=0.0)
        if SWAP_AB:
            # out^T = B @ A^T: the weight tile is the MMA's M side (>= 64 rows: Hopper's wgmma, which
            # reads e4m3 and bf16 straight from shared memory), the few tokens its N side.
            acc_t += _tile_dot(b, tl.trans(a), UPCAST)
        else:
            acc += _tile_dot(a, tl.trans(b), UPCAST)
    if SWAP_AB:
        if EARLY_TILE:
            acc_t += _tile_dot(b_first, tl.trans(a_first), UPCAST)
        acc = tl.trans(acc_t)
    elif EARLY_TILE:
        acc += _tile_dot(a_first, tl.trans(b_first), UPCAST)
    if SCALED:
        acc = acc * a_scale * b_scale
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if not SPLIT:
        _store_out(
            acc, out_ptr, amax_ptr, offs_m, pid_n, M, N, stride_om, BLOCK_M, BLOCK_N, SWIGLU, OUT_AMAX, SNAP
        )
    else:
        splits = tl.num_programs(1)
        tile = offs_m[:, None] * N + offs_n[None, :]
        if pid_k < splits - 1:
            tl.store(partial_ptr + pid_k * M * N + tile, acc, mask=mask)
        else:
            # The last K slice (launched after the others, so never waiting on a program that has
            # not started) sums the others' partials in slice order, deterministic, then its own.
            # The workspace holds EMPTY wherever no partial has landed, so each element is its own
            # arrival flag: one read from L2 per partial, no counter round trip. Reading a slice
            # re-arms it with EMPTY for the next call.
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, splits - 1):
                ptrs = partial_ptr + s * M * N + tile
                part = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
                while tl.max(((part.to(tl.int32, bitcast=True) == EMPTY) & mask).to(tl.int32)) > 0:
                    part = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
                total += part
                tl.store(
                    ptrs, tl.full((BLOCK_M, BLOCK_N), EMPTY, tl.int32).to(tl.float32, bitcast=True), mask=mask
                )
            _store_out(
                total + acc,
                out_ptr,
                amax_ptr,
                offs_m,
                pid_n,
                M,
                N,
                stride_om,
                BLOCK_M,
                BLOCK_N,
                SWIGLU,
                OUT_AMAX,
                SNAP,
            )


# A NaN bit pattern no arithmetic produces (a generated NaN is 0x7FC00000 or 0xFFC00000).
EMPTY: tl.constexpr = tl.constexpr(0x7FC0DEAD)
_WORKSPACES: Workspaces = {}
# The amax workspace: MAX_M per-token amax slots, then the arrival counter of the GEMM that reads them.
AMAX_SLOTS: tl.constexpr = tl.constexpr(MAX_M)
_AMAX_WORKSPACES: Workspaces = {}


def split_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """The fp32 split-K partials workspace of `device`, at least `numel` long and EMPTY wherever no
    call is in flight (every call re-arms what it read): kernels.workspace.persistent_workspace."""
    return persistent_workspace(
        _WORKSPACES, device, numel, EMPTY.value, 1 << 20, "split-K workspace", dtype=torch.float32
    )


def amax_workspace(device: torch.device) -> torch.Tensor:
    """The int32 [MAX_M + 1] amax workspace of `device`, between an e4m3 SwiGLU GEMM and the quantizing
    GEMM after it: each token's amax (fp32 bit patterns) that the first accumulates, then the second's
    arrival counter. All 0 between such pairs of calls (the second re-arms it):
    kernels.workspace.persistent_workspace."""
    return persistent_workspace(_AMAX_WORKSPACES, device, MAX_M + 1, 0, MAX_M + 1, "amax workspace")


def gate_up_rows(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the gate rows and the up rows of a SwiGLU GEMM's weight [2H, K] (or of its per-channel
    scales [2H]). They alternate, gate i in row 2i and up i in row 2i + 1, so that every tile of the
    GEMM holds whole (gate, up) pairs whatever its BLOCK_N."""
    pairs = fused.unflatten(0, (-1, 2))
    return pairs[:, 0], pairs[:, 1]


def _check_shapes(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{name} needs A [M, K] and B [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"{name} needs A and B contiguous along K")


def _check(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> None:
    if a.dtype != FP8 or b.dtype != FP8:
        raise ValueError(f"fp8_gemm takes float8_e4m3fn operands, got {a.dtype} and {b.dtype}")
    _check_shapes("fp8_gemm", a, b)
    if a_scale.numel() not in (1, a.shape[0]) or b_scale.numel() not in (1, b.shape[0]):
        raise ValueError(
            f"scales must be per tensor (1) or per row: a_scale has {a_scale.numel()} for M={a.shape[0]}, "
            f"b_scale has {b_scale.numel()} for N={b.shape[0]}"
        )


def _check_bf16(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise ValueError(f"bf16_gemm takes bfloat16 operands, got {a.dtype} and {b.dtype}")
    _check_shapes("bf16_gemm", a, b)


def _check_skinny(name: str, a: torch.Tensor, b: torch.Tensor, swiglu: bool) -> None:
    if a.shape[0] > MAX_M:
        raise ValueError(
            f"{name} handles M <= {MAX_M}, got M={a.shape[0]}: above that, run fp8_gemm or bf16_gemm"
            + (" and then the SwiGLU kernel (kernels/fp8_swiglu.py, interleaved=True)" if swiglu else "")
        )
    if swiglu and b.shape[0] % 2:
        raise ValueError(
            f"{name} needs B's gate and up rows interleaved (gate_up_rows): an even N, got N={b.shape[0]}"
        )


def _skinny_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor | None,
    config: GemmConfig | None,
    swiglu: bool = False,
) -> torch.Tensor:
    """Launch the kernel on checked operands: e4m3 with their scales, bf16 with None for both, or bf16 A
    without a scale and e4m3 B with its scales, A then quantized per token in the kernel by the amax
    the e4m3 SwiGLU GEMM before it left in the amax workspace. `swiglu`: out [M, N / 2] = silu(gate) *
    up of B's interleaved (gate, up) rows (gate_up_rows); in e4m3 each token's amax of it goes into the
    amax workspace for the quantizing GEMM that must follow."""
    (m, k), n = a.shape, b.shape[0]
    cfg = config or config_for(m, n, k, a.device, b.dtype)
    out = torch.empty(m, n // 2 if swiglu else n, dtype=torch.bfloat16, device=a.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, cfg.block_n)
    partial = split_workspace(a.device, (splits - 1) * m * n) if splits > 1 else out
    scaled = b_scale is not None
    quantize_a = scaled and a_scale is None
    out_amax = swiglu and scaled
    _skinny_gemm_kernel[(tiles, splits)](
        a,
        b,
        a_scale if a_scale is not None else a,  # unread without it
        b_scale if scaled else b,
        out,
        partial,
        amax_workspace(a.device) if quantize_a or out_amax else out,  # unread unless either
        m,
        n,
        k,
        k_per_split,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        SCALED=scaled,
        A_PER_TOKEN=a_scale is not None and a_scale.numel() > 1,
        B_PER_CHANNEL=scaled and b_scale.numel() > 1,
        QUANTIZE_A=quantize_a,
        SWIGLU=swiglu,
        OUT_AMAX=out_amax,
        BLOCK_M=m_bucket(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SWAP_AB=cfg.swap_ab,
        EARLY_TILE=int(cfg.early_tile),
        SPLIT=splits > 1,
        SNAP=INTERPRETED,
        UPCAST=INTERPRETED and not scaled,
        PDL=pdl_for(a.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(a.device),
    )
    return out


def skinny_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The Triton kernel for M <= 64 (see the module docstring); `config` overrides the tuned one."""
    _check(a, a_scale, b, b_scale)
    _check_skinny("skinny_fp8_gemm", a, b, swiglu=False)
    return _skinny_gemm(a, b, a_scale, b_scale, config)


def skinny_bf16_gemm(a: torch.Tensor, b: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """The Triton kernel on bf16 operands, A [M <= 64, K] @ B [N, K]^T; `config` overrides the tuned one."""
    _check_bf16(a, b)
    _check_skinny("skinny_bf16_gemm", a, b, swiglu=False)
    return _skinny_gemm(a, b, None, None, config)


def skinny_swiglu_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """bf16 [M <= 64, N / 2] = silu(gate) * up of skinny_fp8_gemm(a, a_scale, b, b_scale) on B's
    interleaved (gate, up) rows and scales (gate_up_rows), in fp32 from the accumulator; each token's
    amax of the stored values is left in the amax workspace, for skinny_quantizing_fp8_gemm, which must
    be the next call to read it."""
    _check(a, a_scale, b, b_scale)
    _check_skinny("skinny_swiglu_fp8_gemm", a, b, swiglu=True)
    return _skinny_gemm(a, b, a_scale, b_scale, config, swiglu=True)


def skinny_swiglu_bf16_gemm(
    a: torch.Tensor, b: torch.Tensor, config: GemmConfig | None = None
) -> torch.Tensor:
    """bf16 [M <= 64, N / 2] = silu(gate) * up of skinny_bf16_gemm(a, b) on B's interleaved (gate, up)
    rows (gate_up_rows), in fp32 from the accumulator."""
    _check_bf16(a, b)
    _check_skinny("skinny_swiglu_bf16_gemm", a, b, swiglu=True)
    return _skinny_gemm(a, b, None, None, config, swiglu=True)


def skinny_quantizing_fp8_gemm(
    a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, config: GemmConfig | None = None
) -> torch.Tensor:
    """skinny_fp8_gemm of the bf16 output `a` [M <= 64, K] of skinny_swiglu_fp8_gemm, quantized per
    token inside the kernel (scale = amax / 448 with the amax that call left in the amax workspace,
    which this one re-arms), @ e4m3 B [N, K] with its scales."""
    if a.dtype != torch.bfloat16 or b.dtype != FP8:
        raise ValueError(
            f"quantizing_fp8_gemm takes bfloat16 A and float8_e4m3fn B, got {a.dtype} and {b.dtype}"
        )
    _check_shapes("quantizing_fp8_gemm", a, b)
    if b_scale.numel() not in (1, b.shape[0]):
        raise ValueError(
            f"b_scale must be per tensor (1) or per row, got {b_scale.numel()} for N={b.shape[0]}"
        )
    _check_skinny("skinny_quantizing_fp8_gemm", a, b, swiglu=False)
    return _skinny_gemm(a, b, None, b_scale, config)


@torch.library.custom_op("weft::fp8_gemm", mutates_args=())
def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """bf16 [M, N] = dequant(A [M, K]) @ dequant(B [N, K])^T: weft's kernel up to M = 64, then
    `torch._scaled_mm` (row-wise scales) on GPU where K and N are multiples of 16 (else our kernel on
    64-row slices). A: e4m3 activations with per-token [M] or per-tensor [1] fp32 scales; B: the
    e4m3 weight [N, K] with per-channel [N] or per-tensor [1] scales (quantize_weight_per_channel)."""
    _check(a, a_scale, b, b_scale)
    if a.shape[0] <= MAX_M:
        return skinny_fp8_gemm(a, a_scale, b, b_scale)
    if a.device.type != "cuda":
        return fp8_gemm_reference(a, a_scale, b, b_scale)
    if a.shape[1] % 16 or b.shape[0] % 16:
        # torch._scaled_mm needs K and N in multiples of 16: run our kernel on 64-row slices.
        per_token = a_scale.numel() > 1
        return torch.cat(
            [
                skinny_fp8_gemm(
                    a[i : i + MAX_M], a_scale[i : i + MAX_M] if per_token else a_scale, b, b_scale
                )
                for i in range(0, a.shape[0], MAX_M)
            ]
        )
    scale_a = a_scale.float().reshape(-1, 1).expand(a.shape[0], 1).contiguous()
    scale_b = b_scale.float().reshape(1, -1).expand(1, b.shape[0]).contiguous()
    return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


@fp8_gemm.register_fake
def _(a, a_scale, b, b_scale):
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)


def fp8_gemm_reference(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    a_scale, b_scale = a_scale.float().reshape(-1, 1), b_scale.float().reshape(1, -1)
    return ((a.float() @ b.float().t()) * a_scale * b_scale).to(torch.bfloat16)


@torch.library.custom_op("weft::bf16_gemm", mutates_args=())
def bf16_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 [M, N] = A [M, K] @ B [N, K]^T (F.linear without bias): weft's kernel up to M = 64, then
    F.linear (cuBLAS on GPU)."""
    _check_bf16(a, b)
    if a.shape[0] <= MAX_M:
        return skinny_bf16_gemm(a, b)
    return F.linear(a, b)


@bf16_gemm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[0])


def bf16_gemm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() @ b.float().t()).to(torch.bfloat16)


@torch.library.custom_op("weft::swiglu_fp8_gemm", mutates_args=())
def swiglu_fp8_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    """skinny_swiglu_fp8_gemm (M <= 64) as an op; its output goes to quantizing_fp8_gemm next."""
    return skinny_swiglu_fp8_gemm(a, a_scale, b, b_scale)


@swiglu_fp8_gemm.register_fake
def _(a, a_scale, b, b_scale):
    return a.new_empty(a.shape[0], b.shape[0] // 2, dtype=torch.bfloat16)


@torch.library.custom_op("weft::quantizing_fp8_gemm", mutates_args=())
def quantizing_fp8_gemm(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """skinny_quantizing_fp8_gemm (M <= 64) as an op: `a` is swiglu_fp8_gemm's output."""
    return skinny_quantizing_fp8_gemm(a, b, b_scale)


@quantizing_fp8_gemm.register_fake
def _(a, b, b_scale):
    return a.new_empty(a.shape[0], b.shape[0])


@torch.library.custom_op("weft::swiglu_bf16_gemm", mutates_args=())
def swiglu_bf16_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """skinny_swiglu_bf16_gemm (M <= 64) as an op."""
    return skinny_swiglu_bf16_gemm(a, b)


@swiglu_bf16_gemm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[0] // 2)
