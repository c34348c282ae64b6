"""Skinny GEMM for decode, FP8 or bf16: out[M, N] = (A[M, K] * a_scale) @ (B[N, K] * b_scale)^T in bf16,
for M <= 64 tokens, A and B in e4m3, A scaled per token, per token and group of K (the decode
attention's output: one scale per kv head's slice of the row) or per tensor, B per output channel (or
per tensor); or A and B in bf16 without scales (`bf16_gemm`, the bf16 decode path's linear layers). One
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
one launch, a deterministic result, no zero-fill and no counter round trip. Where the product goes
straight into an add + RMSNorm (the decode step's wo and w2), `fp8_gemm_partials` / `bf16_gemm_partials`
leave every slice's fp32 partial unsummed and that kernel sums them as it loads its input, which takes
the last slice's wait and L2 round trip off the end of the call.

Hopper's e4m3 wgmma does not keep a full fp32 sum across a chain of instructions: left to run over
all of K, all-positive operands came out 4-19% low at K = 4096-16384 on H200 (torch._scaled_mm:
0.2% off). So each K tile's dot starts from zero and is added to the accumulator in fp32 registers,
which brings the error to torch._scaled_mm's. (Triton's own promotion, `max_num_imprecise_acc`,
adds inside the MMA chain, and ptxas then serializes every wgmma of the kernel: up to 35% slower at
M = 64; fp8-notes.md.)

A scaled per token and group of K: each K tile's dot is multiplied by its group's scales as it is
added (the tile shrunk to fit inside a group). That costs nothing measurable: the FP8 decode step's
GEMMs took 2174 us before and 2172 us after its wo took the attention's per-kv-head scales (one H200,
batch 1, compiled, PDL off, decode_profile, two runs).

Tile configs are tuned per GPU model and (M bucket, N, K) by `benchmarks/bench_fp8.py --tune` and kept in
fp8_gemm_configs.json beside this file, so serving never autotunes (triton.autotune would time configs
inside the first call, i.e. inside a CUDA-graph warm-up, and its choice would differ run to run). A GPU
model with no configs of its own uses the reference GPU's (REFERENCE_GPU); untuned shapes use a
heuristic. The weight's scales, and in most configs its first K tile, are loaded before the kernel
waits on the previous one (programmatic dependent launch, kernels.fp8.USE_PDL): weights and their
scales must not be written by the kernel right before the call.
Beyond M = 64 the work is no longer weight-bound and `torch._scaled_mm` (bf16: F.linear) takes over.

bf16 wgmma keeps a full fp32 sum, so bf16 alone would not need the per-tile restart; the kernel keeps the
same loop for both dtypes, so that one pipeline is tuned and tested.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8 import (
    FP8,
    INTERPRETED,
    check_one_device,
    dequantize,
    downcast,
    launch_options,
    pdl_for,
    pdl_wait,
    programs_cap,
    quantize_reference,
)
from kernels.workspace import Workspaces, persistent_workspace

MAX_M = 64
# The smallest group of K with a scale of its own that the kernel takes (e4m3 wgmma's K step, and the
# K tile is shrunk to fit the group): A scaled in smaller groups is re-quantized per token first.
MIN_A_GROUP = 32
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
def _group_scale(a_scale_ptr, offs_m, M, k0, K, A_GROUP: tl.constexpr):
    """The scales [BLOCK_M] of the A group holding K index k0 (0 past M or K: padding rows and tiles)."""
    ptrs = a_scale_ptr + offs_m * (K // A_GROUP) + k0 // A_GROUP
    return tl.load(ptrs, mask=(offs_m < M) & (k0 < K), other=0.0)


@triton.jit
def _scale_tokens(part, scale, A_GROUP: tl.constexpr, SWAP_AB: tl.constexpr):
    """A K tile's dot times its A group's scales [BLOCK_M] along the token axis (1 when swapped);
    as it is without groups."""
    if A_GROUP:
        if SWAP_AB:
            part *= scale[None, :]
        else:
            part *= scale[:, None]
    return part


@triton.jit
def _skinny_gemm_kernel(
    a_ptr,
    b_ptr,
    a_scale_ptr,
    b_scale_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_am,
    stride_bn,
    stride_om,
    SCALED: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    A_GROUP: tl.constexpr,
    B_PER_CHANNEL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    EARLY_TILE: tl.constexpr,
    SPLIT: tl.constexpr,
    PARTIALS: tl.constexpr,
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
    if EARLY_TILE:
        a_first = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
    if SCALED:
        if A_GROUP:  # [M, K / A_GROUP]: each K tile lies in one group, scaled as its dot is added
            a_scale = 1.0
            if EARLY_TILE:
                a_first_scale = _group_scale(a_scale_ptr, offs_m, M, pid_k * k_per_split, K, A_GROUP)
        elif A_PER_TOKEN:
            a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
        else:
            a_scale = tl.load(a_scale_ptr)
    if SWAP_AB:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(EARLY_TILE, tl.cdiv(k_per_split, BLOCK_K)):
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        offs_k += BLOCK_K
        in_k = offs_k[None, :] < K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & in_k, other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[:, None] < N) & in_k, other=0.0)
        if A_GROUP:
            group_scale = _group_scale(a_scale_ptr, offs_m, M, pid_k * k_per_split + i * BLOCK_K, K, A_GROUP)
        else:
            group_scale = 1.0
        if SWAP_AB:
            # out^T = B @ A^T: the weight tile is the MMA's M side (>= 64 rows: Hopper's wgmma, which
            # reads e4m3 and bf16 straight from shared memory), the few tokens its N side.
            acc_t += _scale_tokens(_tile_dot(b, tl.trans(a), UPCAST), group_scale, A_GROUP, SWAP_AB)
        else:
            acc += _scale_tokens(_tile_dot(a, tl.trans(b), UPCAST), group_scale, A_GROUP, SWAP_AB)
    if EARLY_TILE and not A_GROUP:
        a_first_scale = 1.0
    if SWAP_AB:
        if EARLY_TILE:
            acc_t += _scale_tokens(
                _tile_dot(b_first, tl.trans(a_first), UPCAST), a_first_scale, A_GROUP, SWAP_AB
            )
        acc = tl.trans(acc_t)
    elif EARLY_TILE:
        acc += _scale_tokens(_tile_dot(a_first, tl.trans(b_first), UPCAST), a_first_scale, A_GROUP, SWAP_AB)
    if SCALED:
        acc = acc * a_scale * b_scale
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if not SPLIT:
        tl.store(out_ptrs, downcast(acc, out_ptr.dtype.element_ty, SNAP), mask=mask)
    else:
        splits = tl.num_programs(1)
        tile = offs_m[:, None] * N + offs_n[None, :]
        if PARTIALS or pid_k < splits - 1:
            # PARTIALS: every slice's partial is the output, summed by the kernel that reads it.
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
            tl.store(out_ptrs, downcast(total + acc, out_ptr.dtype.element_ty, SNAP), mask=mask)


# A NaN bit pattern no arithmetic produces (a generated NaN is 0x7FC00000 or 0xFFC00000).
EMPTY: tl.constexpr = tl.constexpr(0x7FC0DEAD)
_WORKSPACES: Workspaces = {}


def split_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """The fp32 split-K partials workspace of `device`, at least `numel` long and EMPTY wherever no
    call is in flight (every call re-arms what it read): kernels.workspace.persistent_workspace."""
    return persistent_workspace(
        _WORKSPACES, device, numel, EMPTY.value, 1 << 20, "split-K workspace", dtype=torch.float32
    )


def _check(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> None:
    """Refuse what no path can compute; also run by the ops' fake implementations (check_one_device)."""
    check_one_device(a=a, a_scale=a_scale, b=b, b_scale=b_scale)
    if a.dtype != FP8 or b.dtype != FP8:
        raise ValueError(f"fp8_gemm takes float8_e4m3fn operands, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm needs A [M, K] and B [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("fp8_gemm needs A and B contiguous along K")
    (m, k), groups = a.shape, a_groups(a_scale)
    if groups > 1 and (a_scale.shape[0] != m or k % groups or not a_scale.is_contiguous()):
        raise ValueError(
            f"a_scale per token and group of K must be a contiguous [M, G] with G dividing K: got "
            f"{tuple(a_scale.shape)} for A of shape {tuple(a.shape)}"
        )
    if (groups == 1 and a_scale.numel() not in (1, m)) or b_scale.numel() not in (1, b.shape[0]):
        raise ValueError(
            f"scales must be per tensor (1) or per row (a_scale may also be [M, G], per token and group "
            f"of K): a_scale has {a_scale.numel()} for M={m}, b_scale has {b_scale.numel()} for "
            f"N={b.shape[0]}"
        )
    # The kernel reads per-row scales at consecutive addresses: a strided view (a column of a wider
    # tensor) would be read as other rows' scales.
    if not (a_scale.is_contiguous() and b_scale.is_contiguous()):
        raise ValueError(
            f"fp8_gemm needs contiguous scales, got a_scale strides {a_scale.stride()} and b_scale "
            f"strides {b_scale.stride()}: pass .contiguous() copies"
        )


def a_groups(a_scale: torch.Tensor) -> int:
    """Groups of K that A's scales split each row into: G for [M, G] scales (G > 1), else 1."""
    return a_scale.shape[1] if a_scale.dim() == 2 else 1


def requantize_per_token(a: torch.Tensor, a_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A scaled per token and group of K re-quantized with one scale per token (others as they are)."""
    if a_groups(a_scale) == 1:
        return a, a_scale
    return quantize_reference(dequantize(a, a_scale))


def _check_bf16(a: torch.Tensor, b: torch.Tensor) -> None:
    check_one_device(a=a, b=b)
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise ValueError(f"bf16_gemm takes bfloat16 operands, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"bf16_gemm needs A [M, K] and B [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("bf16_gemm needs A and B contiguous along K")


def _plan(
    m: int, n: int, k: int, group: int, config: GemmConfig | None, device: torch.device, dtype: torch.dtype
) -> tuple[GemmConfig, int, int]:
    """(config, K elements per split, splits) of a launch; `group`: K elements per A scale group (0:
    none), inside which each K tile must lie."""
    cfg = config or config_for(m, n, k, device, dtype)
    if group:
        # Each K tile must lie in one group: halve the tile until it divides the group.
        block_k = cfg.block_k
        while group % block_k:
            block_k //= 2
        cfg = replace(cfg, block_k=block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return cfg, k_per_split, triton.cdiv(k, k_per_split)


def _skinny_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor | None,
    config: GemmConfig | None,
    partials: bool = False,
) -> torch.Tensor:
    """Launch the kernel on checked operands: e4m3 with their scales, or bf16 with None for both.
    bf16 [M, N]; with `partials`, the split-K slices' fp32 partials [splits, M, N] unsummed."""
    (m, k), n = a.shape, b.shape[0]
    if m > MAX_M:
        raise ValueError(f"the skinny GEMM handles M <= {MAX_M}, got M={m}: use fp8_gemm or bf16_gemm")
    out_dtype = torch.float32 if partials else torch.bfloat16
    if m == 0:
        # No rows: an empty per-token a_scale would be taken for a per-tensor one and read unmasked
        # (a segfault in the interpreter, an illegal address on the GPU).
        return torch.empty(*(1,) * partials, 0, n, dtype=out_dtype, device=a.device)
    if k == 0 or n == 0:
        # An empty sum over K is zero; no K or no columns would also leave the split arithmetic nothing
        # to divide.
        return torch.zeros(*(1,) * partials, m, n, dtype=out_dtype, device=a.device)
    group = k // a_groups(a_scale) if a_scale is not None and a_groups(a_scale) > 1 else 0
    cfg, k_per_split, splits = _plan(m, n, k, group, config, a.device, a.dtype)
    out = torch.empty(*(splits,) * partials, m, n, dtype=out_dtype, device=a.device)
    tiles = triton.cdiv(n, cfg.block_n)
    # The other slices' partials: the output itself, or the workspace the last slice sums them from.
    exchange = splits > 1 and not partials
    partial = split_workspace(a.device, (splits - 1) * m * n) if exchange else out
    scaled = a_scale is not None and b_scale is not None
    _skinny_gemm_kernel[(tiles, splits)](
        a,
        b,
        a_scale if scaled else a,  # unread without scales
        b_scale if scaled else b,
        out,
        partial,
        m,
        n,
        k,
        k_per_split,
        a.stride(0),
        b.stride(0),
        n,
        SCALED=scaled,
        A_PER_TOKEN=scaled and a_scale.numel() > 1,
        A_GROUP=group,
        B_PER_CHANNEL=scaled and b_scale.numel() > 1,
        BLOCK_M=m_bucket(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SWAP_AB=cfg.swap_ab,
        EARLY_TILE=int(cfg.early_tile),
        SPLIT=splits > 1,
        PARTIALS=partials,
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
    partials: bool = False,
) -> torch.Tensor:
    """The Triton kernel for M <= 64 (see the module docstring); `config` overrides the tuned one (with
    A scaled per group of K, its block_k shrunk to divide the group); `partials` as fp8_gemm_partials."""
    _check(a, a_scale, b, b_scale)
    if a.shape[0] > MAX_M:
        raise ValueError(f"skinny_fp8_gemm handles M <= {MAX_M}, got M={a.shape[0]}: use fp8_gemm")
    if _requantized(a, a_scale):
        a, a_scale = requantize_per_token(a, a_scale)
    return _skinny_gemm(a, b, a_scale, b_scale, config, partials)


def _requantized(a: torch.Tensor, a_scale: torch.Tensor) -> bool:
    """Whether the skinny kernel takes A re-quantized per token: groups of K below MIN_A_GROUP."""
    return a_groups(a_scale) > 1 and a.shape[1] // a_groups(a_scale) % MIN_A_GROUP != 0


def skinny_bf16_gemm(
    a: torch.Tensor, b: torch.Tensor, config: GemmConfig | None = None, partials: bool = False
) -> torch.Tensor:
    """The Triton kernel on bf16 operands, A [M <= 64, K] @ B [N, K]^T; `config` overrides the tuned one;
    `partials` as bf16_gemm_partials."""
    _check_bf16(a, b)
    if a.shape[0] > MAX_M:
        raise ValueError(f"skinny_bf16_gemm handles M <= {MAX_M}, got M={a.shape[0]}: use bf16_gemm")
    return _skinny_gemm(a, b, None, None, config, partials)


def partial_count(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor) -> int:
    """The slices fp8_gemm_partials (a_scale None: bf16_gemm_partials) leaves: the tuned split of K at
    M <= 64, else 1. What its caller passes it as `slices`."""
    (m, k), n = a.shape, b.shape[0]
    if not (0 < m <= MAX_M and k and n):
        return 1
    grouped = a_scale is not None and a_groups(a_scale) > 1 and not _requantized(a, a_scale)
    return _slice_count(m, n, k, k // a_groups(a_scale) if grouped else 0, a.device, a.dtype)


# torch.compile runs it while tracing and writes its result into the graph as a constant: the graphs
# inductor caches on disk then differ where the configs (fp8_gemm_configs.json, a new tune) split K
# differently, and a graph traced under other configs is never replayed with the op's output shape wrong.
@torch.compiler.assume_constant_result
def _slice_count(m: int, n: int, k: int, group: int, device: torch.device, dtype: torch.dtype) -> int:
    return _plan(m, n, k, group, None, device, dtype)[2]


def _check_slices(slices: int, a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor) -> None:
    expected = partial_count(a, a_scale, b)
    if slices != expected:
        raise ValueError(
            f"asked for {slices} split-K partials of a [{a.shape[0]}, {a.shape[1]}] @ [{b.shape[1]}, "
            f"{b.shape[0]}] GEMM whose config splits K into {expected}: pass partial_count(...) (the GEMM "
            "configs changed since the caller computed it)"
        )


@torch.library.custom_op("weft::fp8_gemm", mutates_args=())
def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """bf16 [M, N] = dequant(A [M, K]) @ dequant(B [N, K])^T: weft's kernel up to M = 64, then
    `torch._scaled_mm` (row-wise scales) on GPU where K and N are multiples of 16 (else our kernel on
    64-row slices). A: e4m3 activations with per-token [M], per token and group of K [M, G] (G groups
    of K / G elements: re-quantized per token past M = 64) or per-tensor [1] fp32 scales; B: the e4m3
    weight [N, K] with per-channel [N] or per-tensor [1] scales (quantize_weight_per_channel)."""
    _check(a, a_scale, b, b_scale)
    if a.shape[0] <= MAX_M:
        return skinny_fp8_gemm(a, a_scale, b, b_scale)
    if a.shape[1] == 0:  # an empty sum (the skinny launcher returns its own; torch._scaled_mm's is untested)
        return torch.zeros(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
    if a.device.type != "cuda":
        return fp8_gemm_reference(a, a_scale, b, b_scale)
    a, a_scale = requantize_per_token(a, a_scale)
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
    _check(a, a_scale, b, b_scale)
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)


# Split-K partials for the kernel that reads the product: the skinny kernel's slices each store their fp32
# partial and end, where fp8_gemm's last slice waits for the others' and sums them (one more L2 round trip
# at the end of the call, 0.6-1.6 us). add_rmsnorm / add_rmsnorm_fp8 sum them in slice order as they load
# x, rounding to bf16 as this kernel would: the same values, bit for bit.
@torch.library.custom_op("weft::fp8_gemm_partials", mutates_args=())
def fp8_gemm_partials(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, slices: int
) -> torch.Tensor:
    """fp8_gemm's product as fp32 partials [slices, M, N] whose sum in slice order, rounded to bf16, is
    fp8_gemm's output; `slices` must be partial_count(a, a_scale, b) (1 past M = 64), so that the
    output's shape is known from the arguments (the fake implementation reads no config)."""
    _check(a, a_scale, b, b_scale)
    _check_slices(slices, a, a_scale, b)
    if a.shape[0] <= MAX_M:
        return skinny_fp8_gemm(a, a_scale, b, b_scale, partials=True)
    return fp8_gemm(a, a_scale, b, b_scale).float().unsqueeze(0)


@fp8_gemm_partials.register_fake
def _(a, a_scale, b, b_scale, slices):
    _check(a, a_scale, b, b_scale)
    return a.new_empty(slices, a.shape[0], b.shape[0], dtype=torch.float32)


def fp8_gemm_reference(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    return (dequantize(a, a_scale) @ b.float().t() * b_scale.float().reshape(1, -1)).to(torch.bfloat16)


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
    _check_bf16(a, b)
    return a.new_empty(a.shape[0], b.shape[0])


@torch.library.custom_op("weft::bf16_gemm_partials", mutates_args=())
def bf16_gemm_partials(a: torch.Tensor, b: torch.Tensor, slices: int) -> torch.Tensor:
    """bf16_gemm's product as fp32 partials [slices, M, N], as fp8_gemm_partials (slices:
    partial_count(a, None, b))."""
    _check_bf16(a, b)
    _check_slices(slices, a, None, b)
    if a.shape[0] <= MAX_M:
        return skinny_bf16_gemm(a, b, partials=True)
    return F.linear(a, b).float().unsqueeze(0)


@bf16_gemm_partials.register_fake
def _(a, b, slices):
    _check_bf16(a, b)
    return a.new_empty(slices, a.shape[0], b.shape[0], dtype=torch.float32)


def bf16_gemm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() @ b.float().t()).to(torch.bfloat16)
