"""Train a Llama-style model.

    python train.py                                   # debug model on the built-in corpus
    python train.py model=llama3_8b training.steps=100
    torchrun --nproc_per_node=2 train.py              # data parallel (gloo on CPU, NCCL on GPU)
    torchrun --nproc_per_node=4 train.py parallel.tp=2  # tensor + sequence parallel x FSDP2 (dp=2)
    python train.py hydra.run.dir=runs/mine           # run again with the same dir: resumes

Ctrl-C (SIGINT) or SIGTERM stops after the current step with a checkpoint and prints the command that
resumes; a second one exits at once.

Every key is listed, typed and documented in configs/schema.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import hydra
import numpy as np
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from configs.launch import command_line_overrides, launch, user_errors
from configs.schema import TrainConfig, TrainingConfig
from configs.validate import check_shape_overrides, validate_train_config
from model.args import ModelArgs
from model.checkpoint import CheckpointWriteError, load_checkpoint, load_newest_intact, save_checkpoint
from model.data import PackedDataset, corpus_tokens, marks_document_boundaries, shared_files
from model.hf import export_hf
from model.llama import Llama
from model.loading import checkpoint_tokenizer, resolve_init_weights
from model.memory import check_training_fits
from model.tokenizer import HFTokenizer, Tokenizer, save_tokenizer
from parallel import distributed
from parallel.checkpoint import (
    export_parallel_hf,
    load_parallel_checkpoint,
    materialize,
    save_parallel_checkpoint,
)
from parallel.comm import check_comms
from parallel.loss import cross_entropy
from parallel.mesh import build_mesh, data_parallel_rank, validate_comm_ops, validate_model
from parallel.parallelize import (
    ParallelizeConfig,
    apply_activation_checkpointing,
    clip_grad_norm_,
    parallelize_llama,
)
from training.evaluate import HeldOutLoss
from training.interrupt import StopRequest
from training.metrics import MetricsLog, require_tensorboard
from training.profile import StepProfiler
from training.records import (
    LaunchRecord,
    RunDirectoryInUse,
    data_parallel_change,
    data_windows_change,
    resume_changes,
    resume_command,
    run_directory_lock,
    shown,
)

log = logging.getLogger("train")

# Dense bf16 tensor-core peaks (FLOP/s), for MFU, by a part of the device's name: the first that matches.
# The PCIe and NVL cards of a chip run at lower clocks than its SXM ones (NVIDIA's datasheets).
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200 NVL": 835e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "B200": 2250e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


def peak_bf16_flops(name: str) -> float | None:
    """The dense bf16 peak of the GPU named `name` (torch.cuda.get_device_name), None where unknown."""
    return next((flops for chip, flops in PEAK_BF16_FLOPS.items() if chip in name), None)


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to min_ratio at the last step. `step` counts from 0 (the
    scheduler's count of steps taken), so the last step is total - 1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.training.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    t = cfg.training
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=device.type == "cuda")


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float  # the learning rate this step used
    tokens: int
    seconds: float


class NonFiniteStep(RuntimeError):
    """A step whose loss or gradient norm is NaN or infinite (what became so, in words); raised before
    the optimizer changes any weight."""


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    dataset: PackedDataset,
    cfg: TrainConfig,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    dp_size: int,
    cp_chunk: slice | None = None,
) -> StepStats:
    """One optimizer step. `dp_size`: ranks holding different batches; `cp_chunk`: this rank's part of
    the sequence under context parallelism."""
    start = time.perf_counter()
    t = cfg.training
    total_loss = torch.zeros((), device=device)
    fsdp = hasattr(model, "set_requires_gradient_sync")
    # training.compile wraps the DDP module, whose no_sync() stays the wrapped one's.
    ddp = getattr(model, "_orig_mod", model)
    for micro in range(t.grad_accum):
        inputs, targets = (x.to(device, non_blocking=True) for x in dataset.next_batch())
        if cp_chunk is not None:
            inputs, targets = inputs[:, cp_chunk], targets[:, cp_chunk]
        # Only the last micro-batch reduces gradients over data-parallel ranks (DDP or FSDP2).
        last = micro == t.grad_accum - 1
        sync = last or not isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        context = ddp.no_sync() if not sync else torch.enable_grad()
        if fsdp:
            model.set_requires_gradient_sync(last)
        with context:
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                logits = model(inputs)
                # Vocabulary-parallel when tensor parallelism leaves the logits sharded (parallel/loss.py).
                loss = cross_entropy(model, logits, targets)
            # Outside autocast, as PyTorch advises: its cast cache, a bf16 copy of every weight used,
            # is freed when the forward's autocast ends, which checkpointed blocks need to save memory.
            (loss / t.grad_accum).backward()
        total_loss += loss.detach() / t.grad_accum
    if dist.is_initialized():
        dist.all_reduce(total_loss, op=dist.ReduceOp.AVG)
    loss_value = total_loss.item()
    check_comms()  # a comm kernel that gave up waiting for a peer fails the step, naming the peer
    if not math.isfinite(loss_value):
        raise NonFiniteStep(f"loss became {loss_value}")
    clip = t.grad_clip if t.grad_clip > 0 else float("inf")
    if hasattr(model, "parallel"):  # sharded parameters: the global norm needs their shards' sums
        grad_norm = clip_grad_norm_(model, clip).item()
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
    # A finite loss can still come with non-finite gradients; the update would spread them into every
    # weight (and into the checkpoint kept as the last good one). The norm is global: every rank agrees.
    if not math.isfinite(grad_norm):
        raise NonFiniteStep(f"the gradient norm became {grad_norm}")
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    tokens = t.batch_size * t.seq_len * t.grad_accum * dp_size
    return StepStats(loss_value, grad_norm, lr, tokens, time.perf_counter() - start)


def set_optimizer_values(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    cfg: TrainConfig,
    step: int,
) -> None:
    """Put the configured lr schedule, betas and weight decay over those a resumed checkpoint restored
    (build_optimizer's groups: the decayed matrices first)."""
    t = cfg.training
    lr = t.lr * lr_lambda(step, t.warmup_steps, t.steps, t.min_lr_ratio)
    for group in optimizer.param_groups:
        group.update(initial_lr=t.lr, lr=lr, betas=(t.beta1, t.beta2))
    optimizer.param_groups[0]["weight_decay"] = t.weight_decay
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)


def check_resume_config(
    meta: dict,
    cfg: TrainConfig,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    step: int,
    source: Path,
    dp_size: int,
    windows: int,
) -> None:
    """Say what a resume changes from the config (and data-parallel ranks, and the `windows` of the
    data's epoch) the checkpoint `meta` was saved with; a changed schedule is refused unless
    training.allow_schedule_change=true, then applied from the next step."""
    saved, current = meta.get("config"), OmegaConf.to_container(cfg, resolve=True)
    schedule, other = resume_changes(saved, current)
    other += data_parallel_change(saved, meta["data"], dp_size)
    other += data_windows_change(saved, current, meta["data"], windows)
    if other and distributed.rank() == 0:
        log.warning(f"warning: resuming {shown(source)} with changed values: {', '.join(other)}")
    if not schedule:
        return
    t = cfg.training
    new_lr = t.lr * lr_lambda(step, t.warmup_steps, t.steps, t.min_lr_ratio)
    change = (
        f"{', '.join(schedule)}; learning rate of step {step + 1}: "
        f"{optimizer.param_groups[0]['lr']:.3g} -> {new_lr:.3g}"
    )
    if not t.allow_schedule_change:
        raise ValueError(
            f"resuming {shown(source)} with a changed schedule ({change}): set "
            f"training.allow_schedule_change=true to apply it from step {step + 1}, or resume with the "
            "checkpoint's values"
        )
    if distributed.rank() == 0:
        log.warning(f"warning: resuming with a changed schedule ({change})")
    set_optimizer_values(optimizer, scheduler, cfg, step)


def save_run_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    dataset: PackedDataset,
    cfg: TrainConfig,
    sharded: bool,
    hf_tokenizer: bool,
) -> CheckpointWriteError | None:
    """Save `step` (collective): a sharded model is gathered by every rank to full tensors and rank 0
    writes them (the layout-free format); data parallel ranks hold identical state and rank 0 saves.
    Returns rank 0's write error (a full disk) on rank 0; the other ranks learn that there was one."""
    config = OmegaConf.to_container(cfg, resolve=True)  # what the training was told, kept in meta.json
    state = (run_dir, step, model, optimizer, scheduler, dataset.state_dict())

    def write() -> None:
        if sharded:
            save_parallel_checkpoint(*state, cfg.checkpoint.keep, config, hf_tokenizer)
        elif distributed.rank() == 0:
            save_checkpoint(*state, keep=cfg.checkpoint.keep, config=config, hf_tokenizer=hf_tokenizer)

    return rank_0_write_error(write, "save the checkpoint")


def rank_0_write_error(write: Callable[[], object], what: str) -> CheckpointWriteError | None:
    """Run `write` (collective where a sharded model is gathered), then agree on whether it failed (also
    the barrier that waits for rank 0's write). Returns rank 0's CheckpointWriteError (a full disk) on
    rank 0, and on the other ranks one saying that rank 0 could not `what`. Any other error is raised
    on its rank after the agreement, so that no rank is left waiting in it."""
    error: Exception | None = None
    try:
        write()
    except Exception as err:
        error = err
    if dist.is_initialized():
        failed = torch.tensor([error is not None], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            error = CheckpointWriteError(f"rank 0 could not {what}")
    if error is not None and not isinstance(error, CheckpointWriteError):
        raise error
    return error


def kept_checkpoint(run_dir: Path, last_saved: int) -> str:
    """What a run stopped by an error keeps: its last checkpoint (step `last_saved`), if any."""
    if last_saved == 0:
        return "no checkpoint was saved before it"
    return f"the last good checkpoint (step {last_saved}) is kept in {run_dir / 'checkpoints'}"


def launch_resume_command(run_dir: Path, step: int) -> str:
    """The command that resumes this launch from its checkpoint of `step` (a job of a multirun sweep:
    that job alone)."""
    sweep_job = command_line_overrides() if HydraConfig.get().mode == RunMode.MULTIRUN else None
    return resume_command(run_dir, step, sweep_job)


def stop_run(why: str) -> NoReturn:
    """Stop every rank of a run that cannot go on: rank 0 says why on stderr and in train.log (whose
    `record` logger writes to the file alone), the other ranks exit quietly with status 1."""
    if distributed.rank() != 0:
        raise SystemExit(1)
    logging.getLogger("record").error(why)
    raise SystemExit(why)


def export_run(
    model: torch.nn.Module, args: ModelArgs, run_dir: Path, tokenizer: Tokenizer, sharded: bool, step: int
) -> None:
    """checkpoint.export_hf: the weights trained to `step` as a directory transformers loads, in
    run_dir / "hf" (collective: a sharded model is gathered by every rank one tensor at a time, rank 0
    writing each as it comes). A failed write (a full disk) stops every rank; rank 0 says why and how to
    export again."""
    out = run_dir / "hf"

    def write() -> None:
        if sharded:
            export_parallel_hf(model, out, tokenizer=tokenizer, overwrite=True)
        elif distributed.rank() == 0:
            export_hf(model, args, out, tokenizer=tokenizer, overwrite=True)

    error = rank_0_write_error(write, "export the model")
    if error is not None:
        # The run is at training.steps: relaunched, it trains nothing and exports.
        stop_run(
            f"{error}: the run's checkpoints are kept in {shown(run_dir / 'checkpoints')}. Free space "
            f"and export them with: {launch_resume_command(run_dir, step)}"
        )
    if distributed.rank() == 0:
        log.info(f"exported a Hugging Face model to {out}")


def due(step: int, every: int, training: TrainingConfig) -> bool:
    """Whether a periodic action (every `every` steps, 0: only at the end) comes at `step`: at its
    multiples, and at the launch's last step (training.steps or training.stop_at)."""
    return step in (training.steps, training.stop_at) or (every > 0 and step % every == 0)


def read_corpus(
    key: str, path: str | None, cfg: TrainConfig, tokenizer: Tokenizer, vocab_size: int, stop: StopRequest
) -> tuple[np.ndarray, str]:
    """The token ids of `path` (the corpus of the config key `key`: data.path or eval.path), memory-mapped:
    tokenized once into data.cache_dir (by rank 0, and on a node that cannot see its file by the node's
    LOCAL_RANK 0), then read by every rank and every later launch; and a line on where they come from.
    A signal while tokenizing stops the launch as before the first step."""
    try:
        return corpus_tokens(
            path,
            cfg.data.jsonl_field,
            tokenizer,
            cfg.data.cache_dir,
            vocab_size,
            stop_requested=lambda: stop.signal is not None,
            key=key,
        )
    except KeyboardInterrupt:
        if stop.signal is None:
            raise
        log.info(f"{stop.signal.name} while tokenizing the corpus: stopping; nothing trained, nothing saved")
        raise SystemExit(stop.exit_code) from None


def step_record(stats: StepStats, step: int, device: torch.device, peak: float | None, flops: float) -> dict:
    """A metrics.jsonl line (and the progress bar's figures) for a step; `flops` per token."""
    record = {
        "step": step,
        "loss": round(stats.loss, 5),
        "lr": stats.lr,
        "grad_norm": round(stats.grad_norm, 4),
        "tokens_per_s": round(stats.tokens / stats.seconds, 1),
    }
    if device.type == "cuda":
        record["memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
        if peak is not None:
            world = distributed.world_size()
            record["mfu"] = round(stats.tokens / world * flops / stats.seconds / peak, 4)
    return record


def run(cfg: TrainConfig, run_dir: Path, launch_record: LaunchRecord, stop: StopRequest) -> None:
    validate_train_config(cfg)
    device = distributed.resolve_device(cfg.device)
    args: ModelArgs = OmegaConf.to_object(cfg.model)
    t = cfg.training
    world, rank = distributed.world_size(), distributed.rank()
    dims = distributed.validate_parallel(cfg.parallel, world, device)
    validate_comm_ops(dims, training=True)
    if cfg.logging.tensorboard:
        require_tensorboard()
    torch.manual_seed(t.seed)

    if cfg.checkpoint.init_from is not None:
        check_shape_overrides(command_line_overrides(), "checkpoint.init_from")
    init_path, args = resolve_init_weights(cfg.checkpoint.init_from, args)
    if t.seq_len > args.max_seq_len:  # the checkpoint's max_seq_len where one is loaded
        fix = "lower training.seq_len" if init_path else "lower training.seq_len or raise model.max_seq_len"
        raise ValueError(
            f"training.seq_len={t.seq_len} exceeds the model's max_seq_len={args.max_seq_len}: {fix}"
        )
    validate_model(dims, args, seq_len=t.seq_len)
    # Tensor / context parallel (or FSDP or HSDP asked for): the (dp, cp, tp) mesh and parallelize_llama.
    # Otherwise every rank holds the whole model and DDP averages gradients, as before.
    sharded = dims.model_parallel or (world > 1 and cfg.parallel.fsdp) or dims.dp_replicate > 1
    check_training_fits(args, dims, t, sharded, device)
    mesh = build_mesh(dims, device.type) if sharded else None
    dp_rank = data_parallel_rank(mesh) if mesh is not None else rank
    dp_size = dims.dp if mesh is not None else world
    cp_chunk = None
    if dims.cp > 1:
        cp_rank, cp_len = mesh["cp"].get_local_rank(), t.seq_len // dims.cp
        cp_chunk = slice(cp_rank * cp_len, (cp_rank + 1) * cp_len)
    tokenizer = checkpoint_tokenizer(init_path)
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={args.vocab_size}: "
            "raise model.vocab_size"
        )
    # Where the tokens come from, `tokens_origin`, is logged after the run directory.
    tokens, tokens_origin = read_corpus("data.path", cfg.data.path, cfg, tokenizer, args.vocab_size, stop)
    dataset = PackedDataset(
        tokens,
        seq_len=t.seq_len,
        batch_size=t.batch_size,
        rank=dp_rank,
        world_size=dp_size,
        seed=t.seed,
    )
    held_out, held_out_origin = None, ""
    if cfg.eval.path is not None:
        held_out_tokens, held_out_origin = read_corpus(
            "eval.path", cfg.eval.path, cfg, tokenizer, args.vocab_size, stop
        )
        held_out = HeldOutLoss(held_out_tokens, cfg, dp_rank, dp_size, cfg.eval.path)

    autocast_dtype = getattr(torch, t.dtype) if device.type == "cuda" and t.dtype != "float32" else None
    with torch.device("meta"):
        model = Llama(args)
    if mesh is not None:
        # Planned on the meta device: each rank materialises only its shards (of the same weights an
        # unsharded run starts from).
        plan = ParallelizeConfig(
            comm=dims.comm,
            activation_checkpointing=t.activation_checkpointing,
            compile=t.compile,
            fsdp=True,
            fsdp_param_dtype=autocast_dtype,
        )
        parallelize_llama(model, mesh, plan)
    materialize(model, device, init_path)
    optimizer = build_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, t.warmup_steps, t.steps, t.min_lr_ratio)
    )

    start_step = 0
    load = load_parallel_checkpoint if mesh is not None else load_checkpoint
    resumed = load_newest_intact(run_dir, lambda path: load(path, model, optimizer, scheduler))
    if resumed is not None:
        resume_from, meta = resumed
        dataset.load_state_dict(meta["data"])
        start_step = meta["step"]
        if start_step >= t.steps:
            if rank == 0:
                done = f"{shown(run_dir)} already holds step {start_step}"
                log.info(f"{done} >= training.steps={t.steps}: nothing to train")
            if cfg.checkpoint.export_hf:
                export_run(model, args, run_dir, tokenizer, mesh is not None, start_step)
            return
        if t.stop_at is not None and t.stop_at <= start_step:
            raise ValueError(
                f"training.stop_at={t.stop_at} is not after step {start_step}, which this launch resumes "
                f"from ({shown(resume_from)}): set a later step, or leave training.stop_at out"
            )
        check_resume_config(
            meta, cfg, optimizer, scheduler, start_step, resume_from, dp_size, dataset.n_windows
        )
    if rank == 0:  # once the launch is known to be runnable: a refused one leaves no directory
        log.info(f"run directory: {shown(run_dir)}")

    train_model: torch.nn.Module = model
    if t.activation_checkpointing and mesh is None:  # (parallelize_llama applies it otherwise)
        apply_activation_checkpointing(model)
    if mesh is None and world > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if t.compile and mesh is None:  # (parallelize_llama compiles each block)
        train_model = torch.compile(train_model)

    if rank == 0:
        save_tokenizer(tokenizer, run_dir)
        if resumed is not None:
            log.info(f"resuming from {shown(resume_from)} (step {start_step})")
        replicas = f" in {dims.dp_replicate} replicas" if dims.dp_replicate > 1 else ""
        layout = (
            f" (dp={dims.dp}{replicas} cp={dims.cp} tp={dims.tp}, comm={dims.comm})"
            if mesh is not None
            else ""
        )
        log.info(f"model {args.name}: {args.num_params() / 1e6:.1f}M parameters on {device} x{world}{layout}")
        log.info(tokens_origin)
        if held_out is not None:
            log.info(held_out_origin)
            when = f"every {cfg.eval.every} steps and at the last" if cfg.eval.every else "at the last step"
            log.info(f"held-out loss {when}, over {held_out.batches} batches ({held_out.tokens:,} tokens)")
            shared = shared_files(cfg.data.path, cfg.eval.path) if cfg.data.path is not None else []
            if shared:
                log.warning(
                    f"warning: data.path trains on {len(shared)} of eval.path's files ({shown(shared[0])}"
                    f"{', ...' if len(shared) > 1 else ''}), so the held-out loss is measured on training "
                    "data: point data.path at the training files alone"
                )
        if isinstance(tokenizer, HFTokenizer) and not marks_document_boundaries(tokenizer):
            log.warning(
                f"warning: the tokenizer in {shown(tokenizer.directory)} names no begin- or end-of-text "
                "token, so the documents are packed with nothing between them: name bos_token / eos_token "
                "in its tokenizer_config.json"
            )
        last_step = t.stop_at or t.steps
        profile_at = cfg.logging.profile_at
        if profile_at is not None and not start_step < profile_at <= last_step:
            log.warning(
                f"warning: logging.profile_at={profile_at} is outside the steps this launch trains "
                f"({start_step + 1} to {last_step}): no trace is written"
            )
        # Allowed (a short smoke test), but the schedule is not the one set.
        last_lr = t.lr * lr_lambda(t.steps - 1, t.warmup_steps, t.steps, t.min_lr_ratio)
        if t.warmup_steps > t.steps:
            log.warning(
                f"warning: training.warmup_steps={t.warmup_steps} exceeds training.steps={t.steps}: the "
                f"learning rate stops at {last_lr:.3g} in warm-up, short of training.lr={t.lr:g}"
            )
        elif t.warmup_steps > 0 and t.warmup_steps >= t.steps - 1 and t.min_lr_ratio < 1:
            log.warning(
                f"warning: training.warmup_steps={t.warmup_steps} leaves training.steps={t.steps} no step "
                f"of decay: the learning rate ends at {last_lr:.3g}, not training.lr * training.min_lr_ratio"
                f" = {t.lr * t.min_lr_ratio:.3g}"
            )

    flops_per_token = args.training_flops_per_token(t.seq_len)
    peak = peak_flops(device)
    hf_tokenizer = isinstance(tokenizer, HFTokenizer)
    metrics = MetricsLog(run_dir, start_step, t.steps, cfg.logging.tensorboard) if rank == 0 else None
    # Drawn only on a terminal: redirected to a file, a bar is a stream of carriage returns.
    show_bar = rank == 0 and cfg.logging.progress_bar and sys.stderr.isatty()
    bar = tqdm(total=t.steps, initial=start_step, disable=not show_bar, dynamic_ncols=True)
    last_saved = start_step
    step = start_step
    profiler = StepProfiler(run_dir, cfg.logging.profile_at, cfg.logging.profile_steps, rank, device)
    interrupted = False
    # While the bar is drawn, log lines are printed above it.
    redirect = logging_redirect_tqdm() if show_bar else contextlib.nullcontext()
    if stop.agreed():  # signalled while setting up: nothing is trained or saved, and no record is kept
        if rank == 0:
            log.info(f"{stop.signal.name} before the first step: stopping; nothing trained, nothing saved")
        raise SystemExit(stop.exit_code)
    stop.training_started()
    with bar, metrics or contextlib.nullcontext(), redirect:
        for step in range(start_step + 1, t.steps + 1):
            profiler.begin(step)
            try:
                stats = train_step(
                    train_model,
                    optimizer,
                    scheduler,
                    dataset,
                    cfg,
                    device,
                    autocast_dtype,
                    dp_size,
                    cp_chunk,
                )
            except NonFiniteStep as err:
                # Every rank sees the same averaged loss and stops here; rank 0 says why.
                kept = kept_checkpoint(run_dir, last_saved)
                stop_run(f"{err} at step {step}: stopping; {kept}. Lower training.lr or check the data")
            launch_record.trained = True
            interrupted = stop.agreed() and step < t.steps  # the same answer on every rank
            last_of_launch = interrupted or step in (t.steps, t.stop_at)
            profiler.end(step, last_of_launch)
            record = step_record(stats, step, device, peak, flops_per_token)
            # Not on a signal's stop: torchrun gives the ranks 30 s to save and exit.
            evaluate = held_out is not None and not interrupted and due(step, cfg.eval.every, t)
            if evaluate:
                record["eval_loss"] = round(held_out(model, device, autocast_dtype, cp_chunk), 5)
            bar.update(1)
            bar.set_postfix(
                {k: v for k, v in record.items() if k in ("loss", "tokens_per_s", "memory_gb", "mfu")}
            )
            logged = step % cfg.logging.every == 0 or step == 1 or last_of_launch or evaluate
            if metrics is not None and logged:
                metrics.write(record)
            if last_of_launch or due(step, cfg.checkpoint.every, t):
                sharded_save = mesh is not None
                error = save_run_checkpoint(
                    run_dir, step, model, optimizer, scheduler, dataset, cfg, sharded_save, hf_tokenizer
                )
                if error is not None:  # every rank stops; rank 0 says why and how to go on
                    stop_run(
                        f"{error}: stopping; {kept_checkpoint(run_dir, last_saved)}. Free space "
                        f"and resume with: {launch_resume_command(run_dir, last_saved)}"
                    )
                last_saved = step
            if last_of_launch:
                break
    if rank == 0:
        why = f"{stop.signal.name}: " if interrupted else ""
        last = f"last loss {record['loss']:.4f}"  # as the step's line rounds it
        if "eval_loss" in record:
            last += f", held-out loss {record['eval_loss']:.4f}"
        log.info(f"{why}stopped at step {step}, {last}; run directory {shown(run_dir)}")
        if step < t.steps:
            log.info(f"checkpoint of step {step} saved; resume with: {launch_resume_command(run_dir, step)}")
    if cfg.checkpoint.export_hf and step == t.steps:
        export_run(model, args, run_dir, tokenizer, mesh is not None, step)
    if interrupted:
        raise SystemExit(stop.exit_code)


@hydra.main(version_base=None, config_path="configs", config_name="train")
def main(cfg: TrainConfig) -> None:
    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.runtime.output_dir)
    launch_record = LaunchRecord(run_dir, hydra_config.output_subdir)
    with user_errors():
        try:
            with StopRequest() as stop, run_directory_lock(run_dir):
                run(cfg, run_dir, launch_record, stop)
        except BaseException as err:
            if not launch_record.trained:
                in_use = isinstance(err, RunDirectoryInUse)
                launch_record.forget(writer=distributed.rank() == 0, in_use=in_use)
            raise


if __name__ == "__main__":
    launch(main)
