"""Decode all-reduce latency: weft's one-shot / two-shot, their push variants and auto against NCCL
and PyTorch's own symmetric-memory ops, each timed as replays of a CUDA graph of many back-to-back
calls.

    torchrun --nproc_per_node=4 -m benchmarks.bench_all_reduce [--sweep] [--dtype bf16]

Every rank times every implementation; the figure reported is the slowest rank's median (a
collective is as slow as its slowest member). Rank 0 writes benchmarks/results/all_reduce-<device>.md
and .json and a latency-vs-size plot (.png). `--sweep` also times every (num_warps, programs) launch
of the four kernels and writes all_reduce_sweep-<device>.*: the source of the launch tables and of the
size ranges of AUTO_ALGORITHMS in kernels/custom_all_reduce.py (its best row per size and algorithm
is printed as it goes).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    RESULTS_DIR,
    device_name,
    init_gpu_ranks,
    positive,
    pyplot,
    slowest,
    time_graph,
    write_results,
)
from kernels.all_reduce import PUSH_ALGORITHMS
from kernels.custom_all_reduce import ALGORITHMS, CustomAllReduce, launch_config
from kernels.symm_mem import MAX_PROGRAMS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KiB, MiB = 1 << 10, 1 << 20


def label(nbytes: int) -> str:
    for unit, name in ((MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit} {name}"
    return f"{nbytes} B"  # (a --min-size that is no power of two: whole units would misname it)


def timed(fn, calls: int, replays: int) -> float:
    """The slowest rank's median microseconds per call, as CUDA-graph replays."""
    torch.cuda.synchronize()
    dist.barrier()
    return slowest(time_graph(fn, calls_per_graph=calls, replays=replays) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=DTYPES)
    p.add_argument("--min-size", type=positive, default=4 * KiB)
    p.add_argument("--max-size", type=positive, default=32 * MiB)
    p.add_argument("--calls", type=positive, default=50, help="all-reduces captured back to back per graph")
    p.add_argument("--replays", type=positive, default=20)
    p.add_argument("--sweep", action="store_true", help="also time every launch config of the four kernels")
    p.add_argument(
        "--sweep-algos",
        default=",".join(ALGORITHMS),
        help="comma-separated kernels the sweep times (default: all four)",
    )
    p.add_argument("--tag", default="", help="suffix for the result names")
    args = p.parse_args()
    if args.min_size > args.max_size:
        p.error(f"--min-size {args.min_size} is above --max-size {args.max_size}")
    sweep_algos = [a for a in args.sweep_algos.split(",") if a]
    unknown = set(sweep_algos) - set(ALGORITHMS)
    if unknown:
        p.error(f"--sweep-algos: unknown {sorted(unknown)}; choose from {ALGORITHMS}")

    group = init_gpu_ranks()
    from torch.distributed import _symmetric_memory as symm

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    car = CustomAllReduce(group, max_size=args.max_size, push_max_size=args.max_size)
    torch_buf = symm.empty(args.max_size // itemsize, dtype=dtype, device="cuda")
    symm.rendezvous(torch_buf, group.group_name)

    sizes = []
    s = args.min_size
    while s <= args.max_size:
        sizes.append(s)
        s *= 2

    rows, sweep_rows = [], []
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    for nbytes in sizes:
        n = nbytes // itemsize
        torch.manual_seed(rank)
        x = torch.randn(n, dtype=dtype, device="cuda")
        out = torch.empty_like(x)
        direct = car.input_buffer((n,), dtype)
        direct.copy_(x)
        nccl_x = x.clone()
        tb = torch_buf[:n]
        tb.copy_(x)
        name = group.group_name
        impls = {
            "auto": partial(car.all_reduce, x, out=out),
            "one_shot": partial(car.all_reduce, x, "one_shot", out=out),
            "two_shot": partial(car.all_reduce, x, "two_shot", out=out),
            "one_shot_push": partial(car.all_reduce, x, "one_shot_push", out=out),
            "two_shot_push": partial(car.all_reduce, x, "two_shot_push", out=out),
            "one_shot_direct": partial(car.all_reduce, direct, "one_shot", out=out),
            "two_shot_direct": partial(car.all_reduce, direct, "two_shot", out=out),
            "nccl": partial(dist.all_reduce, nccl_x),
            "torch_one_shot": partial(torch.ops.symm_mem.one_shot_all_reduce, tb, "sum", name),
            "torch_two_shot": partial(torch.ops.symm_mem.two_shot_all_reduce_, tb, "sum", name),
        }
        us = {}
        for name, fn in impls.items():
            if name == "torch_two_shot":
                tb.copy_(x)
            try:
                us[name] = timed(fn, args.calls, args.replays)
            except Exception as e:
                print(f"rank {rank}: {name} at {label(nbytes)} failed: {e}", flush=True)
                us[name] = float("nan")
        car.check()
        best_torch = min(us["torch_one_shot"], us["torch_two_shot"])
        rows.append(
            {
                "size": label(nbytes),
                "auto us": us["auto"],
                "auto algo": car.algorithm(x),
                "one-shot us": us["one_shot"],
                "two-shot us": us["two_shot"],
                "one-shot push us": us["one_shot_push"],
                "two-shot push us": us["two_shot_push"],
                "one-shot direct us": us["one_shot_direct"],
                "two-shot direct us": us["two_shot_direct"],
                "NCCL us": us["nccl"],
                "torch one-shot us": us["torch_one_shot"],
                "torch two-shot us": us["torch_two_shot"],
                "best ours / best torch": min(us[a] for a in ALGORITHMS) / best_torch,
                "auto / best torch": us["auto"] / best_torch,
                "auto / NCCL": us["auto"] / us["nccl"],
            }
        )
        if rank == 0:
            print(rows[-1], flush=True)

        if args.sweep:
            for algo in sweep_algos:
                best = None
                for warps in (1, 2, 4, 8, 16, 32):
                    vectors = -(-nbytes // 16)
                    if algo.startswith("two_shot"):
                        vectors = -(-vectors // world)
                    need = -(-vectors // (warps * 32))
                    counts = [1, 2, 4, 8, 16, 32, 64, 128]
                    if algo in PUSH_ALGORITHMS:  # no pad barrier: one program per SM and two per SM too
                        counts += [c for c in (sms, 2 * sms, MAX_PROGRAMS.value) if c <= MAX_PROGRAMS.value]
                    for blocks_ in sorted({min(b, need) for b in counts}):
                        if need / blocks_ > 64:
                            continue

                        fn = partial(car.launch, x, out, algo, warps, blocks_)
                        t = timed(fn, 20, 10)
                        sweep_rows.append(
                            {
                                "size": label(nbytes),
                                "algo": algo,
                                "warps": warps,
                                "programs": blocks_,
                                "us": t,
                            }
                        )
                        if best is None or t < best[0]:
                            best = (t, warps, blocks_)
                default = launch_config(algo, nbytes, world, itemsize)
                if rank == 0:
                    print(f"  sweep {label(nbytes)} {algo}: best {best}, table {default}", flush=True)
            car.check()

    if rank == 0:
        tag = device_name()
        notes = (
            f"{args.dtype}, sum over {world} GPUs; microseconds per all-reduce, the slowest rank's median "
            f"of {args.replays} replays of a CUDA graph of {args.calls} back-to-back calls. "
            "ours: weft's Triton kernels (copy-in: the kernel copies the caller's tensor into symmetric "
            "memory; direct: the input already lives there; push: remote stores whose data is its own "
            "flag, no barrier). NCCL: dist.all_reduce in the same graph "
            "conditions. torch: torch.ops.symm_mem.one_shot_all_reduce / two_shot_all_reduce_ on a "
            "symmetric input. Command: torchrun --nproc_per_node="
            f"{world} -m benchmarks.bench_all_reduce{' --sweep' if args.sweep else ''}"
        )
        name = "all_reduce" + args.tag
        write_results(name, rows, notes)
        if sweep_rows:
            write_results(
                name + "_sweep", sweep_rows, "launch sweep of the kernels (copy-in inputs); " + notes
            )
        plot(rows, sizes, RESULTS_DIR / f"{name}-{tag}.png", f"all-reduce {args.dtype}, {tag}")
    dist.barrier()
    dist.destroy_process_group()


def plot(rows: list[dict], sizes: list[int], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, style in [
        ("auto us", "o-"),
        ("one-shot us", "^--"),
        ("two-shot us", "v--"),
        ("one-shot push us", "^-"),
        ("two-shot push us", "v-"),
        ("NCCL us", "s-"),
        ("torch one-shot us", "x:"),
        ("torch two-shot us", "+:"),
    ]:
        ax.plot(sizes, [r[key] for r in rows], style, label=key.replace(" us", ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [r["size"] for r in rows], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("latency per call (us)")
    ax.set_title(title + " (CUDA-graph replay)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
