"""End-to-end decode benchmark: serve.py's decode loop on a preset with random weights, several batch
sizes, bf16 on weft's decode kernels (and on the stock modules with --stock, FP8 with --fp8), with the
roofline beside each row.

    python -m benchmarks.bench_decode --model llama3_8b --batch-sizes 1 8 32 [--fp8] [--stock] [--compile]
    torchrun --nproc_per_node=4 -m benchmarks.bench_decode --model llama3_70b --comms torch symm_mem triton

Under torchrun the model is tensor-parallel over all ranks (tp = world size, serve.py's decode plan:
each rank materialises only its shards) and each `--comms` path is timed in turn; the roofline is this
rank's weights and KV cache over one GPU's copy bandwidth (communication not counted). Rank 0 writes
benchmarks/results/decode-<model>[-compiled]-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from benchmarks.common import refuse_shared_gpu, write_results
from configs.schema import register_configs
from parallel import distributed
from parallel.mesh import ParallelDims, build_mesh, validate_comm_ops, validate_model
from serve import benchmark_decode, build_model

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama3_8b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--fp8", action="store_true", help="also run the FP8 decode path")
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
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("serve", overrides=[f"model={opts.model}"])
    launcher = f"torchrun --nproc_per_node={world} " if world > 1 else "python "
    flags = " --fp8" * opts.fp8 + " --stock" * opts.stock + " --compile" * opts.compile
    comms = f" --comms {' '.join(opts.comms)}" if world > 1 else ""
    name = f"decode-{opts.model}" + ("-compiled" if opts.compile else "")
    notes = (
        f"`{launcher}-m benchmarks.bench_decode --model {opts.model} --batch-sizes "
        f"{' '.join(map(str, opts.batch_sizes))}{flags}{comms}`: prompt {opts.prompt_len}, "
        f"{opts.decode_steps} decode steps timed, CUDA graphs"
    )
    rows = []
    for comm in opts.comms if world > 1 else ["-"]:
        mesh = None
        if world > 1:
            dims = ParallelDims(dp=1, cp=1, tp=world, comm=comm)
            validate_comm_ops(dims, training=False)
            validate_model(dims, OmegaConf.to_object(cfg.model), training=False)
            mesh = build_mesh(dims, "cuda")
        # (model.fp8, model.decode_kernels): bf16 on weft's kernels, on the stock modules, FP8.
        variants = [(False, True)] + [(False, False)] * opts.stock + [(True, True)] * opts.fp8
        for fp8, decode_kernels in variants:
            args = OmegaConf.to_object(cfg.model)
            args.fp8, args.decode_kernels = fp8, decode_kernels
            model = build_model(args, None, device, torch.bfloat16, mesh, comm)
            for compile in [False, True] if opts.compile else [False]:
                for batch in opts.batch_sizes:
                    row = benchmark_decode(
                        model, batch, opts.prompt_len, opts.decode_steps, True, device, compile
                    )
                    rows.append({"tp": world, "comm": comm, "fp8": fp8, **row})
                    if distributed.rank() == 0:
                        # Rewritten after every row, so a run cut short keeps what it measured.
                        write_results(name, rows, notes=notes)
            del model
            torch.cuda.empty_cache()
    distributed.shutdown()


if __name__ == "__main__":
    main()
