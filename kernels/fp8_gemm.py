"""Skinny FP8 GEMM for decode: out[M, N] = (A[M, K] * a_scale) @ (B[N, K] * b_scale)^T in bf16, for
M <= 64 tokens, A and B in e4m3, A scaled per token (or per tensor), B per output channel (or per
tensor).

At decode M is tiny, so the time is the time to read B (N * K bytes) once. B is cut into column
tiles of BLOCK_N rows and each tile into K blocks of BLOCK_K. Where there are enough column tiles,
each program takes one. Where there are not (a narrow N: 36 tiles of 64 rows for N = 2304 against
132 SMs), the grid is stream-K: `programs` programs each take an equal contiguous run of the
(tile, K block) units, so every SM streams the same share of B whatever N is. Each program
accumulates [BLOCK_M, BLOCK_N] in fp32 on the tensor cores (M padded to BLOCK_M >= 16 by masking).
With `swap_ab` the kernel computes out^T = B @ A^T instead, so that the weight tile (>= 64 rows) is
the MMA's M side: on Hopper that is wgmma, which reads e4m3 straight from shared memory, where the
unswapped [16, K] x [K, BLOCK_N] tile goes through mma.sync with both operands converted to fp16 in
registers. A run that stops inside a tile leaves its fp32 partial in a per-program slot of a
workspace kept at a sentinel (EMPTY) between calls; the program that ends the tile reads the slots
as they land (each element its own arrival flag), sums them in program order and re-arms them: one
launch, a deterministic result, no zero-fill and no counter round trip.

Tile configs are tuned per (M bucket, N, K) on the GPU by `benchmarks/bench_fp8.py --tune` and kept in
fp8_gemm_configs.json beside this file, so serving never autotunes (triton.autotune would time configs
inside the first call, i.e. inside a CUDA-graph warm-up, and its choice would differ run to run);
untuned shapes use a heuristic. The weight's first K block is loaded before the kernel waits on the
previous one (programmatic dependent launch, kernels.fp8.USE_PDL), so weights must not be written by
the kernel right before the call.
Beyond M = 64 the work is no longer weight-bound and `torch._scaled_mm` takes over.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8, INTERPRETED, downcast, launch_options, pdl_for, pdl_wait, programs_cap

MAX_M = 64
CONFIG_FILE = Path(__file__).with_name("fp8_gemm_configs.json")


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    programs: int = 0  # grid size for stream-K; 0: one program per column tile (no K split)
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = False  # weight tile as the MMA's M side (wgmma on Hopper); needs block_n >= 64


def m_bucket(m: int) -> int:
    """BLOCK_M for M tokens: the tensor-core minimum of 16, else the next power of two."""
    return max(16, triton.next_power_of_2(m))


def heuristic_config(m: int, n: int, k: int, sm_count: int = 132) -> GemmConfig:
    """Swapped tiles of 64 weight rows x 256 of K (wgmma on Hopper); where the column tiles cannot
    fill the GPU twice over, stream-K over two programs per SM."""
    block_n, block_k = 64, 256 if m_bucket(m) <= 32 else 128
    programs = 0 if triton.cdiv(n, block_n) >= 2 * sm_count else 2 * sm_count
    return GemmConfig(block_n, block_k, programs, num_stages=3, swap_ab=True)


def _load_tuned() -> dict[str, GemmConfig]:
    if not CONFIG_FILE.is_file():
        return {}
    return {key: GemmConfig(**value) for key, value in json.loads(CONFIG_FILE.read_text()).items()}


TUNED = _load_tuned()


def config_key(m: int, n: int, k: int) -> str:
    return f"{m_bucket(m)},{n},{k}"


def config_for(m: int, n: int, k: int, sm_count: int = 132) -> GemmConfig:
    return TUNED.get(config_key(m, n, k)) or heuristic_config(m, n, k, sm_count)


def save_tuned(configs: dict[str, GemmConfig]) -> None:
    CONFIG_FILE.write_text(json.dumps({k: asdict(v) for k, v in sorted(configs.items())}, indent=1) + "\n")


@triton.jit
def _weight_block(b_ptr, tile, kb, N, K, stride_bn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] block `kb` along K of the weight's column tile `tile`, zero outside B."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    return tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _activation_block(a_ptr, kb, M, K, stride_am, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K] block `kb` along K of the activations, zero outside A."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    return tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _tile_dot(a_ptr, b_ptr, b, tile, kb_begin, kb_end, M, N, K, stride_am, stride_bn,
              BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB):  # fmt: skip
    """Raw fp32 [BLOCK_M, BLOCK_N] sum over K blocks [kb_begin, kb_end) of column tile `tile`, whose
    first weight block `b` the caller has already loaded."""
    a = _activation_block(a_ptr, kb_begin, M, K, stride_am, BLOCK_M, BLOCK_K)
    if SWAP_AB:
        # out^T = B @ A^T: the weight tile is the MMA's M side (>= 64 rows: Hopper's wgmma, which
        # reads e4m3 straight from shared memory), the few tokens its N side.
        acc_t = tl.dot(b, tl.trans(a), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))
    else:
        acc = tl.dot(a, tl.trans(b), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
    for kb in range(kb_begin + 1, kb_end):
        a = _activation_block(a_ptr, kb, M, K, stride_am, BLOCK_M, BLOCK_K)
        b = _weight_block(b_ptr, tile, kb, N, K, stride_bn, BLOCK_N, BLOCK_K)
        if SWAP_AB:
            acc_t = tl.dot(b, tl.trans(a), acc_t)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if SWAP_AB:
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def _store_tile(acc, tile, a_scale_ptr, b_scale_ptr, out_ptr, M, N, stride_om,
                A_PER_TOKEN, B_PER_CHANNEL, BLOCK_M, BLOCK_N, SNAP):  # fmt: skip
    """Scale a finished [BLOCK_M, BLOCK_N] accumulator of column tile `tile` and store it in bf16."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if A_PER_TOKEN:
        acc = acc * tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    else:
        acc = acc * tl.load(a_scale_ptr)
    if B_PER_CHANNEL:
        acc = acc * tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    else:
        acc = acc * tl.load(b_scale_ptr)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        downcast(acc, out_ptr.dtype.element_ty, SNAP),
        mask=mask,
    )


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
    k_blocks,
    stride_am,
    stride_bn,
    stride_om,
    A_PER_TOKEN: tl.constexpr,
    B_PER_CHANNEL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    STREAM: tl.constexpr,
    PARTS: tl.constexpr,
    SNAP: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    if STREAM:
        # Stream-K: the (column tile, K block) units, tile-major, are cut into one contiguous run per
        # program; run lengths differ by at most one unit, so every program streams the same share
        # of B. A run visits its tiles last first: the head of a tile that later programs end is done
        # first, so its partial lands early, and the tail of the tile this program ends (whose head
        # earlier programs did first) comes last, so the wait for their partials finds them there.
        programs = tl.num_programs(0)
        units = tl.cdiv(N, BLOCK_N) * k_blocks
        start = pid * units // programs
        end = (pid + 1) * units // programs
        first_tile = start // k_blocks
        last_tile = (end - 1) // k_blocks
        # The weight is no earlier kernel's output: its first block streams in before the wait on
        # the previous kernel (PDL), overlapping that kernel's tail; the activations come after it.
        kb_first = tl.maximum(start - last_tile * k_blocks, 0)
        b = _weight_block(b_ptr, last_tile, kb_first, N, K, stride_bn, BLOCK_N, BLOCK_K)
        pdl_wait(PDL, False)
        in_slot = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        for i in range(0, last_tile - first_tile + 1):
            tile = last_tile - i
            kb_begin = tl.maximum(start - tile * k_blocks, 0)
            kb_end = tl.minimum(end - tile * k_blocks, k_blocks)
            acc = _tile_dot(a_ptr, b_ptr, b, tile, kb_begin, kb_end, M, N, K, stride_am, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB)  # fmt: skip
            # The next tile's first block streams in during this one's epilogue.
            kb_next = tl.maximum(start - (tile - 1) * k_blocks, 0)
            n_next = tl.where(tile > first_tile, N, 0)
            b = _weight_block(b_ptr, tile - 1, kb_next, n_next, K, stride_bn, BLOCK_N, BLOCK_K)
            if kb_end < k_blocks:
                # Later programs end this tile: leave the raw partial in this program's slot.
                tl.store(partial_ptr + pid * BLOCK_M * BLOCK_N + in_slot, acc)
            else:
                # Sum the partials of the programs that began this tile, if any. A slot holds EMPTY
                # until its partial lands, so each element is its own arrival flag (one L2 read per
                # partial, no counter). PARTS slots are read at once, so their L2 latencies overlap,
                # and summed in a fixed order (deterministic); reading re-arms them. Those programs
                # have lower ids, so each has started: none waits on a program that cannot start.
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for q in range(((tile * k_blocks + 1) * programs - 1) // units, pid, PARTS):
                    qs = q + tl.arange(0, PARTS)
                    ready = (qs < pid)[:, None, None]
                    ptrs = partial_ptr + qs[:, None, None] * BLOCK_M * BLOCK_N + in_slot[None, :, :]
                    part = tl.load(ptrs, mask=ready, other=0.0, volatile=True)
                    while tl.max(((part.to(tl.int32, bitcast=True) == EMPTY) & ready).to(tl.int32)) > 0:
                        part = tl.load(ptrs, mask=ready, other=0.0, volatile=True)
                    total += tl.sum(part, axis=0)
                    empty = tl.full((PARTS, BLOCK_M, BLOCK_N), EMPTY, tl.int32).to(tl.float32, bitcast=True)
                    tl.store(ptrs, empty, mask=ready)
                _store_tile(total + acc, tile, a_scale_ptr, b_scale_ptr, out_ptr, M, N, stride_om,
                            A_PER_TOKEN, B_PER_CHANNEL, BLOCK_M, BLOCK_N, SNAP)  # fmt: skip
    else:
        # One program per column tile, the whole of K.
        b = _weight_block(b_ptr, pid, 0, N, K, stride_bn, BLOCK_N, BLOCK_K)
        pdl_wait(PDL, False)
        acc = _tile_dot(a_ptr, b_ptr, b, pid, 0, k_blocks, M, N, K, stride_am, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB)  # fmt: skip
        _store_tile(acc, pid, a_scale_ptr, b_scale_ptr, out_ptr, M, N, stride_om,
                    A_PER_TOKEN, B_PER_CHANNEL, BLOCK_M, BLOCK_N, SNAP)  # fmt: skip


# A NaN bit pattern no arithmetic produces (a generated NaN is 0x7FC00000 or 0xFFC00000).
EMPTY: tl.constexpr = tl.constexpr(0x7FC0DEAD)
_WORKSPACES: dict[torch.device, list[torch.Tensor]] = {}


def stream_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """The fp32 stream-K partials workspace of `device`, at least `numel` long and EMPTY wherever no
    call is in flight (every call re-arms what it read). Grown outside CUDA-graph capture only, and a
    grown-out workspace is kept alive: graphs captured earlier still point at it. Calls on concurrent
    streams must not share it."""
    workspaces = _WORKSPACES.setdefault(device, [])
    if not workspaces or workspaces[-1].numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the stream-K workspace needs {numel} floats while a CUDA graph is being captured: "
                "run the same call once before capture (a warm-up call) so it is allocated outside"
            )
        size = max(numel, 1 << 20, 2 * (workspaces[-1].numel() if workspaces else 0))
        workspaces.append(
            torch.full((size,), EMPTY.value, dtype=torch.int32, device=device).view(torch.float32)
        )
    return workspaces[-1]


def _check(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> None:
    if a.dtype != FP8 or b.dtype != FP8:
        raise ValueError(f"fp8_gemm takes float8_e4m3fn operands, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm needs A [M, K] and B [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("fp8_gemm needs A and B contiguous along K")
    if a_scale.numel() not in (1, a.shape[0]) or b_scale.numel() not in (1, b.shape[0]):
        raise ValueError(
            f"scales must be per tensor (1) or per row: a_scale has {a_scale.numel()} for M={a.shape[0]}, "
            f"b_scale has {b_scale.numel()} for N={b.shape[0]}"
        )


def skinny_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The Triton kernel for M <= 64 (see the module docstring); `config` overrides the tuned one."""
    _check(a, a_scale, b, b_scale)
    (m, k), n = a.shape, b.shape[0]
    if m > MAX_M:
        raise ValueError(f"skinny_fp8_gemm handles M <= {MAX_M}, got M={m}: use fp8_gemm")
    cfg = config or config_for(m, n, k, programs_cap(a.device))
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    tiles, k_blocks = triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k)
    # At most one program per unit, so that every program has a run and every partial lands.
    programs = min(cfg.programs or tiles, tiles * k_blocks)
    stream = programs != tiles
    block_m = m_bucket(m)
    # Partials the program ending a tile reads at once: as many as can precede it (runs are at least
    # units // programs long), within 64 fp32 registers per thread.
    most_parts = triton.next_power_of_2(triton.cdiv(k_blocks, (tiles * k_blocks) // programs))
    parts = max(1, min(most_parts, 64 * 32 * cfg.num_warps // (block_m * cfg.block_n)))
    partial = stream_workspace(a.device, programs * block_m * cfg.block_n) if stream else out
    _skinny_gemm_kernel[(programs,)](
        a,
        b,
        a_scale,
        b_scale,
        out,
        partial,
        m,
        n,
        k,
        k_blocks,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        A_PER_TOKEN=a_scale.numel() > 1,
        B_PER_CHANNEL=b_scale.numel() > 1,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SWAP_AB=cfg.swap_ab,
        STREAM=stream,
        PARTS=parts,
        SNAP=INTERPRETED,
        PDL=pdl_for(a.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(a.device),
    )
    return out


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
