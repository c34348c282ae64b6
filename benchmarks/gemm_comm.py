"""The frame both GEMM + collective benchmarks share (bench_ag_matmul.py, bench_matmul_rs.py): for each
M K N, a correctness check of ours against the stock path before any timing, ours and its three peers
timed alike on every rank (the slowest rank's median), one row with every time and ours' ratio to each
peer, an optional sweep of our GEMM configs, and the result files. Each benchmark supplies what differs:
the tensors, the calls and the columns' names (a `Case`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import init_gpu_ranks, time_ranks, write_results


@dataclasses.dataclass
class Case:
    """One M K N of a benchmark, set up on this rank."""

    # ours(config=None): the kernel, with its default GEMM config or the given one.
    ours: Callable[..., object]
    # Column label -> the peer's call; the last one is the bar's baseline (the GEMM alone).
    peers: dict[str, Callable[[], object]]
    # Raises if the kernel recorded a timed-out wait on a peer (the kernel module's check(group)).
    check: Callable[[], None]
    # Relative error of ours against the stock path, and any further columns of the check.
    error: float
    checks: dict[str, object]
    # The GEMM config ours picks for this shape (a dataclass of the kernel module).
    config: Any


def measure(m: int, k: int, n: int, case: Case, args: argparse.Namespace, sweep: Sequence[Any]):
    """(result row, sweep rows) of one shape."""
    rank = dist.get_rank()
    ms = {}
    for label, fn in (("ours", case.ours), *case.peers.items()):
        try:
            ms[label] = time_ranks(fn, args.iters, args.reps)
        except Exception as e:  # one failing peer must not hide the others' figures
            print(f"rank {rank}: {label} at {m} {k} {n} failed: {e}", flush=True)
            ms[label] = float("nan")
    case.check()
    baseline = list(case.peers)[-1]
    flops = 2 * m * k * n
    row: dict[str, object] = {"M K N": f"{m} {k} {n}"}
    row.update({f"{label} us": t * 1e3 for label, t in ms.items()})
    row.update({f"ours / {label}": ms["ours"] / ms[label] for label in reversed(case.peers)})
    row["ours TFLOP/s"] = flops / ms["ours"] / 1e9
    row[f"{baseline} TFLOP/s"] = flops / ms[baseline] / 1e9
    row["config"] = " ".join(map(str, dataclasses.astuple(case.config)))
    row["rel err"] = case.error
    row.update(case.checks)
    if rank == 0:
        print(row, flush=True)

    sweep_rows = []
    for cfg in sweep:
        t = time_ranks(lambda cfg=cfg: case.ours(cfg), args.iters, args.reps)
        fields = " ".join(f.name for f in dataclasses.fields(cfg))
        sweep_rows.append(
            {
                "M K N": f"{m} {k} {n}",
                fields: " ".join(map(str, dataclasses.astuple(cfg))),
                "us": t * 1e3,
                f"/ {baseline}": t / ms[baseline],
            }
        )
        if rank == 0:
            print("  sweep", sweep_rows[-1], flush=True)
    case.check()
    return row, sweep_rows


def main(
    name: str,
    description: str,
    shapes: Sequence[tuple[int, int, int]],
    sweep: Sequence[Any],
    make_case: Callable[[int, int, int, dist.ProcessGroup], Case],
    notes: Callable[[int, argparse.Namespace], str],
) -> None:
    """Parse the shared options, run every shape on every rank, and let rank 0 write
    `<name>-<device>` (and `<name>_sweep-<device>` with --sweep)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in shapes], help="M,K,N ...")
    p.add_argument("--reps", type=int, default=3, help="back-to-back calls per timed sample")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--sweep", action="store_true", help="also time every GEMM config of the sweep")
    args = p.parse_args()

    group = init_gpu_ranks()
    world = dist.get_world_size()
    rows, sweep_rows = [], []
    for spec in args.shapes:
        m, k, n = (int(v) for v in spec.split(","))
        if m % world:
            raise SystemExit(f"M={m} does not split over {world} ranks")
        # Correctness first (in make_case): a wrong kernel's timing is meaningless.
        case = make_case(m, k, n, group)
        row, swept = measure(m, k, n, case, args, sweep if args.sweep else ())
        rows.append(row)
        sweep_rows += swept
        del case
        torch.cuda.empty_cache()

    if dist.get_rank() == 0:
        text = notes(world, args)
        write_results(name, rows, text)
        if sweep_rows:
            write_results(f"{name}_sweep", sweep_rows, "GEMM config sweep of ours; " + text)
    dist.barrier()
    dist.destroy_process_group()
