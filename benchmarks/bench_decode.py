"""End-to-end decode benchmark: serve.py's decode loop on a preset with random weights, several batch
sizes, bf16 on weft's decode kernels (and on the stock modules with --stock, FP8 with --fp8), with the
roofline beside each row.

    python -m benchmarks.bench_decode --model llama3_8b --batch-sizes 1 8 32 [--fp8] [--stock] [--compile]
    torchrun --nproc_per_node=4 -m benchmarks.bench_decode --model llama3_70b --comms torch symm_mem triton

    python -m benchmarks.bench_decode --model llama3_70b --batch-sizes 1 8 --fp8 --compile   # one H200
    python -m benchmarks.bench_decode --model llama3_70b --batch-sizes 1 8 --fp8-only --compile

Under torchrun the model is tensor-parallel over all ranks (tp = world size, serve.py's decode plan:
each rank materialises only its shards) and each `--comms` path is timed in turn; the roofline is this
rank's weights and KV cache over one GPU's copy bandwidth (communication not counted). A dtype whose
model does not fit (model/memory.py's estimate refuses it, e.g. bf16 Llama-3-70B on one H100, or it runs
out of memory on one GPU) is skipped with the reason in the results' notes, and the other still runs.
Rank 0 writes
benchmarks/results/decode-<model>[-compiled]-<device>.{json,md}.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import add_decode_shape_args, preset_args, refuse_shared_gpu, write_results
from model.memory import check_serving_fits
from parallel import distributed
from parallel.mesh import ParallelDims, build_mesh, validate_comm_ops, validate_model
from serve import benchmark_decode, build_model


def with_skipped(notes: str, skipped: list[str]) -> str:
    """The results' notes, with the configurations that did not run and why."""
    return notes + "".join(f"; not run: {reason}" for reason in skipped)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_decode_shape_args(parser, [1, 8, 32])
    parser.add_argument("--fp8", action="store_true", help="also run the FP8 decode path")
    parser.add_argument("--fp8-only", action="store_true", help="run the FP8 decode path only (no bf16 rows)")
    parser.add_argument(
        "--stock", action="store_true", help="also run bf16 on the stock modules (model.decode_kernels=false)"
    )
    parser.add_argument(
        "--compile", action="store_true", help="also time the compiled decode step (*-compiled files)"
    )
    parser.add_argument(
        "--comms", nargs="+", default=["torch"], help="under torchrun: the parallel.comm paths to time"
    )
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA GPU")
    refuse_shared_gpu()
    distributed.init_distributed()
    world = distributed.world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    launcher = f"torchrun --nproc_per_node={world} " if world > 1 else "python "
    flags = "".join(
        flag for flag, on in [(" --fp8", opts.fp8), (" --fp8-only", opts.fp8_only), (" --stock", opts.stock),
                              (" --compile", opts.compile)] if on
    )  # fmt: skip
    comms = f" --comms {' '.join(opts.comms)}" if world > 1 else ""
    name = f"decode-{opts.model}" + ("-compiled" if opts.compile else "")
    notes = (
        f"`{launcher}-m benchmarks.bench_decode --model {opts.model} --batch-sizes "
        f"{' '.join(map(str, opts.batch_sizes))}{flags}{comms}`: prompt {opts.prompt_len}, "
        f"{opts.decode_steps} decode steps timed, CUDA graphs"
    )
    rows: list[dict[str, object]] = []
    skipped: list[str] = []  # "<dtype>: why", one per configuration that did not run
    cache_len = opts.prompt_len + opts.decode_steps

    def skip(reason: str) -> None:
        skipped.append(reason)
        if distributed.rank() == 0:
            print(f"skipped {reason}", flush=True)

    for comm in opts.comms if world > 1 else ["-"]:
        mesh = None
        if world > 1:
            dims = ParallelDims(dp=1, cp=1, tp=world, comm=comm)
            validate_comm_ops(dims, training=False)
            validate_model(dims, preset_args(opts.model))
            mesh = build_mesh(dims, "cuda")
        # (model.fp8, model.decode_kernels): bf16 on weft's kernels, on the stock modules, FP8.
        variants = [] if opts.fp8_only else [(False, True)] + [(False, False)] * opts.stock
        variants += [(True, True)] * (opts.fp8 or opts.fp8_only)
        for fp8, decode_kernels in variants:
            args = preset_args(opts.model)
            args.fp8, args.decode_kernels = fp8, decode_kernels
            label = "fp8" if fp8 else "bf16" if decode_kernels else "bf16 (stock)"
            try:  # the estimate decides alike on every rank
                shrink = "lower --batch-sizes, --prompt-len or --decode-steps"
                batch = max(opts.batch_sizes)
                check_serving_fits(args, world, "bfloat16", batch, opts.prompt_len, cache_len, device, shrink)
            except ValueError as err:
                skip(f"{label}: {err}")
                continue
            model = None
            try:
                model = build_model(args, None, device, torch.bfloat16, mesh, comm)
                for compile in [False, True] if opts.compile else [False]:
                    for batch in opts.batch_sizes:
                        row = benchmark_decode(
                            model, batch, opts.prompt_len, opts.decode_steps, True, device, compile
                        )
                        rows.append({"tp": world, "comm": comm, "fp8": fp8, **row})
                        if distributed.rank() == 0:
                            # Rewritten after every row, so a run cut short keeps what it measured.
                            write_results(name, rows, notes=with_skipped(notes, skipped))
            except torch.OutOfMemoryError:
                if world > 1:  # the other ranks would wait for this one in a collective
                    raise
                # The estimate passed it but leaves out the allocator's slack and workspaces.
                skip(f"{label}: out of memory on one {torch.cuda.get_device_name(device)}")
            model = None
            # Every model compiles its own graphs: without a reset the compile cache of `forward` fills
            # up over the variants and comm paths of one run (Dynamo's recompile limit, 8 by default).
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    if rows and skipped and distributed.rank() == 0:
        write_results(name, rows, notes=with_skipped(notes, skipped))
    distributed.shutdown()


if __name__ == "__main__":
    main()
