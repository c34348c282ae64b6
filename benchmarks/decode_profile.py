"""Where a decode step's time goes: serve.py's decode step captured in a CUDA graph, replayed under
torch.profiler, its kernels' time summed per op class beside the step's wall time and the roofline.

    python -m benchmarks.decode_profile --model llama3_8b --batch-sizes 1 8 [--fp8] [--compile] [--no-pdl]

One GPU, random weights, prompt `--prompt-len`, cache `--prompt-len + --decode-steps` long (as in
bench_decode), the step profiled being the first, at position `--prompt-len`. Per (dtype, compiled,
batch) the table has the step's wall time (graph replays timed with CUDA events, no profiler), the
kernels' summed time, the GPU's busy time (the union of the kernels' intervals: wall minus busy is idle
gaps), then per op class its kernels and time per step, its share of the summed kernel time and of the
wall time, and for the classes that must read memory (the GEMMs read the weights, attention the KV cache
up to the position) their roofline time at the measured copy bandwidth (the GEMM row's share leaves out
the split-K reduce kernels, a row of their own).

Under programmatic dependent launch (the FP8 kernels, kernels/fp8.py) a kernel starts before the one
it waits on has finished, so durations overlap and their sum exceeds the wall time: `--no-pdl`
launches weft's FP8 kernels plainly (as WEFT_FP8_PDL=0 does) so that they run one after another and
per-class times add up. Kernels no pattern of OP_CLASSES matches count as "other"; the largest of them
are printed (and noted in the result file) so that the patterns can be refined.
Writes benchmarks/results/decode_profile-<model>[-compiled][-nopdl]-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import dataclass

import torch

import kernels.fp8
from benchmarks.common import add_decode_shape_args, preset_args, time_events, write_results
from model.generate import DecodeStep, prefill
from model.llama import Llama
from serve import build_model, decode_bytes_per_step, kv_cache_bytes, memory_bandwidth

# Op classes by kernel name (a regular expression, case-insensitive), tried in this order: the first
# match wins, so the narrow classes come before the broad ones (flash attention's kernels mention
# cutlass, inductor's fused norm is a triton_red_ kernel). Names are the profiler's demangled kernel names:
# cuBLAS (sm90_xmma_gemm_*, nvjet_*, gemv*), cuDNN/flash SDPA, ATen's eager kernels, inductor's
# triton_{poi,red,per,tem}_fused_<ops> and weft's Triton kernels (kernels/*.py).
OP_CLASSES: dict[str, str] = {
    "training loss": r"cross_entropy",  # weft's loss kernels: in no decode step, but no kernel is "other"
    "split-K reduce": r"splitkreduce|split_k_reduce|reduce_splitk",
    "communication": r"nccl|all_reduce|allreduce|_one_shot|_two_shot|_all_to_all|_barrier_kernel"
    r"|ag_matmul|matmul_rs",
    "attention": r"flash|fmha|sdpa|cudnn|attention|softmax",
    "GEMM": r"gemm|gemv|nvjet|xmma|cutlass|matmul|triton_tem_|addmm|bmm",
    "norm": r"rmsnorm|rms_norm|layer_norm|rsqrt|meanops|pow_tensor_scalar",
    "SwiGLU": r"swiglu|silu|sigmoid",
    "FP8 quantize": r"quantize",
    "rotary, cache write, copies": r"copy|index|cat|stack|elementwise|fill|memcpy|memset|gather|scatter"
    r"|triton_poi_|triton_per_|triton_red_",
}
OTHER = "other"
_PATTERNS = {name: re.compile(pattern, re.IGNORECASE) for name, pattern in OP_CLASSES.items()}


def classify(kernel: str) -> str:
    """The op class of a kernel name: the first of OP_CLASSES whose pattern it matches, else OTHER."""
    return next((name for name, pattern in _PATTERNS.items() if pattern.search(kernel)), OTHER)


@dataclass(frozen=True)
class KernelEvent:
    name: str
    start_us: float
    duration_us: float


def busy_us(events: list[KernelEvent]) -> float:
    """Microseconds during which at least one kernel ran (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.start_us):
        stop = e.start_us + e.duration_us
        total += max(0.0, stop - max(e.start_us, end))
        end = max(end, stop)
    return total


def breakdown(
    events: list[KernelEvent], steps: int, wall_us: float, roofline_us: dict[str, float]
) -> list[dict[str, object]]:
    """Rows per step from the kernels of `steps` graph replays: the step (wall time against the whole
    roofline), all kernels summed, the GPU's busy time, then each op class present in OP_CLASSES
    order (other last). `roofline_us` gives the classes that have one their time at the roofline."""
    count: dict[str, int] = defaultdict(int)
    summed: dict[str, float] = defaultdict(float)
    for e in events:
        count[classify(e.name)] += 1
        summed[classify(e.name)] += e.duration_us
    total_us = sum(summed.values()) / steps

    def row(op: str, kernels: float, us: float, roofline: float | str = "") -> dict[str, object]:
        return {
            "op": op,
            "kernels": kernels,
            "us": us,
            "of_kernels": us / total_us if op not in ("step (wall)", "GPU busy") else "",
            "of_step": us / wall_us,
            "roofline_us": roofline,
            "of_roofline": roofline / us if isinstance(roofline, float) and us > 0 else "",
        }

    rows = [
        row("step (wall)", len(events) / steps, wall_us, sum(roofline_us.values())),
        row("all kernels", len(events) / steps, total_us),
        row("GPU busy", len(events) / steps, busy_us(events) / steps),
    ]
    for op in [*OP_CLASSES, OTHER]:
        if count[op]:
            rows.append(row(op, count[op] / steps, summed[op] / steps, roofline_us.get(op, "")))
    return rows


def largest_other(events: list[KernelEvent], steps: int, n: int = 5) -> list[tuple[str, float]]:
    """The `n` unclassified kernel names taking the most time, with their microseconds per step."""
    summed: dict[str, float] = defaultdict(float)
    for e in events:
        if classify(e.name) == OTHER:
            summed[e.name] += e.duration_us / steps
    return sorted(summed.items(), key=lambda item: -item[1])[:n]


def profile_replays(graph: torch.cuda.CUDAGraph, replays: int) -> list[KernelEvent]:
    """The GPU activities (kernels, memcpys, memsets) of `replays` replays of `graph`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return [
        KernelEvent(e.name, e.time_range.start, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
    ]


def profile_decode(
    model: Llama, batch: int, prompt_len: int, cache_len: int, compile: bool, replays: int, bandwidth: float
) -> tuple[list[dict[str, object]], list[tuple[str, float]]]:
    """The breakdown rows of one decode step at position `prompt_len`, and the largest other kernels."""
    device = model.tok_embeddings.weight.device
    model.setup_caches(batch, cache_len)
    prompt = torch.randint(0, model.args.vocab_size, (batch, prompt_len), device=device)
    step = DecodeStep(model, batch, device, cuda_graph=True, compile=compile)
    step(prefill(model, prompt).argmax(-1), prompt_len)  # compile and capture
    wall_us = time_events(step.graph.replay, iters=50) * 1e3
    events = profile_replays(step.graph, replays)
    model.clear_caches()
    # The graph replays the step it captured, at position prompt_len.
    roofline_us = step_roofline_us(model, batch, prompt_len, bandwidth)
    return breakdown(events, replays, wall_us, roofline_us), largest_other(events, replays)


def step_roofline_us(model: Llama, batch: int, position: int, bandwidth: float) -> dict[str, float]:
    """Microseconds at `bandwidth` (bytes/s) of what the decode step at `position` must read, for the op
    classes that read memory: the GEMMs their weights, attention the KV cache's positions 0 .. position."""
    kv = kv_cache_bytes(model, batch, position + 1)
    # Every weight a decode step reads (all but the embedding rows) is a GEMM's, but the norms' tiny ones.
    weights = decode_bytes_per_step(model, batch, position, position + 1) - kv
    return {"GEMM": weights / bandwidth * 1e6, "attention": kv / bandwidth * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_decode_shape_args(parser, [1, 8])
    parser.add_argument("--replays", type=int, default=20, help="graph replays profiled")
    parser.add_argument("--fp8", action="store_true", help="also profile the FP8 decode path")
    parser.add_argument("--compile", action="store_true", help="also profile the compiled decode step")
    parser.add_argument("--no-pdl", action="store_true", help="launch the FP8 kernels without PDL")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile.py needs a CUDA GPU: it profiles CUDA-graph replays")
    if opts.no_pdl:
        kernels.fp8.USE_PDL = False
    device = torch.device("cuda", torch.cuda.current_device())
    flags = " --fp8" * opts.fp8 + " --compile" * opts.compile + " --no-pdl" * opts.no_pdl
    name = f"decode_profile-{opts.model}" + "-compiled" * opts.compile + "-nopdl" * opts.no_pdl
    notes = (
        f"`python -m benchmarks.decode_profile --model {opts.model} --batch-sizes "
        f"{' '.join(map(str, opts.batch_sizes))}{flags}`: prompt {opts.prompt_len}, cache "
        f"{opts.prompt_len + opts.decode_steps}, {opts.replays} CUDA-graph replays profiled; FP8 PDL "
        f"{'on' if kernels.fp8.USE_PDL else 'off'}. Times in us per decode step."
    )
    bandwidth = memory_bandwidth(device)
    cache_len = opts.prompt_len + opts.decode_steps
    rows, others = [], []
    for fp8 in [False, True] if opts.fp8 else [False]:
        args = preset_args(opts.model)
        args.fp8 = fp8
        model = build_model(args, None, device, torch.bfloat16)
        for compile in [False, True] if opts.compile else [False]:
            for batch in opts.batch_sizes:
                config = {"dtype": "fp8" if fp8 else "bf16", "compiled": compile, "batch": batch}
                table, other = profile_decode(
                    model, batch, opts.prompt_len, cache_len, compile, opts.replays, bandwidth
                )
                rows += [{**config, **r} for r in table]
                if other:
                    listed = "; ".join(f"`{kernel[:120]}` {us:.1f} us" for kernel, us in other)
                    others.append(f"- {config['dtype']}{' compiled' * compile} batch {batch}: {listed}")
                # Rewritten after every configuration, so a run cut short keeps what it measured.
                extra = "\n\nLargest unclassified kernels:\n" + "\n".join(others) if others else ""
                write_results(name, rows, notes=notes + extra)
        del model
        torch.cuda.empty_cache()
    if others:
        print("Largest unclassified kernels (refine OP_CLASSES):\n" + "\n".join(others))


if __name__ == "__main__":
    main()
