"""Find and load weights named by a path: a Hugging Face model directory, a weft run directory (its
newest checkpoint) or one weft checkpoint directory. Used by train.py (`checkpoint.init_from`) and
serve.py (`checkpoint=`)."""

from __future__ import annotations

from pathlib import Path

import torch

from model.args import ModelArgs
from model.checkpoint import LazyTensors, copy_state_into, latest_checkpoint, read_model_args
from model.hf import args_from_hf_config, is_hf_checkpoint, open_hf_checkpoint
from model.tokenizer import HF_TOKENIZER_FILES, Tokenizer, load_tokenizer, read_json


def resolve_checkpoint(path: str | Path) -> Path:
    """The directory whose weights `path` names; a run directory resolves to its newest checkpoint."""
    path = Path(path).expanduser()  # a quoted ~ reaches us unexpanded (Hydra's quoting advice)
    if not path.is_dir():
        raise FileNotFoundError(
            f"checkpoint path {path} is not a directory: give a weft run/checkpoint or HF model dir"
        )
    if is_hf_checkpoint(path) or (path / "meta.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(
            f"{path} holds no weft checkpoint (no checkpoints/step_*/) and no Hugging Face config.json"
        )
    return latest


def checkpoint_args(path: Path) -> ModelArgs:
    if is_hf_checkpoint(path):
        return args_from_hf_config(read_json(path / "config.json"))
    return read_model_args(path)


def resolve_init_weights(init_from: str | None, args: ModelArgs) -> tuple[Path | None, ModelArgs]:
    """(checkpoint directory or None, the model args to build): a checkpoint's own shape replaces the
    configured preset; only `fp8` and `decode_kernels`, choices of how to run the weights, are kept
    from the config."""
    if init_from is None:
        return None, args
    path = resolve_checkpoint(init_from)
    loaded = checkpoint_args(path)
    loaded.fp8, loaded.decode_kernels = args.fp8, args.decode_kernels
    return path, loaded


def open_weights(path: Path) -> LazyTensors:
    """A resolved checkpoint's weights under weft's names, read one tensor at a time (on the CPU)."""
    if is_hf_checkpoint(path):
        return open_hf_checkpoint(path)[1]
    return LazyTensors.of_file(path / "model.safetensors")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A resolved checkpoint's full weights under weft's names (on the CPU)."""
    return open_weights(path).read_all()


def load_weights_into(model: torch.nn.Module, path: Path) -> None:
    """Copy a checkpoint's weights into `model` (already materialised on its device and dtype)."""
    copy_state_into(model, read_weights(path), source=str(path))


def tokenizer_dir(checkpoint: Path | None) -> Path | None:
    """Where the tokenizer of a resolved checkpoint lives: a Hugging Face directory holds its own; a
    weft checkpoint's run directory holds the one it was trained with, unless tokenizer files were
    copied into the checkpoint directory itself (None: the byte tokenizer, which a checkpoint trained on
    bytes names in its meta.json: a tokenizer.json two levels above one copied elsewhere is another's)."""
    if checkpoint is None:
        return None
    if is_hf_checkpoint(checkpoint) or (checkpoint / "tokenizer.json").is_file():
        return checkpoint
    if read_json(checkpoint / "meta.json").get("tokenizer") == "bytes":
        return None
    return checkpoint.parent.parent


def checkpoint_tokenizer(checkpoint: Path | None) -> Tokenizer:
    """The tokenizer of a resolved checkpoint (see `tokenizer_dir`). A Hugging Face directory must
    hold tokenizer.json: without it the byte tokenizer would silently stand in for the model's own."""
    if (
        checkpoint is not None
        and is_hf_checkpoint(checkpoint)
        and not (checkpoint / "tokenizer.json").is_file()
    ):
        raise ValueError(
            f"{checkpoint} has no tokenizer.json: add the model's tokenizer files (tokenizer.json, "
            "tokenizer_config.json), e.g. with transformers: "
            f"AutoTokenizer.from_pretrained(...).save_pretrained({str(checkpoint)!r})"
        )
    directory = tokenizer_dir(checkpoint)
    if (
        checkpoint is not None
        and directory != checkpoint
        and read_json(checkpoint / "meta.json").get("tokenizer") == "huggingface"
        and not (directory / "tokenizer.json").is_file()
    ):
        raise ValueError(
            f"{checkpoint} was trained with a Hugging Face tokenizer, kept in its run directory, but "
            f"{directory} has no tokenizer.json: serve the checkpoint inside its run directory, or copy "
            f"the run directory's {', '.join(HF_TOKENIZER_FILES)} (those it has) beside its weights"
        )
    return load_tokenizer(directory)
