"""Decode with a Llama-style model: a benchmark table (default) or a text completion.

    python serve.py                                          # decode benchmark, debug preset, random weights
    python serve.py mode=bench model=llama3_8b               # on a GPU: bf16 with the roofline beside it
    python serve.py model=llama3_70b model.fp8=true          # 70B in FP8 on one H200 (quantized as it loads)
    python serve.py mode=generate checkpoint=runs/train/X prompt="'def fib(n):'"
    python serve.py checkpoint=/path/to/Llama-3.1-8B mode=generate   # a Hugging Face directory
    python serve.py checkpoint=/path/to/Llama-3.1-8B-Instruct mode=generate chat=true prompt="Hi"
    python serve.py -m batch_size=1,8,32                     # one benchmark per batch size
    torchrun --nproc_per_node=4 serve.py parallel.tp=4 model=llama3_8b   # tensor parallel decode

Every key is listed, typed and documented in configs/schema.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from torch.distributed.device_mesh import DeviceMesh

from configs.launch import JobFailed, UserError, command_line_overrides, launch, user_errors
from configs.schema import ServeConfig
from configs.validate import (
    SERVE_DTYPES,
    check_mode_overrides,
    check_prompt_override,
    check_shape_overrides,
    validate_serve_config,
)
from model.args import ModelArgs
from model.chat import load_chat_template, read_messages, render_chat
from model.decode import (
    Bf16Kernels,
    DecodeBlock,
    convert_block,
    convert_head,
    identity,
    runs_bf16_decode_kernels,
)
from model.fp8 import Fp8Kernels, check_fp8_device
from model.generate import DecodeStep, Sampling, decode_tokens, prefill
from model.generation_config import resolve_max_new_tokens, resolve_sampling, stop_ids, unapplied_settings
from model.llama import Llama
from model.loading import checkpoint_tokenizer, resolve_init_weights, tokenizer_dir
from model.memory import check_serving_fits
from model.tokenizer import HFTokenizer, TextStream, Tokenizer
from parallel import distributed
from parallel.checkpoint import materialize
from parallel.mesh import build_mesh, validate_comm_ops, validate_decode_graphs, validate_model
from parallel.parallelize import ParallelizeConfig, decode_hooks, fp8_decode_hooks, parallelize_llama
from report import environment, markdown_table

log = logging.getLogger("serve")
# serve.log alone (configs/hydra/job_logging/weft.yaml): the completion, streamed to the console already.
record = logging.getLogger("record")

DTYPES = {name: getattr(torch, name) for name in SERVE_DTYPES}


def build_model(
    args: ModelArgs,
    checkpoint: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    mesh: DeviceMesh | None = None,
    comm: str = "torch",
) -> Llama:
    """The model in `dtype` on `device`: a checkpoint's weights, or random ones of the preset. With a
    `mesh` whose tp > 1 it is tensor-parallel for decode over `comm` (no sequence parallelism; row-parallel
    outputs all-reduced, full logits gathered for sampling), planned on the meta device so that each
    rank only ever materialises its slice (a 70B model fits in 8 GPUs' memory this way). FP8 models,
    and bf16 ones on a CUDA GPU unless model.decode_kernels=false, decode on weft's kernels
    (model/fp8.py, model/decode.py). Each block is converted as soon as it has its weights, so that an
    FP8 model is never held whole in bf16 (70B in FP8, about 70 GB, builds on one H200 with room to
    spare for the KV cache)."""
    if args.fp8:
        check_fp8_device(device)
        if dtype != torch.bfloat16:
            raise ValueError(f"model.fp8=true computes in bfloat16: use dtype=bfloat16, not {dtype}")
    with torch.device("meta"):
        model = Llama(args)
    if mesh is not None:
        plan = ParallelizeConfig(comm=comm, sequence_parallel=False, fsdp=False)
        parallelize_llama(model, mesh, plan)
    kernels = None
    if args.fp8:
        hooks = fp8_decode_hooks(model)
        kernels = Fp8Kernels(hooks.pop("channel_amax", None))
    elif runs_bf16_decode_kernels(args, device, dtype):
        hooks = decode_hooks(model)
        kernels = Bf16Kernels()

    def convert(index: int) -> None:
        convert_block(model, index, kernels, hooks.get("reduce", identity))

    # Materialised directly in the serving dtype (an 8B model in fp32 would need twice the memory);
    # the init rebuilds the rotary table in fp32.
    materialize(model, device, checkpoint, dtype, block_done=convert if kernels else None)
    if kernels:
        convert_head(model, kernels, hooks.get("gather_logits", identity))
        model.requires_grad_(False)  # weft's kernels have no backward
        if device.type == "cuda":  # the last unconverted block and the quantize slices, cached
            torch.cuda.empty_cache()
    return model.eval()


def memory_bandwidth(device: torch.device) -> float:
    """Measured device copy bandwidth in bytes/s (bytes read plus bytes written)."""
    src = torch.empty(1 << 28, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 20 / (start.elapsed_time(end) / 1e3)


def decode_bytes_per_step(model: Llama, batch: int, first: int, end: int) -> float:
    """Bytes a decode step must read, the mean over the steps at positions `first` .. `end` - 1: every
    weight but the embedding table (of which it reads only `batch` rows), and the KV cache up to the
    step's position (attention at position p needs positions 0 .. p; weft's decode attention reads no
    further, the stock path reads the whole static cache and masks the rest)."""
    # FP8 weights and their scales are buffers; the rotary table and KV cache are not weights.
    buffers = [b for name, b in model.named_buffers() if name.endswith((".weight", ".scale"))]
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *buffers])
    embedding = model.tok_embeddings.weight
    table = embedding.numel() * embedding.element_size()
    # Decode reads `batch` rows of the embedding, all of it only as a tied bf16 output projection.
    weights -= 0 if model.args.tie_embeddings and not model.args.fp8 else table
    # The bytes grow linearly with the position: their mean is that of the first and the last step.
    return weights + (kv_cache_bytes(model, batch, first + 1) + kv_cache_bytes(model, batch, end)) / 2


def kv_cache_bytes(model: Llama, batch: int, cache_len: int) -> int:
    """Bytes of the KV cache for `batch` sequences of `cache_len` positions."""
    args = model.args
    # This rank's key/value heads (all of them, or its share under tensor parallelism).
    kv_heads = model.layers[0].attention.n_kv_heads
    dtype_bytes = model.tok_embeddings.weight.element_size()
    return 2 * args.n_layers * batch * kv_heads * args.head_dim * cache_len * dtype_bytes


@torch.no_grad()
def benchmark_decode(
    model: Llama,
    batch: int,
    prompt_len: int,
    decode_steps: int,
    cuda_graphs: bool,
    device: torch.device,
    compile: bool = False,
) -> dict[str, object]:
    """Prefill a random prompt, then time `decode_steps` decode steps (median over repeats)."""
    cache_len = prompt_len + decode_steps
    model.setup_caches(batch, cache_len)
    prompt = torch.randint(0, model.args.vocab_size, (batch, prompt_len), device=device)
    step = DecodeStep(model, batch, device, cuda_graphs, compile)
    token = prefill(model, prompt).argmax(-1)
    step(token, prompt_len)  # compile / capture outside the timed region

    def decode_all() -> None:
        nonlocal token
        for pos in range(prompt_len, cache_len):
            token = step(token, pos).argmax(-1)

    times = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            decode_all()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            decode_all()
            times.append((time.perf_counter() - t0) * 1e3)
    ms_per_step = sorted(times)[1] / decode_steps
    row: dict[str, object] = {
        "model": model.args.name,
        "dtype": "fp8" if model.args.fp8 else str(model.tok_embeddings.weight.dtype).removeprefix("torch."),
        # weft's decode kernels (model/decode.py), or the stock modules.
        "kernels": "weft" if isinstance(model.layers[0], DecodeBlock) else "stock",
        "compiled": compile,
        "batch": batch,
        "prompt_len": prompt_len,
        "ms_per_token": ms_per_step,
        "tokens_per_s": batch * 1e3 / ms_per_step,
    }
    if device.type == "cuda":
        bandwidth = memory_bandwidth(device)
        roofline_ms = decode_bytes_per_step(model, batch, prompt_len, cache_len) / bandwidth * 1e3
        row.update(
            {
                "roofline_ms": roofline_ms,
                "roofline_tokens_per_s": batch * 1e3 / roofline_ms,
                "of_roofline": roofline_ms / ms_per_step,
                "bandwidth_TBps": bandwidth / 1e12,
            }
        )
    model.clear_caches()
    return row


@dataclass
class Completion:
    """What mode=generate decodes, prepared (and checked) before the model is built."""

    tokenizer: Tokenizer
    prompt_ids: list[int]
    # Printed before the completion: the prompt's text (nothing for a chat, whose template is not echoed).
    echo: str
    sampling: Sampling
    stop_ids: list[int]
    max_new_tokens: int


def prepare_completion(cfg: ServeConfig, checkpoint: Path | None, args: ModelArgs) -> Completion:
    """The prompt's ids as transformers' tokenizer gives them (a chat rendered through the checkpoint's
    template first), the sampling settings and the stop ids; ValueError for any bad input."""
    directory = tokenizer_dir(checkpoint)
    tokenizer = checkpoint_tokenizer(checkpoint)
    if cfg.chat or cfg.messages is not None:
        messages = (
            read_messages(cfg.messages)
            if cfg.messages is not None
            else [{"role": "user", "content": cfg.prompt}]
        )
        # `messages` is a chat whatever `chat` says: the way out is to drop it.
        asked = "chat=true" if cfg.messages is None else "messages= is set"
        plain = "chat=false" if cfg.messages is None else "without messages="
        if not isinstance(tokenizer, HFTokenizer):
            raise ValueError(
                f"{asked} but the tokenizer (weft's byte tokenizer) has no chat template: "
                f"give a plain prompt ({plain})"
            )
        template = load_chat_template(directory)
        if template is None:
            raise ValueError(
                f"{asked} but the tokenizer ({directory}) has no chat template: add the model's "
                "chat_template.jinja (or tokenizer_config.json's chat_template), or give a plain prompt "
                f"({plain})"
            )
        text = render_chat(template, messages, tokenizer.special_tokens)
        ids, echo = tokenizer.encode_prompt(text, special_tokens=False), ""
    else:
        ids, echo = tokenizer.encode_prompt(cfg.prompt), cfg.prompt
    if not ids:
        raise ValueError("the prompt encodes to no tokens: give a non-empty prompt")
    if max(ids) >= args.vocab_size:
        raise ValueError(
            f"the prompt holds token id {max(ids)}, outside the model's vocabulary of {args.vocab_size}: "
            "the tokenizer does not match the model"
        )
    max_new_tokens, source = resolve_max_new_tokens(directory, cfg.max_new_tokens)
    if len(ids) + max_new_tokens > args.max_seq_len:
        where = "" if cfg.max_new_tokens is not None else f" (from {source})"
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_new_tokens={max_new_tokens}{where} exceeds model.max_seq_len="
            f"{args.max_seq_len}: shorten the prompt or lower max_new_tokens"
        )
    sampling = resolve_sampling(directory, cfg.temperature, cfg.top_k, cfg.top_p)
    unapplied = unapplied_settings(directory)
    if unapplied and distributed.rank() == 0:
        log.warning(
            f"warning: {directory / 'generation_config.json'} sets {', '.join(unapplied)}, which weft does "
            "not apply: the completion can differ from transformers' generate"
        )
    return Completion(tokenizer, ids, echo, sampling, stop_ids(directory, tokenizer), max_new_tokens)


def print_while_read(text: str, end: str = "") -> bool:
    """Print `text` on stdout; False once its reader has gone (`serve.py ... | head`). stdout then
    points at /dev/null, so that Python's flush at exit does not fail on the closed pipe again."""
    try:
        print(text, end=end, flush=True)
        return True
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False


def stream_completion(model: Llama, completion: Completion, cfg: ServeConfig, device: torch.device) -> None:
    """Decode the completion, rank 0 printing its text as the tokens arrive (after the echoed prompt),
    then a line of figures on stderr: prompt and new tokens, time to first token, the first decode step
    (which compiles and captures the step where asked) and the decode rate of the steps after it. When
    stdout's reader goes away, one process stops; ranks under torchrun decode on together to the end
    (every step is a collective), printing nothing more."""
    is_main = distributed.rank() == 0
    alone = distributed.world_size() == 1
    generator = torch.Generator(device).manual_seed(cfg.seed)
    prompt = torch.tensor([completion.prompt_ids], device=device)
    text = TextStream(completion.tokenizer, completion.prompt_ids)
    steps = decode_tokens(
        model,
        prompt,
        completion.max_new_tokens,
        completion.sampling,
        completion.stop_ids,
        cfg.cuda_graphs,
        cfg.compile,
        generator,
    )
    pieces = [completion.echo]
    read = print_while_read(completion.echo) if is_main else True
    start = time.perf_counter()
    arrived = []  # the first two tokens' times: prefill, then the first decode step
    new = 0
    for token in steps:
        token_id = token.item()  # waits for the token: the timings below are real
        new += 1
        if new <= 2:
            arrived.append(time.perf_counter())
        if is_main:
            pieces.append(text.push(token_id))
            read = read and print_while_read(pieces[-1])
        if not read and alone:
            break
    end = time.perf_counter()
    if is_main:
        pieces.append(text.flush())
        if read:
            print_while_read(pieces[-1], end="\n")
        figures = [f"{len(completion.prompt_ids)} prompt tokens", f"{new} new tokens"]
        figures.append(f"time to first token {(arrived[0] - start) * 1e3:.0f} ms" if arrived else "no token")
        if new > 1:
            figures.append(f"first decode step {(arrived[1] - arrived[0]) * 1e3:.0f} ms")
        if new > 2:
            figures.append(f"decode {(new - 2) / (end - arrived[1]):.1f} tokens/s")
        stats = f"[{', '.join(figures)}]"
        print(stats, file=sys.stderr, flush=True)
        record.info("".join(pieces))
        record.info(stats)


def run(cfg: ServeConfig, run_dir: Path) -> None:
    overrides = command_line_overrides()
    check_prompt_override(overrides)  # (first: reading cfg.prompt resolves a ${...} in it)
    validate_serve_config(cfg)
    check_mode_overrides(cfg.mode, overrides, cfg.messages)
    device = distributed.resolve_device(cfg.device)
    dims = distributed.validate_parallel(cfg.parallel, distributed.world_size(), device)
    validate_comm_ops(dims, training=False)
    validate_decode_graphs(dims, cfg.cuda_graphs and device.type == "cuda")
    if dims.cp > 1 or dims.dp > 1:
        raise ValueError(
            f"serve.py decodes one model over all {dims.world} ranks with tensor parallelism: "
            f"set parallel.tp={dims.world} parallel.cp=1"
        )
    dtype = DTYPES[cfg.dtype]
    torch.manual_seed(cfg.seed)
    if cfg.checkpoint is not None:
        check_shape_overrides(overrides, "checkpoint")
    checkpoint, args = resolve_init_weights(cfg.checkpoint, OmegaConf.to_object(cfg.model))
    validate_model(dims, args)
    completion = prepare_completion(cfg, checkpoint, args) if cfg.mode == "generate" else None
    if completion is None:
        if cfg.prompt_len + cfg.decode_steps > args.max_seq_len:
            raise ValueError(
                f"prompt_len + decode_steps = {cfg.prompt_len + cfg.decode_steps} exceeds model.max_seq_len="
                f"{args.max_seq_len}: lower them"
            )
        batch, prompt_len, cache_len = cfg.batch_size, cfg.prompt_len, cfg.prompt_len + cfg.decode_steps
        shrink = "lower batch_size, prompt_len or decode_steps"
    else:
        batch, prompt_len = 1, len(completion.prompt_ids)
        cache_len = prompt_len + completion.max_new_tokens
        shrink = "shorten the prompt or lower max_new_tokens"
    check_serving_fits(args, dims.tp, cfg.dtype, batch, prompt_len, cache_len, device, shrink)
    mesh = build_mesh(dims, device.type) if dims.tp > 1 else None
    model = build_model(args, checkpoint, device, dtype, mesh, dims.comm)

    if completion is not None:
        stream_completion(model, completion, cfg, device)
        return

    row = benchmark_decode(
        model, cfg.batch_size, cfg.prompt_len, cfg.decode_steps, cfg.cuda_graphs, device, cfg.compile
    )
    # What ran: the checkpoint as given (a Hugging Face directory's args are all named "hf") and the layout.
    model_name = Path(cfg.checkpoint).resolve().name if cfg.checkpoint is not None else row["model"]
    row = {"tp": dims.tp, "comm": dims.comm if dims.tp > 1 else "-", **row, "model": model_name}
    if distributed.rank() == 0:
        table = markdown_table([row])
        log.info(table)
        (run_dir / "bench.json").write_text(json.dumps({**environment(), "rows": [row]}, indent=2))
        (run_dir / "bench.md").write_text(table)


def forget_refused_launch(run_dir: Path) -> None:
    """Remove the run directory of a launch refused before it logged anything: Hydra's config copies
    and an empty serve.log are all it holds. A directory holding anything else stays as it is."""
    if not run_dir.is_dir():
        return
    log_file = run_dir / "serve.log"
    names = {path.name for path in run_dir.iterdir()}
    if names <= {".hydra", "serve.log"} and not (log_file.is_file() and log_file.stat().st_size):
        shutil.rmtree(run_dir, ignore_errors=True)


@hydra.main(version_base=None, config_path="configs", config_name="serve")
def main(cfg: ServeConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        with user_errors():
            run(cfg, run_dir)
    except (UserError, JobFailed):
        forget_refused_launch(run_dir)
        raise


if __name__ == "__main__":
    launch(main)
