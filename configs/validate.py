"""Checks of what a user sets in train.py's and serve.py's configs, run before any model is built.

Every key must be one its schema declares (Hydra's `+key=value` would add any other silently), and every
count, length, rate and choice must be in range. A failure is a one-line ValueError that names the key
and what to set it to; configs/launch.py prints it as one line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import fields, is_dataclass

from omegaconf import DictConfig, OmegaConf

from configs.schema import ServeConfig, TrainConfig
from model.generate import Sampling

TRAIN_DTYPES = ("bfloat16", "float32")
SERVE_DTYPES = ("bfloat16", "float16", "float32")
SERVE_MODES = ("bench", "generate")
MAX_SEED = 2**32 - 1


def unknown_key_message(full_key: str, schema: type) -> str:
    """'unknown key training.stepz: training's keys are steps, batch_size, ...' (used for Hydra's own
    unknown-key errors too, so both read alike)."""
    group = full_key.rpartition(".")[0]
    owner = f"{group}'s keys" if group else "the top-level keys"
    return f"unknown key {full_key}: {owner} are {', '.join(f.name for f in fields(schema))}"


def check_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Raise for a key that the typed group holding it does not declare."""
    schema = OmegaConf.get_type(cfg)
    declared = {f.name for f in fields(schema)} if is_dataclass(schema) else None
    for key in cfg:
        if declared is not None and key not in declared:
            raise ValueError(unknown_key_message(f"{prefix}{key}", schema))
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            check_keys(node, f"{prefix}{key}.")


def at_least(key: str, value: float, low: float) -> tuple[bool, str]:
    if not math.isfinite(value):  # inf passes `>= low` (weight_decay=inf then trains to NaN)
        return False, f"{key}={value} must be a finite number >= {low}"
    return value >= low, f"{key}={value} must be >= {low}"


def between(key: str, value: float, low: float, high: float, high_open: bool = False) -> tuple[bool, str]:
    ok = low <= value < high if high_open else low <= value <= high
    return ok, f"{key}={value} must be in [{low}, {high}{')' if high_open else ']'}"


def one_of(key: str, value: str, choices: tuple[str, ...]) -> tuple[bool, str]:
    return value in choices, f"{key}={value!r} is not one of {', '.join(choices)}"


def path_or_null(key: str, value: str | None) -> tuple[bool, str]:
    # An empty value (`key=`) would name the current directory.
    return value is None or bool(value.strip()), f"{key} is empty: give a path, or null"


def raise_first_failure(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def override_key(override: str) -> str:
    """The key an override sets: model.dim for model.dim=64, +x.y=1 and ~x.y."""
    return override.lstrip("+~").split("=", 1)[0]


# Of the model group, what a checkpoint's weights leave to the config: how to run them.
RUN_CHOICES = ("model.fp8", "model.decode_kernels")


def check_shape_overrides(overrides: Sequence[str], weights_key: str) -> None:
    """Loaded weights bring their own shape: a command line that also sets one (model=PRESET,
    model.dim=...) is refused, not silently ignored."""
    keys = map(override_key, overrides)
    shape = [
        o
        for o, key in zip(overrides, keys, strict=True)
        if key == "model" or (key.startswith("model.") and key not in RUN_CHOICES)
    ]
    if shape:
        raise ValueError(
            f"{weights_key} gives the model's shape, so {', '.join(shape)} would be ignored: drop "
            f"{'it' if len(shape) == 1 else 'them'} (of model.*, only serve.py's decode choices "
            f"{' and '.join(RUN_CHOICES)} may be set)"
        )


# serve.py's keys that one mode reads and the other ignores.
MODE_KEYS = {
    "bench": ("batch_size", "prompt_len", "decode_steps"),
    "generate": ("prompt", "chat", "messages", "max_new_tokens", "temperature", "top_k", "top_p"),
}


def check_mode_overrides(mode: str, overrides: Sequence[str], messages: str | None = None) -> None:
    """A command line that sets a key only the other mode reads (prompt=... without mode=generate) is
    refused, not silently run as the other mode; so is a prompt beside `messages`, which replaces it."""
    other = next(name for name in MODE_KEYS if name != mode)
    ignored = [o for o in overrides if override_key(o) in MODE_KEYS[other]]
    prompts = [o for o in overrides if override_key(o) == "prompt"]
    if mode == "generate" and messages is not None and prompts:
        raise ValueError(
            f"messages={messages} sends the file's conversation instead of the prompt, so {prompts[-1]} "
            "would be ignored: drop it, or add it to the file as the last user message"
        )
    if ignored:
        raise ValueError(
            f"mode={mode} ignores {', '.join(ignored)} (mode={other} reads "
            f"{'it' if len(ignored) == 1 else 'them'}): set mode={other}, or drop "
            f"{'it' if len(ignored) == 1 else 'them'}"
        )


def check_prompt_override(overrides: Sequence[str]) -> None:
    """Hydra reads an unquoted prompt=true, prompt=1e3 or prompt=1_000 as a bool or a number, which the
    prompt (a string) then spells its own way ('True', '1000.0'), and a ${...} in it, quoted or not, as an
    interpolation (OmegaConf puts a key's value there, or fails): refused, not completed as another text.
    Call it before anything reads the config's prompt, which resolves it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in overrides:
        if override_key(override) != "prompt":
            continue
        text = override.split("=", 1)[1]
        if re.search(r"(?<!\\)\$\{", text):
            raise ValueError(
                f"{override}: Hydra reads the ${{...}} in it as an interpolation, so the prompt would not "
                "be the text typed: write \\${ for each literal ${ (in the shell's double quotes: \\\\\\${)"
            )
        value = OverridesParser.create().parse_overrides([override])[0].value()
        if not isinstance(value, str) and str(value) != text:
            raise ValueError(
                f"{override} is read as the {type(value).__name__} {value}, so the prompt would be "
                f"{str(value)!r}: quote it inside the shell's quotes: prompt=\"'{text}'\""
            )


def check_launch_directory() -> None:
    """Refuse Hydra's job.chdir: weft reads a command's relative paths (data, checkpoints, run
    directories) against the directory it was launched from, and prints resume commands to run there."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and HydraConfig.get().job.chdir:
        raise ValueError(
            "hydra.job.chdir=true is not supported: weft reads relative paths, and prints its resume "
            "commands, from the directory it was launched in; leave hydra.job.chdir false (the default)"
        )


def validate_train_config(cfg: TrainConfig) -> None:
    """train.py's keys and values (the model's shape is checked once a checkpoint may have set it)."""
    check_launch_directory()
    check_keys(cfg)
    t, ckpt = cfg.training, cfg.checkpoint
    checks = [
        at_least("training.steps", t.steps, 1),
        at_least("training.batch_size", t.batch_size, 1),
        at_least("training.seq_len", t.seq_len, 1),
        at_least("training.grad_accum", t.grad_accum, 1),
        (t.lr > 0 and math.isfinite(t.lr), f"training.lr={t.lr} must be a positive number"),
        between("training.min_lr_ratio", t.min_lr_ratio, 0, 1),
        at_least("training.warmup_steps", t.warmup_steps, 0),
        at_least("training.weight_decay", t.weight_decay, 0),
        between("training.beta1", t.beta1, 0, 1, high_open=True),
        between("training.beta2", t.beta2, 0, 1, high_open=True),
        at_least("training.grad_clip", t.grad_clip, 0),
        between("training.seed", t.seed, 0, MAX_SEED),
        (
            t.stop_at is None or 1 <= t.stop_at <= t.steps,
            f"training.stop_at={t.stop_at} must be between 1 and training.steps={t.steps} (or null)",
        ),
        one_of("training.dtype", t.dtype, TRAIN_DTYPES),
        # FP8 is serve.py's decode path: training would go on in training.dtype as if it were unset.
        (
            not cfg.model.fp8,
            "model.fp8=true is for serve.py's decode only: train.py trains in training.dtype",
        ),
        path_or_null("data.path", cfg.data.path),
        (bool(cfg.data.jsonl_field), "data.jsonl_field must name the field holding each line's text"),
        path_or_null("checkpoint.init_from", ckpt.init_from),
        at_least("checkpoint.every", ckpt.every, 0),
        at_least("checkpoint.keep", ckpt.keep, 1),
        path_or_null("eval.path", cfg.eval.path),
        at_least("eval.every", cfg.eval.every, 0),
        (
            cfg.eval.batches is None or cfg.eval.batches >= 1,
            f"eval.batches={cfg.eval.batches} must be >= 1 (or null: the whole held-out corpus)",
        ),
        at_least("logging.every", cfg.logging.every, 1),
        (
            cfg.logging.profile_at is None or 1 <= cfg.logging.profile_at <= t.steps,
            f"logging.profile_at={cfg.logging.profile_at} must be between 1 and training.steps={t.steps} "
            "(or null)",
        ),
        at_least("logging.profile_steps", cfg.logging.profile_steps, 1),
    ]
    raise_first_failure(checks)


def validate_serve_config(cfg: ServeConfig) -> None:
    """serve.py's keys and values (lengths against the model's are checked once its shape is known)."""
    check_launch_directory()
    check_keys(cfg)
    checks = [
        one_of("mode", cfg.mode, SERVE_MODES),
        path_or_null("checkpoint", cfg.checkpoint),
        at_least("max_new_tokens", 1 if cfg.max_new_tokens is None else cfg.max_new_tokens, 1),
        at_least("batch_size", cfg.batch_size, 1),
        at_least("prompt_len", cfg.prompt_len, 1),
        at_least("decode_steps", cfg.decode_steps, 1),
        one_of("dtype", cfg.dtype, SERVE_DTYPES),
        between("seed", cfg.seed, 0, MAX_SEED),
        # Decode has no data-parallel ranks to shard over: the model would be served whole as if unset.
        (
            not cfg.parallel.fsdp,
            "parallel.fsdp=true is for train.py only: serve.py splits a model with parallel.tp",
        ),
        (
            cfg.parallel.dp_replicate == 1,
            f"parallel.dp_replicate={cfg.parallel.dp_replicate} is for train.py only: serve.py splits a "
            "model with parallel.tp",
        ),
    ]
    raise_first_failure(checks)
    # The sampling values given here (None: generation_config.json's, checked when it is read).
    given = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
    Sampling(**{key: value for key, value in given.items() if value is not None}).validate()
