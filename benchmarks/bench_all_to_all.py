"""Ulysses all-to-all bandwidth: weft's kernel (kernels/all_to_all.py) against the stock path
(permute + `all_to_all_single` + permute) and the bare `all_to_all_single` on a contiguous buffer,
plus one Ulysses attention layer on each path.

    torchrun --nproc_per_node=4 benchmarks/bench_all_to_all.py [--seqs 32768 131072] [--heads 32 8]

Shapes: B=1, D=128, bf16, S the global sequence, H query heads with H/4 key/value heads (GQA; fewer kv
heads than ranks are replicated by the exchange). Rows:
* `seq_to_heads q`: q alone; `seq_to_heads qkv`: q, k, v in one call (ours: one launch); `heads_to_seq o`:
  the way back for the attention output. Inputs are the model's [B, H, S/W, D] transpose views.
* `bare`: `all_to_all_single` on a contiguous buffer of the same bytes (no layout change).
GB/s per rank = bytes leaving a rank / time (the (W-1)/W of the exchanged data that goes to peers).
Times are GPU time, as in training where the host queues ahead: ours, stock and bare interleaved in
rounds, each call queued behind a GPU sleep (`time_ranks_interleaved`), CUDA events, the slowest rank's
median; the host's time to queue one call is given beside it.
Attention: SDPA (causal, flash) at S=32768 wrapped in Ulysses on the torch and the triton path, forward
and forward+backward milliseconds. Rank 0 writes benchmarks/results/all_to_all-<device>.{json,md}.
Before timing, every case checks ours == stock exactly and says so.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import init_gpu_ranks, positive, time_ranks_interleaved, write_results
from kernels.all_to_all import (
    DEFAULT_TIMEOUT_S,
    FLAG_BYTES,
    check,
    heads_to_seq,
    heads_to_seq_reference,
    image_layout,
    launch_all_to_all,
    new_output,
    output_shape,
    prepare,
    push_block,
    replicate_heads,
    schedule,
    seq_to_heads,
    seq_to_heads_reference,
    vector_strides,
)
from kernels.symm_mem import MAX_PROGRAMS, SymmBuffer
from report import markdown_table

DIM = 128
DTYPE = torch.bfloat16


def exchange_rows(seq: int, heads: int, world: int, rank: int, iters: int) -> list[dict]:
    local = seq // world
    torch.manual_seed(rank)
    q, k, v = (
        torch.randn(1, local, h, DIM, device="cuda", dtype=DTYPE).transpose(1, 2)
        for h in (heads, max(1, heads // 4), max(1, heads // 4))
    )
    o = torch.randn(1, heads // world, seq, DIM, device="cuda", dtype=DTYPE)
    cases = {
        "seq_to_heads q": ([q], seq_to_heads, seq_to_heads_reference),
        "seq_to_heads qkv": ([q, k, v], seq_to_heads, seq_to_heads_reference),
        "heads_to_seq o": ([o], heads_to_seq, heads_to_seq_reference),
    }
    rows = []
    for name, (xs, ours, stock) in cases.items():
        exact = all(torch.equal(a, b) for a, b in zip(ours(xs), stock(xs), strict=True))
        torch.cuda.synchronize()
        check()
        flag = torch.tensor([0 if exact else 1], device="cuda")
        dist.all_reduce(flag)
        if rank == 0:
            print(f"S={seq} H={heads} {name}: ours == stock on every rank: {flag.item() == 0}", flush=True)
        # Elements a rank exchanges (replicated kv heads counted once per receiving rank); (W-1)/W leave.
        total = sum(replicate_heads(x, world).numel() for x in xs) if ours is seq_to_heads else o.numel()
        nbytes = total * o.element_size() * (world - 1) // world
        flat = torch.randn(total, device="cuda", dtype=DTYPE)
        times = time_ranks_interleaved(
            {
                "ours": lambda xs=xs, f=ours: f(xs),
                "stock": lambda xs=xs, f=stock: f(xs),
                "bare": partial(dist.all_to_all_single, torch.empty_like(flat), flat),
            },
            iters,
        )
        check()
        ms = {key: t.gpu_ms for key, t in times.items()}
        gbs = {key: nbytes / (t * 1e-3) / 1e9 for key, t in ms.items()}
        rows.append(
            {
                "S": seq,
                "H": heads,
                "case": name,
                "MiB leaving": nbytes / 2**20,
                "ours ms": ms["ours"],
                "stock ms": ms["stock"],
                "bare a2a ms": ms["bare"],
                "ours GB/s": gbs["ours"],
                "stock GB/s": gbs["stock"],
                "bare a2a GB/s": gbs["bare"],
                "stock / ours": ms["stock"] / ms["ours"],
                "ours host us": times["ours"].host_ms * 1e3,
                "stock host us": times["stock"].host_ms * 1e3,
                "exact on every rank": flag.item() == 0,
            }
        )
        if rank == 0:
            print(rows[-1], flush=True)
    return rows


@triton.jit
def _pushes_only_kernel(
    ins, strides, outs, image_offsets, buf_ptrs, image, n_rows, seq_local, block_rows,
    HEADS: tl.constexpr, REPS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
    HEAD_DIM: tl.constexpr, VEC: tl.constexpr, TILE: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    """The kernel's pushes (and own rows) of seq_to_heads with its chunk schedule, without the copy-out
    and the flags: the floor of its design on this node. Writes the peers' image 0 (results unused)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for k in range(tl.cdiv(tl.cdiv(n_rows, block_rows) - pid, nprog)):
        push_block(
            ins, strides, outs, image_offsets, buf_ptrs, image, (k * nprog + pid) * block_rows, block_rows,
            n_rows, seq_local, HEADS, REPS, RANK, WORLD, HEAD_DIM, VEC, True, TILE, ROTATE,
        )  # fmt: skip


def pushes_only(
    buf: SymmBuffer,
    xs: list[torch.Tensor],
    outs: list[torch.Tensor],
    programs: int,
    warps: int,
    chunks: int,
    rotate_peers: bool,
) -> None:
    """Launch `_pushes_only_kernel` on seq_to_heads inputs `xs` with the launcher's schedule."""
    world = buf.world_size
    n_rows = xs[0].shape[0] * xs[0].shape[2]
    heads = tuple(o.shape[1] for o in outs)
    row_bytes = world * DIM * DTYPE.itemsize * sum(heads)
    block_rows, grid = schedule(n_rows, row_bytes, programs, chunks)
    offsets, _ = image_layout([o.shape for o in outs], DTYPE.itemsize)
    _pushes_only_kernel[(grid,)](
        tuple(xs), tuple(vector_strides(x) for x in xs), tuple(outs), tuple(offsets), buf.buffer_ptrs_dev,
        buf.base_offset + FLAG_BYTES.value, n_rows, xs[0].shape[2], block_rows, HEADS=heads,
        REPS=tuple(o.shape[1] * world // x.shape[1] for x, o in zip(xs, outs, strict=True)), RANK=buf.rank,
        WORLD=world, HEAD_DIM=DIM, VEC=16 // DTYPE.itemsize, TILE=8192, ROTATE=rotate_peers, num_warps=warps,
    )  # fmt: skip


def launch_sweep(seq: int, heads: int, world: int, rank: int, iters: int) -> list[dict]:
    """q, k, v seq_to_heads through the launcher alone (outputs allocated once) at several pipeline
    depths (chunks per program), programs per SM, warps per program and peer orders (rank + 1 first,
    or rotated per program): the source of TARGET_CHUNKS and the launch defaults in
    kernels/all_to_all.py. Beside them the same pushes alone (`pushes_only`: no copy-out, no flags),
    the floor of the kernel's design."""
    torch.manual_seed(rank)
    xs = [
        torch.randn(1, seq // world, h, DIM, device="cuda", dtype=DTYPE).transpose(1, 2)
        for h in (heads, max(1, heads // 4), max(1, heads // 4))
    ]
    outs = [new_output(output_shape(x.shape, world, True), True, x) for x in xs]
    _, image_bytes = image_layout([o.shape for o in outs], DTYPE.itemsize)
    buf = prepare(dist.group.WORLD, image_bytes)
    nbytes = sum(replicate_heads(x, world).numel() for x in xs) * DTYPE.itemsize * (world - 1) // world
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    rows = []
    launches = [("all-to-all", per_sm, warps) for per_sm, warps in ((1, 8), (1, 16), (2, 4), (2, 8))]
    launches += [("pushes only", 1, 8), ("pushes only", 1, 16)]
    for (kernel, per_sm, warps), rotate in itertools.product(launches, (False, True)):
        programs = min(per_sm * sms, MAX_PROGRAMS.value)
        for chunks in (2, 4, 8, 16):
            if kernel == "pushes only":
                run = partial(pushes_only, buf, xs, outs, programs, warps, chunks, rotate)
            else:
                run = partial(
                    launch_all_to_all, buf, xs, outs, True, int(DEFAULT_TIMEOUT_S * 1e9),
                    num_warps=warps, max_programs=programs, chunks=chunks, rotate_peers=rotate,
                )  # fmt: skip
            ms = time_ranks_interleaved({"run": run}, iters)["run"].gpu_ms
            rows.append(
                {
                    "S": seq, "H": heads, "kernel": kernel, "programs": programs, "warps": warps,
                    "peers": "rotated" if rotate else "rank + 1 first", "chunks per program": chunks,
                    "ms": ms, "GB/s": nbytes / ms / 1e6,
                }
            )  # fmt: skip
            if rank == 0:
                print(rows[-1], flush=True)
    check()
    return rows


def attention_rows(seq: int, heads: int, world: int, rank: int, iters: int) -> list[dict]:
    from model.llama import sdpa_attention
    from parallel.comm import make_comm
    from parallel.ulysses import ulysses_attention

    group = dist.group.WORLD
    local = seq // world
    torch.manual_seed(rank)
    base = [
        torch.randn(1, local, h, DIM, device="cuda", dtype=DTYPE)
        for h in (heads, max(1, heads // 4), max(1, heads // 4))
    ]
    leaves = [b.requires_grad_() for b in base]
    grad = torch.randn(1, heads, local, DIM, device="cuda", dtype=DTYPE)
    fns = {}
    for path in ("torch", "triton"):
        attn = ulysses_attention(sdpa_attention, group, make_comm(path, group))

        def forward(attn=attn):
            with torch.no_grad():
                return attn(*(t.transpose(1, 2) for t in leaves), None)

        def forward_backward(attn=attn):
            out = attn(*(t.transpose(1, 2) for t in leaves), None)
            out.backward(grad)

        fns[path, "fwd"], fns[path, "fwd+bwd"] = forward, forward_backward
    times = time_ranks_interleaved(fns, iters)
    check()
    rows = [
        {
            "S": seq,
            "H": heads,
            "case": f"attention layer, {path} path",
            "fwd ms": times[path, "fwd"].gpu_ms,
            "fwd+bwd ms": times[path, "fwd+bwd"].gpu_ms,
        }
        for path in ("torch", "triton")
    ]
    if rank == 0:
        print(rows, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=positive, nargs="+", default=[32768, 131072])
    p.add_argument("--heads", type=positive, nargs="+", default=[32, 8])
    p.add_argument("--attention-seq", type=positive, default=32768)
    p.add_argument("--iters", type=positive, default=30)
    args = p.parse_args()

    init_gpu_ranks()
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{world} ranks on {torch.cuda.get_device_name()}", flush=True)

    rows = []
    for seq in args.seqs:
        for heads in args.heads:
            rows += exchange_rows(seq, heads, world, rank, args.iters)
            torch.cuda.empty_cache()
    # Every head count: at few heads the rows are narrow and MIN_CHUNK_BYTES, not the depth, sets the chunks.
    sweep = []
    for heads in args.heads:
        sweep += launch_sweep(min(args.seqs), heads, world, rank, args.iters)
    attention = attention_rows(args.attention_seq, max(args.heads), world, rank, max(5, args.iters // 3))

    if rank == 0:
        notes = (
            f"B=1 D={DIM} bf16 over {world} GPUs, S the global sequence, H query heads and H/4 kv heads. "
            "ours: kernels/all_to_all.py (SM stores into the destination's symmetric buffer at the final "
            "offset, pipelined copy-out; q, k, v in one launch); stock: permute + all_to_all_single (NCCL) "
            "+ permute; bare: all_to_all_single on a contiguous buffer of the same bytes. GB/s per rank = "
            "bytes leaving a rank / time; ms = GPU time, the slowest rank's median of calls queued behind a "
            "GPU sleep and an all-reduce of one word that aligns the ranks, the three paths interleaved; "
            "host us: the host's time to queue one call. Attention: SDPA causal in Ulysses on each comm "
            "path. Command: torchrun --nproc_per_node="
            f"{world} benchmarks/bench_all_to_all.py"
        )
        notes += "\n\nOne Ulysses attention layer (SDPA causal, bf16):\n\n" + markdown_table(attention)
        notes += "\nLaunch sweep, q/k/v seq_to_heads, launcher only:\n\n" + markdown_table(sweep)
        write_results("all_to_all", rows, notes)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
