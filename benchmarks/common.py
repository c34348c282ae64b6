"""Shared benchmark plumbing: timing (events, CUDA-graph replay) and result files.

Every benchmark prints a markdown table and writes `benchmarks/results/<name>-<device>.json` and
`.md` with the date, device and library versions, so a figure quoted anywhere can be traced to a run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from model.args import ModelArgs
from report import environment, markdown_table

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


def device_name(gpus: int | None = None) -> str:
    """A short device tag for file names: 'h200', 'h100', 'h200-x4' (four GPUs, the device kinds'
    naming), or 'cpu'. `gpus` defaults to the process group's world size."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    chip = next((c for c in ("h200", "h100", "a100", "b200") if c in name), name.split()[-1])
    if gpus is None:
        gpus = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return f"{chip}-x{gpus}" if gpus > 1 else chip


def pyplot():
    """matplotlib.pyplot drawing to files (no display), or a one-line error saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def time_events(fn: Callable[[], object], iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of `fn` over `iters` calls, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph(
    fn: Callable[[], object], calls_per_graph: int = 20, replays: int = 30, warmup: int = 3
) -> float:
    """Median milliseconds per call of `fn`, captured `calls_per_graph` times back to back in one CUDA
    graph and timed over graph replays: the way decode-sized ops run in serving, free of launch gaps.
    `fn` must be capturable (no allocation it cannot reuse, no host sync)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_graph)
    return statistics.median(times)


def refuse_shared_gpu() -> None:
    """Exit when ranks share a GPU (parallel/shared_gpu.py): such timings say nothing about NVLink,
    and no result table may carry them."""
    from parallel.distributed import shared_gpu

    if shared_gpu():
        raise SystemExit(
            "benchmark refused: ranks share a GPU here, and such timings say nothing about NVLink; "
            "run with one GPU per rank (the shared-GPU mode is for correctness tests)"
        )


def positive(text: str) -> int:
    """An argparse type: a count or size of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def model_preset(text: str) -> str:
    """An argparse type: the name of a model preset of configs/model/."""
    presets = sorted(
        p.stem for p in (Path(__file__).resolve().parent.parent / "configs" / "model").glob("*.yaml")
    )
    if text not in presets:
        raise argparse.ArgumentTypeError(f"{text!r} is not a model preset: one of {', '.join(presets)}")
    return text


def init_gpu_ranks() -> dist.ProcessGroup:
    """Under torchrun: this rank on the GPU of its LOCAL_RANK, an NCCL process group, and symmetric
    memory enabled on it (PyTorch's fused ops need that on torch 2.11). Returns the world group."""
    from kernels.symm_mem import enable_symm_mem

    if "RANK" not in os.environ or not torch.cuda.is_available():
        raise SystemExit(
            "this benchmark runs one rank per GPU under torchrun: torchrun --nproc_per_node=GPUS -m "
            f"benchmarks.{Path(sys.argv[0]).stem} (CUDA GPUs here: {torch.cuda.device_count()})"
        )
    refuse_shared_gpu()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    enable_symm_mem(dist.group.WORLD.group_name)
    return dist.group.WORLD


def slowest(value: float) -> float:
    """The largest over the ranks of a per-rank figure: a collective is as slow as its slowest member."""
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# GPU cycles (~0.25 ms) a stream sleeps at least before a timed region, so that the host has queued the
# whole region before its start event fires and the host's launch cost is not in the GPU time.
LEAD_CYCLES = 500_000
MAX_LEAD_CYCLES = 100_000_000  # ~50 ms


def align_ranks_on_gpu() -> None:
    """Queue on the current stream an all-reduce of one word over the world: the work queued after it
    starts on no rank's GPU before every rank's GPU has reached it. Sleeps of equal cycles alone do not
    align the ranks: each GPU counts them at its own clock, which power and temperature set, and the
    host releases each rank from the barrier before it at its own time. A rank that wakes early counts
    its wait for the others in its first call as that call's time, which a single-GPU baseline
    (cuBLAS alone), waiting for no one, never does."""
    dist.all_reduce(_align_word(torch.cuda.current_device()))


@functools.cache
def _align_word(device: int) -> torch.Tensor:
    return torch.zeros(1, device=torch.device("cuda", device))


def lead_cycles(host_s: float) -> int:
    """GPU cycles to sleep before a timed region whose calls take the host `host_s` seconds to queue:
    twice that at ~2 GHz, the same on every rank (the slowest host's)."""
    return int(slowest(float(min(max(LEAD_CYCLES, int(4e9 * host_s)), MAX_LEAD_CYCLES))))


def warm_lead(fn: Callable[[], object], reps: int) -> int:
    """Warm `fn` up (compilation, cuBLAS heuristics, allocator, clocks: two rounds of `reps` calls) and
    return the `lead_cycles` of queueing the last round; the GPU is idle on return."""
    for _ in range(2):
        queued = time.perf_counter()
        for _ in range(reps):
            fn()
        host_s = time.perf_counter() - queued
    torch.cuda.synchronize()
    return lead_cycles(host_s)


@dataclass
class RankTimes:
    """The slowest rank's median milliseconds per call: on the GPU (the calls queued before the start
    event fires) and on the host (queueing them)."""

    gpu_ms: float
    host_ms: float


def time_ranks_interleaved(
    fns: dict[str, Callable[[], object]], iters: int, reps: int = 1
) -> dict[str, RankTimes]:
    """Each call's times over `iters` rounds. Every round runs each call `reps` times back to back, in an
    order rotated per round (the same on every rank; no call always follows the same one, none always
    meets a cold GPU first), after a barrier, a GPU sleep (`lead_cycles` of the warm-up's host time) and
    `align_ranks_on_gpu`; the start event follows all three.
    A call whose host time exceeds its GPU time is launch-bound wherever the host does not run ahead."""
    labels = list(fns)
    lead = {label: warm_lead(fn, reps) for label, fn in fns.items()}
    samples: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event, float]]] = {lb: [] for lb in labels}
    for i in range(iters):
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(lead[label])
            align_ranks_on_gpu()
            start.record()
            queued = time.perf_counter()
            for _ in range(reps):
                fns[label]()
            host_s = time.perf_counter() - queued
            end.record()
            samples[label].append((start, end, host_s))
        torch.cuda.synchronize()
    return {
        label: RankTimes(
            gpu_ms=slowest(statistics.median(s.elapsed_time(e) for s, e, _ in rows) / reps),
            host_ms=slowest(statistics.median(h for _, _, h in rows) * 1e3 / reps),
        )
        for label, rows in samples.items()
    }


def write_results(
    name: str, rows: Sequence[dict[str, object]], notes: str = "", device: str | None = None
) -> Path:
    """Write `<name>-<device>.json` and `.md` under benchmarks/results/ and print the table.
    The sections a person added below an earlier table (its `## ` headings on: what was tried, what
    the profile shows) are kept below the new one. Returns the markdown path."""
    tag = device or device_name()
    env = environment()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / f"{name}-{tag}"
    earlier = stem.with_suffix(".md").read_text() if stem.with_suffix(".md").is_file() else ""
    kept = earlier[earlier.find("\n## ") :] if "\n## " in earlier else ""
    stem.with_suffix(".json").write_text(
        json.dumps({"name": name, **env, "notes": notes, "rows": list(rows)}, indent=2)
    )
    header = f"# {name} on {env['device']}\n\n" + ", ".join(f"{k} {v}" for k, v in env.items()) + "\n\n"
    table = markdown_table(rows)
    stem.with_suffix(".md").write_text(header + (notes + "\n\n" if notes else "") + table + kept)
    print(table)
    return stem.with_suffix(".md")


def add_decode_shape_args(parser: argparse.ArgumentParser, batch_sizes: list[int]) -> None:
    """The decode benchmarks' shared options: model preset, batch sizes, prompt length and decode steps
    (the cache holds prompt + steps positions, so that their rooflines agree)."""
    parser.add_argument("--model", type=model_preset, default="llama3_8b")
    parser.add_argument("--batch-sizes", type=positive, nargs="+", default=batch_sizes)
    parser.add_argument("--prompt-len", type=positive, default=512)
    parser.add_argument("--decode-steps", type=positive, default=128, help="cache = prompt + this")


def preset_args(preset: str) -> ModelArgs:
    """A fresh copy of model preset `preset`'s args, as serve.py composes them (configs/model/)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from configs.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS_DIR), version_base=None):
        return OmegaConf.to_object(compose("serve", overrides=[f"model={preset}"]).model)
