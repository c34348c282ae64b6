"""The frame both GEMM + collective benchmarks share (bench_ag_matmul.py, bench_matmul_rs.py): for each
M K N, a correctness check of ours against the stock path before any timing, ours and its three peers
timed alike on every rank (interleaved rounds, GPU time with the host's launches queued ahead, and the
host's time to queue ours; the slowest rank's median), one row with every time and ours' ratio to each
peer, an optional sweep of our GEMM configs, and the result files. Each benchmark supplies what differs:
the tensors, the calls and the columns' names (a `Case`).

`--gemm-alone` (one GPU, no torchrun): the kernel's own GEMM as rank `--rank` of `--world` runs it, the
communication taken out (the kernel module's `GemmAlone`), against torch.matmul (cuBLAS) on the same
operands, both in this process; `<name>_gemm-<device>` (and `<name>_gemm_sweep-<device>`) at the
default world of 4, `<name>_gemm_world<W>-<device>` at another. The benchmark supplies an `AloneCase`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import (
    LEAD_CYCLES,
    init_gpu_ranks,
    positive,
    time_ranks_interleaved,
    warm_lead,
    write_results,
)

# Bytes written between timed calls to evict both operands from L2 (50 MiB on H100, 60 MiB on H200):
# in training neither the activations nor the weights of a layer's GEMM are L2-resident.
L2_FLUSH_BYTES = 256 << 20
# Relative error against cuBLAS above which a config's output is wrong (bf16 rounding is ~2e-3).
MAX_REL_ERR = 1e-2


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


@dataclasses.dataclass
class AloneCase:
    """One M K N of a benchmark's GEMM alone, set up on one GPU."""

    # config (None: the kernel's own pick) -> (a call that runs our GEMM and returns its output, the
    # config that call runs after the kernel module's resolution, the GemmAlone it runs).
    ours: Callable[[Any], tuple[Callable[[], torch.Tensor], Any, Any]]
    # torch.matmul on the same operands.
    cublas: Callable[[], torch.Tensor]
    # cuBLAS's output -> the part of it that ours computes (its rows of this rank).
    expected: Callable[[torch.Tensor], torch.Tensor]


def time_interleaved(fns: dict[str, Callable[[], object]], iters: int) -> dict[str, float]:
    """Median microseconds of each call over `iters` rounds. Every round runs each call once, in an order
    rotated per round (no call always follows the same one), each after an L2 flush and a short GPU
    sleep, bracketed by CUDA events."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    labels = list(fns)
    events = {label: [] for label in labels}
    for _ in range(2):  # warm-up: compilation, cuBLAS heuristics, allocator
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    for i in range(iters):
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.zero_()
            torch.cuda._sleep(LEAD_CYCLES)
            start.record()
            fns[label]()
            end.record()
            events[label].append((start, end))
        torch.cuda.synchronize()
    return {
        label: statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs) for label, pairs in events.items()
    }


def timing_note(args: argparse.Namespace) -> str:
    """How `measure` times, for the result files' notes."""
    return (
        f"Microseconds per call: the slowest rank's median of {args.iters} rounds; each round runs every "
        f"implementation {args.reps} times back to back, in an order rotated per round, after a barrier "
        "and a GPU sleep that lets the host queue the calls first, then an all-reduce of one word that "
        "starts the ranks' GPUs together (GPU time, CUDA events); "
        "'ours host us': the host's time to queue one call of ours."
    )


def describe(config: Any) -> str:
    """A GEMM config as its required fields' values in order, then the options not at their default."""
    fields = dataclasses.fields(config)
    values = [str(getattr(config, f.name)) for f in fields if f.default is dataclasses.MISSING]
    options = [
        f"{f.name}={getattr(config, f.name)}"
        for f in fields
        if f.default is not dataclasses.MISSING and getattr(config, f.name) != f.default
    ]
    return " ".join(values + options)


def kernel_resources(kernels: Sequence[Any]) -> str:
    """Compiled Triton kernels' registers per thread (and spills) and shared memory per program, in
    launch order: what decides how many of a kernel's programs an SM holds (65536 registers, 227 KiB
    on Hopper)."""
    return " / ".join(
        f"{k.n_regs}{f'+{k.n_spills} spills' if k.n_spills else ''} {k.metadata.shared // 1024} KiB"
        for k in kernels
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def measure_alone(
    m: int, k: int, n: int, case: AloneCase, iters: int, sweep: Sequence[Any]
) -> tuple[dict[str, object], list[dict[str, object]]]:
    """(result row, sweep rows) of one shape: ours with its own config, then every config of `sweep`,
    each checked against cuBLAS and then timed interleaved with it."""
    flops = 2 * m * k * n
    expected = case.expected(case.cublas())
    rows = []
    for cfg in (None, *sweep):
        row: dict[str, object] = {"M K N": f"{m} {k} {n}", "config": describe(cfg) if cfg else ""}
        try:
            run, used, alone = case.ours(cfg)
            row["config"] = describe(used)
            err = relative_error(run(), expected)
            row["regs smem"] = kernel_resources(alone.kernels)
            if not err <= MAX_REL_ERR:
                raise RuntimeError(f"relative error {err:.2e} against cuBLAS")
            us = time_interleaved({"cuBLAS": case.cublas, "ours": run}, iters)
        except Exception as e:  # one config that does not build or is wrong must not hide the others
            if cfg is None:
                raise
            print(f"  {m} {k} {n} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            err, us = float("nan"), {"cuBLAS": float("nan"), "ours": float("nan")}
        row.update(
            {
                "cuBLAS us": us["cuBLAS"],
                "ours us": us["ours"],
                "ours / cuBLAS": us["ours"] / us["cuBLAS"],
                "cuBLAS TFLOP/s": flops / us["cuBLAS"] / 1e6,
                "ours TFLOP/s": flops / us["ours"] / 1e6,
                "rel err": err,
            }
        )
        print(("" if cfg is None else "  sweep ") + str(row), flush=True)
        rows.append(row)
    return rows[0], rows[1:]


def shape_arg(text: str) -> tuple[int, int, int]:
    """An argparse type: "M,K,N", three positive integers."""
    values = text.split(",")
    if len(values) != 3 or not all(v.isdigit() and int(v) > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape M,K,N such as 8192,4096,7168")
    m, k, n = map(int, values)
    return m, k, n


def main_alone(
    name: str, args: argparse.Namespace, make_alone: Callable[..., AloneCase], sweep: Sequence[Any]
) -> None:
    """`--gemm-alone`: every shape on this process's GPU; writes `<name>_gemm[_world<W>]-<device>`."""
    if not torch.cuda.is_available():
        raise SystemExit("--gemm-alone times the GEMM on a GPU; none is visible")
    if not 0 <= args.rank < args.world:
        raise SystemExit(f"--rank {args.rank} is not a rank of --world {args.world}")
    rows, sweep_rows = [], []
    for m, k, n in args.shapes:
        if m % args.world:
            raise SystemExit(f"M={m} does not split over --world {args.world} ranks")
        row, swept = measure_alone(m, k, n, make_alone(m, k, n, args.world, args.rank), args.iters, sweep)
        rows.append(row)
        sweep_rows += swept
        torch.cuda.empty_cache()
    flags = f" --world {args.world} --rank {args.rank} --iters {args.iters}" + (
        " --sweep" if args.sweep else ""
    )
    config_fields = [f.name for f in dataclasses.fields(sweep[0])] if sweep else []
    text = (
        f"The kernel's own GEMM (config picking, tile schedule, descriptors and launches of one call of "
        f"rank {args.rank} of {args.world}) with the communication taken out (kernels' GemmAlone), against "
        f"torch.matmul on the same operands, one GPU, one process. Microseconds: the median of {args.iters} "
        "single calls, each after an L2 flush, ours and cuBLAS interleaved. Command: python -m "
        f"benchmarks.bench_{name} --gemm-alone{flags}"
        + (f". Config: {' '.join(config_fields)} (options named when not at their default)" if sweep else "")
    )
    worst = max((r["ours / cuBLAS"] for r in rows), default=math.nan)
    print(f"worst ours / cuBLAS at the kernel's own configs: {worst:.3f}", flush=True)
    # The tables of record are rank 0 of 4's; other worlds (e.g. the GEMM with no peers) get their own.
    stem = f"{name}_gemm" + ("" if args.world == 4 else f"_world{args.world}")
    write_results(stem, rows, text)
    if sweep_rows:
        write_results(f"{stem}_sweep", sweep_rows, "GEMM config sweep; " + text)


def measure(m: int, k: int, n: int, case: Case, args: argparse.Namespace, sweep: Sequence[Any]):
    """(result row, sweep rows) of one shape."""
    rank = dist.get_rank()
    fns = {}
    for label, fn in (("ours", case.ours), *case.peers.items()):
        try:
            fn()
            fns[label] = fn
        except Exception as e:  # one failing peer must not hide the others' figures
            print(f"rank {rank}: {label} at {m} {k} {n} failed: {e}", flush=True)
    times = time_ranks_interleaved(fns, args.iters, args.reps)
    ms = {label: times[label].gpu_ms if label in times else math.nan for label in ("ours", *case.peers)}
    case.check()
    baseline = list(case.peers)[-1]
    flops = 2 * m * k * n
    row: dict[str, object] = {"M K N": f"{m} {k} {n}"}
    row.update({f"{label} us": t * 1e3 for label, t in ms.items()})
    row["ours host us"] = times["ours"].host_ms * 1e3 if "ours" in times else math.nan
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
        try:  # a config the GPU cannot hold (shared memory, registers) fails alike on every rank
            case.ours(cfg)
        except Exception as e:
            print(f"rank {rank}: sweep config {cfg} at {m} {k} {n} failed: {e}", flush=True)
            continue
        run = {"ours": lambda cfg=cfg: case.ours(cfg)}
        t = time_ranks_interleaved(run, args.iters, args.reps)["ours"]
        fields = " ".join(f.name for f in dataclasses.fields(cfg))
        sweep_rows.append(
            {
                "M K N": f"{m} {k} {n}",
                fields: " ".join(map(str, dataclasses.astuple(cfg))),
                "us": t.gpu_ms * 1e3,
                f"/ {baseline}": t.gpu_ms / ms[baseline],
                "host us": t.host_ms * 1e3,
            }
        )
        if rank == 0:
            print("  sweep", sweep_rows[-1], flush=True)
    case.check()
    return row, sweep_rows


# GPU activities a profile of one call lists: kernels, memcpys (the copy engines') and memsets.
GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")
SLEEP_KERNEL = "spin_kernel"  # torch.cuda._sleep's


def timeline(fn: Callable[[], object], reps: int) -> list[dict[str, object]]:
    """The GPU activities of `reps` back-to-back calls of `fn`, queued during a GPU sleep as the timed
    rounds queue them (every rank calls it; each profiles its own): name, stream, start and duration in
    microseconds, starts counted from the end of the sleep. Where the copies and waits of ours sit
    against its GEMM is what the overlap's cost comes down to."""
    lead = warm_lead(fn, reps)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(lead)
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    acts = sorted((e for e in events if e.get("cat") in GPU_ACTIVITIES), key=lambda e: e["ts"])
    sleeps = [e for e in acts if SLEEP_KERNEL in e["name"]]
    t0 = sleeps[0]["ts"] + sleeps[0]["dur"] if sleeps else acts[0]["ts"] if acts else 0
    return [
        {
            "activity": e["name"][:70],
            "stream": e["tid"],
            "start us": round(e["ts"] - t0, 1),
            "us": round(e["dur"], 1),
        }
        for e in acts
        if SLEEP_KERNEL not in e["name"]
    ]


def main(
    name: str,
    description: str,
    shapes: Sequence[tuple[int, int, int]],
    sweep: Sequence[Any],
    make_case: Callable[[int, int, int, dist.ProcessGroup], Case],
    notes: Callable[[int, argparse.Namespace], str],
    make_alone: Callable[[int, int, int, int, int], AloneCase],
) -> None:
    """Parse the shared options, run every shape on every rank, and let rank 0 write
    `<name>-<device>` (and `<name>_sweep-<device>` with --sweep); with --gemm-alone, `main_alone`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shapes", type=shape_arg, nargs="*", default=list(shapes), help="M,K,N ...")
    p.add_argument("--reps", type=positive, default=3, help="back-to-back calls per timed sample")
    p.add_argument("--iters", type=positive, default=15)
    p.add_argument("--sweep", action="store_true", help="also time every GEMM config of the sweep")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also profile --reps calls of ours per shape (<name>_timeline-*)",
    )
    p.add_argument(
        "--gemm-alone",
        action="store_true",
        help="one GPU, no torchrun: our GEMM with the communication taken out against cuBLAS",
    )
    p.add_argument("--world", type=positive, default=4, help="--gemm-alone: the ranks whose call is timed")
    p.add_argument("--rank", type=int, default=0, help="--gemm-alone: the rank whose call is timed")
    args = p.parse_args()
    if args.gemm_alone:
        main_alone(name, args, make_alone, sweep if args.sweep else ())
        return

    group = init_gpu_ranks()
    world = dist.get_world_size()
    rows, sweep_rows, timeline_rows = [], [], []
    for m, k, n in args.shapes:
        if m % world:
            raise SystemExit(f"M={m} does not split over {world} ranks")
        # Correctness first (in make_case): a wrong kernel's timing is meaningless.
        case = make_case(m, k, n, group)
        row, swept = measure(m, k, n, case, args, sweep if args.sweep else ())
        rows.append(row)
        sweep_rows += swept
        if args.timeline:
            timeline_rows += [{"M K N": f"{m} {k} {n}", **r} for r in timeline(case.ours, args.reps)]
        del case
        torch.cuda.empty_cache()

    if dist.get_rank() == 0:
        text = notes(world, args)
        write_results(name, rows, text)
        if sweep_rows:
            write_results(f"{name}_sweep", sweep_rows, "GEMM config sweep of ours; " + text)
        if timeline_rows:
            about = f"Rank 0's GPU activities in {args.reps} back-to-back calls of ours, queued in a sleep: "
            write_results(f"{name}_timeline", timeline_rows, about + text)
    dist.barrier()
    dist.destroy_process_group()
