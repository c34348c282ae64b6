"""Training throughput of tensor + sequence parallel Llama-3-8B shapes for each comm path, side by side.

    torchrun --nproc_per_node=4 -m benchmarks.bench_train_tp      # tp = all 4 ranks, 4 layers, seq 8192
    torchrun --nproc_per_node=4 -m benchmarks.bench_train_tp --layers 8 --comms torch symm_mem triton
    torchrun --nproc_per_node=4 -m benchmarks.bench_train_tp --steps 50   # and the losses of 53 steps

Llama-3-8B's width (dim 4096, 32 heads / 8 kv heads, MLP 14336, vocabulary 128256) with fewer layers
so a run fits in minutes; bf16 autocast over fp32 weights, AdamW, one sequence of 8192 tokens per step
(dp = 1: all ranks are one tensor-parallel group). With --tp below the ranks, FSDP2 shards over dp =
ranks / tp (every dp rank on the same tokens) and gathers the weights in each dtype of --fsdp-gather
(train.py's: the autocast dtype), a row each: `--tp 1 --comms torch --fsdp-gather bfloat16 float32`.
Reports tokens/s per GPU and MFU (model FLOPs per token from ModelArgs.training_flops_per_token, dense
bf16 peak of the GPU) per comm path; a path that cannot run here (e.g. symm_mem or triton without peer
access between the GPUs) gets a row saying why. Every path starts from the same weights and trains on
the same tokens, so their per-step losses, written beside the table (train_tp_losses-...), say whether
the comm paths compute the same training. Writes benchmarks/results/train_tp-llama3_8b-L<layers>-<gpu>-
x<W>.json / .md (under FSDP2 train_tp<tp>_fsdp<dp>-...).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.common import align_ranks_on_gpu, device_name, refuse_shared_gpu, slowest, write_results
from model.args import ModelArgs
from model.llama import Llama
from parallel.checkpoint import materialize
from parallel.comm import CommUnavailable
from parallel.loss import cross_entropy
from parallel.mesh import ParallelDims, build_mesh, validate_device, validate_model
from parallel.parallelize import ParallelizeConfig, clip_grad_norm_, parallelize_llama
from train import peak_bf16_flops


def llama3_8b(layers: int, seq: int) -> ModelArgs:
    return ModelArgs(
        name=f"llama3_8b-L{layers}",
        dim=4096,
        n_layers=layers,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=14336,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=seq,
    )


def queue_and_gpu_ms(step: Callable[[], None], step_s: float, samples: int = 3) -> tuple[float, float]:
    """The host's time to queue one step and the GPU's time to run it, each the slowest rank's median
    of `samples`. Host: one step queued on an idle GPU (the host waits for nothing: had the GPU been
    slower, the host would have queued more than CUDA's launch queue holds and waited, so host_ms
    then reads at most the GPU's time). GPU: CUDA events around one step queued behind a GPU sleep
    of twice its wall time (at ~2 GHz, the same on every rank) and `align_ranks_on_gpu`, so that the
    ranks start together and the GPU never waits for the host unless the step's launches overflow the
    queue while it sleeps (then gpu_ms reads at most the host's time). Either way, host_ms above gpu_ms
    means the step is bound by the host."""
    cycles = int(slowest(4e9 * step_s))
    host, gpu = [], []
    for _ in range(samples):
        torch.cuda.synchronize()
        dist.barrier()
        queued = time.perf_counter()
        step()
        host.append(time.perf_counter() - queued)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda._sleep(cycles)
        align_ranks_on_gpu()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return slowest(statistics.median(host) * 1e3), slowest(statistics.median(gpu))


def bench_path(comm: str, gather: str, opts, args: ModelArgs, device: torch.device) -> dict[str, object]:
    world = dist.get_world_size()
    dims = ParallelDims(dp=world // opts.tp, cp=1, tp=opts.tp, comm=comm)
    row: dict[str, object] = {"comm": comm, "tp": opts.tp, "layers": args.n_layers, "seq": opts.seq}
    if dims.dp > 1:
        row["fsdp_gather"] = gather
    try:
        validate_device(dims, device)
        validate_model(dims, args, seq_len=opts.seq, seq_key="--seq")
        with torch.device("meta"):
            model = Llama(args)
        plan = ParallelizeConfig(
            comm=comm,
            save_gathered=not opts.regather,
            activation_checkpointing=opts.activation_checkpointing,
            compile=opts.compile,
            fsdp_param_dtype=getattr(torch, gather),
        )
        # Shard on the meta device, then materialise only this rank's slices (random weights).
        parallelize_llama(model, build_mesh(dims, "cuda"), plan)
    except (CommUnavailable, ValueError) as err:
        row["status"] = f"unavailable: {err}"
        return row
    torch.manual_seed(0)  # every path starts from the same weights and reads the same tokens
    materialize(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (opts.batch, opts.seq + 1), device=device)
    dist.broadcast(tokens, src=0)  # one tensor-parallel group: every rank reads the same batch
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    losses = []  # every step's loss, kept on the GPU until the timing is done

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy(model, model(inputs), targets)
        loss.backward()
        clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for _ in range(opts.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(opts.steps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / opts.steps
    timed_losses = len(losses)
    host_ms, gpu_ms = queue_and_gpu_ms(step, seconds)
    del losses[timed_losses:]  # the loss table holds the warm-up and timed steps only
    tokens_per_gpu = opts.batch * opts.seq * dims.dp / world / seconds
    peak = peak_bf16_flops(torch.cuda.get_device_name())
    row.update(
        {
            "status": "ok",
            "step_ms": seconds * 1e3,
            "host_ms": host_ms,
            "gpu_ms": gpu_ms,
            "tokens_per_s_per_gpu": tokens_per_gpu,
            "mfu": tokens_per_gpu * args.training_flops_per_token(opts.seq) / peak if peak else float("nan"),
            "memory_gb": torch.cuda.max_memory_allocated() / 1e9,
            "loss": float(losses[-1]),
            "losses": torch.stack(losses).tolist(),
        }
    )
    return row


def compare_losses(losses: dict[str, list[float]]) -> tuple[list[dict[str, object]], dict[str, float]]:
    """Per-step rows (step, then each path's loss) and, for every path, the largest |loss - the first
    path's loss| over the steps both ran (0 for the first)."""
    if not losses:
        return [], {}
    paths = list(losses)
    steps = max(len(trace) for trace in losses.values())
    rows = [
        {"step": i + 1, **{p: losses[p][i] if i < len(losses[p]) else None for p in paths}}
        for i in range(steps)
    ]
    first = losses[paths[0]]
    diffs = {p: max(abs(a - b) for a, b in zip(losses[p], first, strict=False)) for p in paths}
    return rows, diffs


def path_name(row: dict[str, object], with_gather: bool) -> str:
    return f"{row['comm']} {row['fsdp_gather']}" if with_gather else str(row["comm"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comms", nargs="+", default=["torch", "symm_mem", "triton"])
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: all ranks)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--regather", action="store_true", help="re-gather AG-matmul inputs in the backward")
    parser.add_argument(
        "--fsdp-gather",
        nargs="+",
        default=["bfloat16"],
        choices=["bfloat16", "float32"],
        help="dtypes in which FSDP2 gathers the blocks' weights (tp below the ranks), each a row",
    )
    opts = parser.parse_args()

    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        raise SystemExit("GPU benchmark: run under torchrun on CUDA GPUs (see the module docstring)")
    refuse_shared_gpu()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    opts.tp = opts.tp or dist.get_world_size()
    args = llama3_8b(opts.layers, opts.seq)
    gathers = opts.fsdp_gather if opts.tp < dist.get_world_size() else opts.fsdp_gather[:1]
    rows = []
    for comm in opts.comms:
        for gather in gathers:
            rows.append(bench_path(comm, gather, opts, args, device))
            gc.collect()  # the previous path's model and optimizer
            torch.cuda.empty_cache()
    # A path: its comm, and its gather dtype where several were asked for.
    losses = {path_name(row, len(gathers) > 1): row.pop("losses") for row in rows if "losses" in row}
    loss_rows, diffs = compare_losses(losses)
    if losses:
        column = f"max loss diff vs {next(iter(losses))}"
        for row in rows:  # None for a path that did not run
            row[column] = diffs.get(path_name(row, len(gathers) > 1))
    if dist.get_rank() == 0:
        switches = [
            ("--compile", opts.compile),
            ("--activation-checkpointing", opts.activation_checkpointing),
            ("--regather", opts.regather),
        ]
        flags = [flag for flag, on in switches if on]
        dp = dist.get_world_size() // opts.tp
        if dp > 1:
            flags.append(f"--fsdp-gather {' '.join(gathers)}")
        command = " ".join(
            [
                f"torchrun --nproc_per_node={dist.get_world_size()} -m benchmarks.bench_train_tp",
                f"--layers {opts.layers} --seq {opts.seq} --batch {opts.batch} --tp {opts.tp}",
                f"--steps {opts.steps}",
                *flags,
            ]
        )
        # tp = every rank keeps the file names of the tensor-parallel runs; FSDP2 over dp gets its own.
        name = "train_tp" if dp == 1 else f"train_tp{opts.tp}_fsdp{dp}"
        notes = (
            f"`{command}`: Llama-3-8B width, {opts.layers} layers, bf16 autocast, AdamW; mean of "
            f"{opts.steps} steps after {opts.warmup} warm-up steps, every path from the same weights on the "
            "same tokens; host_ms: the host's time to queue one step on an idle GPU, gpu_ms: the GPU's time "
            "to run one step queued behind a GPU sleep and a one-word all-reduce that aligns the ranks "
            "(host_ms above gpu_ms: the step waits on the host) (max loss diff: the largest difference of a "
            f"step's loss from the first path's, {name}_losses-llama3_8b-L{opts.layers}); memory_gb: the "
            "peak of allocated GPU memory. MFU = tokens/s/GPU x model FLOPs/token / dense bf16 peak."
        )
        write_results(f"{name}-llama3_8b-L{opts.layers}", rows, notes=notes, device=device_name())
        if loss_rows:
            write_results(
                f"{name}_losses-llama3_8b-L{opts.layers}",
                loss_rows,
                notes=f"`{command}`: the loss of every step ({opts.warmup} warm-up steps, then "
                f"{opts.steps} timed) on each comm path, the same initial weights and tokens on every path.",
                device=device_name(),
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
