"""The per-step logits of serve.py's greedy decode at tp = the torchrun world size, for
tests/test_torchrun_gpu.py: the model built as serve.py builds it (`build_model`: the checkpoint,
tensor-parallel over parallel.comm=triton, FP8 or bf16), the prompt prefilled, then one compiled,
CUDA-graphed step per token. Free-running, each step feeds the argmax of the last logits; with
`--tokens`, the tokens of an earlier run instead (teacher forcing), so that two runs' logits compare step
by step even where a near-tie between two tokens sends their greedy completions apart. Rank 0 saves
{"tokens": [steps], "logits": [steps, vocab] fp32} to `--out`.

    torchrun --nproc_per_node=2 -m tests.tp_decode_logits --checkpoint DIR --prompt "Hi" --steps 24 \
        --fp8 --tokens tp1.pt --out tp2.pt
"""

from __future__ import annotations

import argparse

import torch

from model.generate import DecodeStep, prefill
from model.loading import checkpoint_args, checkpoint_tokenizer, resolve_checkpoint
from parallel import distributed
from parallel.mesh import ParallelDims, build_mesh, validate_model
from serve import build_model


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--tokens", help="a file of an earlier run: feed its tokens instead of the argmax")
    p.add_argument("--out", required=True)
    opts = p.parse_args()

    distributed.init_distributed()
    world = distributed.world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    path = resolve_checkpoint(opts.checkpoint)
    args = checkpoint_args(path)
    args.fp8 = opts.fp8
    mesh = None
    if world > 1:
        dims = ParallelDims(dp=1, cp=1, tp=world, comm="triton")
        validate_model(dims, args)
        mesh = build_mesh(dims, "cuda")
    model = build_model(args, path, device, torch.bfloat16, mesh, "triton")

    prompt = torch.tensor([checkpoint_tokenizer(path).encode_prompt(opts.prompt)], device=device)
    forced = torch.load(opts.tokens)["tokens"].to(device) if opts.tokens else None
    if forced is not None and forced.numel() != opts.steps:
        raise ValueError(f"--tokens holds {forced.numel()} tokens, --steps is {opts.steps}")
    model.setup_caches(1, prompt.shape[1] + opts.steps)
    step = DecodeStep(model, 1, device, cuda_graph=True, compile=True)
    logits = [prefill(model, prompt)[0].to(torch.float32, copy=True)]
    tokens = []
    for i in range(opts.steps):
        tokens.append(forced[i] if forced is not None else logits[-1].argmax())
        if i + 1 < opts.steps:
            # A copy: the CUDA graph's output buffer is overwritten by the next replay.
            logits.append(step(tokens[-1].view(1, 1), prompt.shape[1] + i)[0].to(torch.float32, copy=True))
    if distributed.rank() == 0:
        torch.save({"tokens": torch.stack(tokens).cpu(), "logits": torch.stack(logits).cpu()}, opts.out)
    distributed.shutdown()


if __name__ == "__main__":
    main()
