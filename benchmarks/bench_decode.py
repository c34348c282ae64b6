"""End-to-end decode benchmark: serve.py's decode loop on a preset with random weights, several batch
sizes, bf16 (and FP8 where the kernels exist), with the roofline beside each row.

    python -m benchmarks.bench_decode --model llama3_8b --batch-sizes 1 8 32
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from benchmarks.common import write_results
from configs.schema import register_configs
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
        "--compile", action="store_true", help="also time the compiled decode step (*-compiled files)"
    )
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA GPU")
    device = torch.device("cuda")
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("serve", overrides=[f"model={opts.model}"])
    rows = []
    for fp8 in [False, True] if opts.fp8 else [False]:
        args = OmegaConf.to_object(cfg.model)
        args.fp8 = fp8
        model = build_model(args, None, device, torch.bfloat16)
        for compile in [False, True] if opts.compile else [False]:
            for batch in opts.batch_sizes:
                row = benchmark_decode(
                    model, batch, opts.prompt_len, opts.decode_steps, True, device, compile
                )
                rows.append({"fp8": fp8, **row})
                print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    write_results(
        f"decode-{opts.model}" + ("-compiled" if opts.compile else ""),
        rows,
        notes=f"prompt {opts.prompt_len}, {opts.decode_steps} decode steps timed, CUDA graphs",
    )


if __name__ == "__main__":
    main()
