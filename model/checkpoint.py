"""weft's checkpoint format: a directory per step, weights and optimizer tensors in safetensors (no
pickle), everything else in JSON. Written under a temporary name and renamed into place, so a crash
mid-save never touches the last complete checkpoint.

    <run dir>/checkpoints/step_00000100/
        model.safetensors        the model's state dict (a tied output weight stored once)
        train_state.safetensors  optimizer tensors and RNG states
        meta.json                step, model args, data position, scheduler, optimizer hyper-parameters,
                                 the run's config (what the training that wrote it was told) and the
                                 kind of tokenizer (a Hugging Face one lives in the run directory)

A resume opens every file (reading its header, checked against the file's size) before it changes
anything, so an unreadable (truncated) checkpoint can be skipped for the one before it
(`load_newest_intact`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.args import ModelArgs, RopeScaling

FORMAT_VERSION = 1
STEP_PREFIX = "step_"
# Model args that do not change what the saved weights mean: a name, how weights are initialised, and
# how they are run.
NOT_COMPARED = ("name", "init_std", "fp8", "decode_kernels")

log = logging.getLogger(__name__)


class UnreadableCheckpoint(ValueError):
    """A checkpoint file that is missing, truncated or corrupt (the message names it)."""


class CheckpointWriteError(OSError):
    """A checkpoint (or Hugging Face export) that could not be written (a full disk, a quota, an I/O
    error; the message names the cause): its partial files are removed, those before it are untouched."""


def open_safetensors(file: Path) -> Any:
    """A safetensors file opened for reading tensor by tensor, or UnreadableCheckpoint naming it."""
    if not file.is_file():
        raise UnreadableCheckpoint(f"cannot read {file}: the file is missing")  # as for meta.json
    try:
        return safe_open(str(file), framework="pt")
    except (OSError, SafetensorError) as err:
        raise UnreadableCheckpoint(f"cannot read {file}: {err} (truncated or corrupt?)") from None


def tensor_names(file: Path) -> list[str]:
    """The names of the tensors a safetensors file holds (its header only is read)."""
    names: list[str] = open_safetensors(file).keys()
    return names


class LazyTensors(Mapping[str, torch.Tensor]):
    """Named tensors of safetensors files, read one at a time onto the CPU (the files are memory-mapped),
    so that a model larger than host memory loads tensor by tensor. `sources` maps each name to (file,
    the tensor's name in that file); `transforms` rewrites a named tensor as it is read. As a mapping,
    `lazy[name]` reads the tensor."""

    def __init__(
        self,
        sources: dict[str, tuple[Path, str]],
        transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    ) -> None:
        self.sources = sources
        self.transforms = transforms or {}
        self._files = {file: open_safetensors(file) for file, _ in sources.values()}
        self.shapes = {
            name: tuple(self._files[file].get_slice(key).get_shape()) for name, (file, key) in sources.items()
        }

    @classmethod
    def of_file(cls, file: Path) -> LazyTensors:
        """Every tensor of `file` under its own name."""
        return cls({key: (file, key) for key in tensor_names(file)})

    def read(self, name: str) -> torch.Tensor:
        file, key = self.sources[name]
        tensor = self._files[file].get_tensor(key)
        transform = self.transforms.get(name)
        return tensor if transform is None else transform(tensor)

    def read_all(self) -> dict[str, torch.Tensor]:
        return {name: self.read(name) for name in self.sources}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)

    def __contains__(self, name: object) -> bool:  # without reading the tensor, as Mapping's would
        return name in self.sources


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories of a save in progress or
    interrupted are ignored)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    done = [
        p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX) :].isdigit()
    ]
    return sorted(done, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint directory (step_00000100 -> 100)."""
    return int(path.name[len(STEP_PREFIX) :])


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if getattr(model, "args", None) is not None and model.args.tie_embeddings:
        state.pop("output.weight", None)
    return {k: v.detach().contiguous() for k, v in state.items()}


def optimizer_tensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer's state dict into tensors (for safetensors) and plain values (for JSON)."""
    tensors, plain = {}, {}
    for index, values in state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{name}"] = value.contiguous()
            else:
                plain[f"{index}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": plain}


def rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return tensors


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_tensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """safetensors' save_file with the file readable as the umask allows, as every other file a run
    writes (safetensors 0.8 creates its files owner-only, which keeps a shared model from its users)."""
    save_file(tensors, str(path), metadata=metadata)
    _readable_as_umask_allows(path)


def _readable_as_umask_allows(path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


class TensorSpec(NamedTuple):
    """A tensor as a safetensors header describes it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_tensors(
    path: Path,
    specs: list[TensorSpec],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """A safetensors file written one tensor at a time: the header from `specs` (and `metadata`), then
    each of `tensors` (in the specs' order, as it comes), so that the writer never holds more than one of
    them (a parallel checkpoint's, gathered as they are written). Readable as the umask allows, as
    save_tensors'."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    # Each tensor is let go before the next is asked for (made: gathered), so not zipped with the specs:
    # zip's reused tuple would keep it.
    stream = iter(tensors)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        for spec in specs:
            tensor = next(stream, None)
            if tensor is None or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                got = "nothing" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
                raise ValueError(f"{spec.name}: {got}, the header says {spec}")
            handle.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            del tensor
        if next(stream, None) is not None:
            raise ValueError(f"{path}: more tensors than the {len(specs)} its header lists")
    _readable_as_umask_allows(path)


def checkpoint_meta(
    step: int,
    model_args: ModelArgs | None,
    scheduler: Any,
    data_state: dict[str, Any] | None,
    config: dict[str, Any] | None,
    hf_tokenizer: bool,
    optimizer_meta: dict[str, Any] | None,
) -> dict[str, Any]:
    """meta.json's contents (the Python RNG's state taken now)."""
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "model_args": dataclasses.asdict(model_args) if model_args is not None else None,
        "data": data_state,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "python_rng": random.getstate(),
        "config": config,
        "tokenizer": "huggingface" if hf_tokenizer else "bytes",
    }
    if optimizer_meta is not None:
        meta["optimizer"] = optimizer_meta
    return meta


def write_checkpoint(
    run_dir: str | Path,
    step: int,
    write_tensor_files: Callable[[Path], None],
    meta: dict[str, Any],
    keep: int,
) -> Path:
    """The checkpoint of `step` written atomically: `write_tensor_files(directory)` writes
    model.safetensors and train_state.safetensors into a temporary directory, meta.json follows, and
    the directory is renamed into place once everything is on disk; then only the newest `keep` of the
    checkpoints up to `step` are kept (a later one is one a resume skipped as unreadable, left as it
    is). A write that fails (a full disk) raises CheckpointWriteError, its partial files removed. One
    process per run directory writes: temporary directories of other saves count as crashed."""
    root = checkpoint_dir(run_dir)
    final = root / f"{STEP_PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        # One process saves a run: a temporary directory left here is a save that crashed; remove it.
        for stale in root.glob(f"{STEP_PREFIX}*.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        write_tensor_files(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for file in tmp.iterdir():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(tmp)
    except (OSError, SafetensorError) as err:
        # A full disk or a quota: the partial files would hold space that the next save needs.
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"cannot save the checkpoint of step {step} in {root}: {err}") from err
    if final.exists():  # re-saving the same step: the old copy goes only once the new one is complete
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    # Checkpoints of later steps are those a resume skipped as unreadable: counted among the newest,
    # they would have the one just written pruned.
    done = [p for p in list_checkpoints(run_dir) if checkpoint_step(p) <= step]
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    data_state: dict[str, Any] | None = None,
    keep: int = 2,
    config: dict[str, Any] | None = None,
    hf_tokenizer: bool = False,
) -> Path:
    """Write the checkpoint of `step` (write_checkpoint: atomically, pruning to the newest `keep`, a
    failed write raising CheckpointWriteError); `config` (the run's config as plain values) is kept in
    meta.json, and whether the run trained on a Hugging Face tokenizer (kept in the run directory)
    rather than bytes, so that a checkpoint moved out of its run is not served with the wrong one. Call
    it from one process per run directory (rank 0)."""
    tensors, optimizer_meta = (
        optimizer_tensors(optimizer.state_dict()) if optimizer is not None else ({}, None)
    )

    def write_tensor_files(directory: Path) -> None:
        save_tensors(model_state(model), directory / "model.safetensors")
        save_tensors({**rng_tensors(), **tensors}, directory / "train_state.safetensors")

    args = getattr(model, "args", None)
    meta = checkpoint_meta(step, args, scheduler, data_state, config, hf_tokenizer, optimizer_meta)
    return write_checkpoint(run_dir, step, write_tensor_files, meta, keep)


def read_meta(path: str | Path) -> dict[str, Any]:
    meta_file = Path(path) / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a weft checkpoint (no meta.json)")
    try:
        return json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnreadableCheckpoint(f"cannot read {meta_file}: {err} (truncated or corrupt?)") from None


def read_model_args(path: str | Path) -> ModelArgs:
    raw = read_meta(path).get("model_args")
    if raw is None:
        raise ValueError(f"{path}/meta.json records no model args")
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(ModelArgs)})
    if unknown:
        raise ValueError(
            f"{path}/meta.json has model args this weft does not know ({', '.join(unknown)}): "
            "load it with the weft version that wrote it"
        )
    scaling = raw.pop("rope_scaling", None)
    return ModelArgs(**raw, rope_scaling=RopeScaling(**scaling) if scaling else None)


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights (every tensor of its model.safetensors), or UnreadableCheckpoint."""
    return LazyTensors.of_file(Path(path) / "model.safetensors").read_all()


def state_mismatch(expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]]) -> str | None:
    """None when `shapes` (a state's tensor names and shapes) has exactly the `expected` names and
    shapes, else the first few missing, unexpected and mis-shaped names (with both shapes) on one line."""
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(
        f"{k} {tuple(shapes[k])} vs {tuple(expected[k])}"
        for k in set(expected) & set(shapes)
        if tuple(shapes[k]) != tuple(expected[k])
    )
    problems = (("missing", missing), ("unexpected", unexpected), ("mis-shaped", wrong))
    details = "; ".join(f"{label}: {', '.join(names[:4])}" for label, names in problems if names)
    return details or None


def copy_state_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy `state` into the model's tensors, after checking that names and shapes match exactly."""
    own = model_state(model)
    details = state_mismatch(
        {k: tuple(v.shape) for k, v in own.items()}, {k: tuple(v.shape) for k, v in state.items()}
    )
    if details is not None:
        raise ValueError(f"checkpoint {source} does not fit the model ({details}): check the model preset")
    targets = model.state_dict()
    with torch.no_grad():
        for name in own:
            targets[name].copy_(state[name])


def check_model_args(path: Path, saved: dict[str, Any] | None, model: torch.nn.Module) -> None:
    if saved is None or not hasattr(model, "args"):
        return
    current = dataclasses.asdict(model.args)
    differ = [k for k in saved if k not in NOT_COMPARED and current.get(k) != saved[k]]
    if differ:
        detail = ", ".join(f"{k}: saved {saved[k]} vs configured {current.get(k)}" for k in differ[:4])
        # A model read from a Hugging Face directory has no preset to name: its shape is that directory's.
        remedy = (
            "pass the checkpoint.init_from=<Hugging Face directory> the run started from"
            if saved.get("name") == "hf"
            else "use its model preset"
        )
        raise ValueError(f"checkpoint {path} was saved for another model shape ({detail}): {remedy}")


def check_optimizer_state(
    path: Path,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    train: LazyTensors,
    full_shapes: list[tuple[int, ...]] | None = None,
) -> dict[int, dict[str, str]]:
    """Check, from the file's header, that a checkpoint's optimizer tensors are state for the
    optimizer's parameters (their shapes, or `full_shapes` where the parameters are shards of them), or
    raise a one-line ValueError; returns the tensors' keys by parameter index and state name."""
    if "optimizer" not in meta:
        raise ValueError(f"checkpoint {path} holds no optimizer state: it cannot resume training")
    saved = meta["optimizer"]
    keys: dict[int, dict[str, str]] = {}
    for key in train:
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            keys.setdefault(int(index), {})[name] = key
    params = [p for group in optimizer.param_groups for p in group["params"]]
    shapes = full_shapes or [tuple(p.shape) for p in params]
    saved_count = sum(len(group["params"]) for group in saved["param_groups"])
    wrong = [
        f"optim.{index}.{name} {train.shapes[key]} vs {shapes[index]}"
        for index, names in sorted(keys.items())
        if index < len(shapes)
        for name, key in names.items()
        if len(train.shapes[key]) > 0 and train.shapes[key] != shapes[index]
    ]
    detail = None
    if wrong:
        detail = f"mis-shaped: {', '.join(wrong[:4])}"
    elif saved_count != len(params) or len(saved["param_groups"]) != len(optimizer.param_groups):
        detail = (
            f"{saved_count} parameters in {len(saved['param_groups'])} groups saved, "
            f"{len(params)} in {len(optimizer.param_groups)} now"
        )
    if detail is not None:
        raise ValueError(
            f"checkpoint {path} holds optimizer state for other parameters ({detail}): "
            "resume with the optimizer settings it was saved with"
        )
    return keys


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    train: LazyTensors,
    keys: dict[int, dict[str, str]],
    place: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Restore `optimizer` from a checkpoint's train_state tensors `keys` (check_optimizer_state's).
    Each tensor is read in turn and put in place by `place(parameter index, tensor)` (a sharded model
    keeps its slice), so that no more than one full tensor is read at a time."""
    state: dict[int, dict[str, Any]] = {}
    for index, names in keys.items():
        for name, key in names.items():
            tensor = train.read(key)
            if place is not None and tensor.dim() > 0:
                tensor = place(index, tensor)
            state.setdefault(index, {})[name] = tensor
    for key, value in meta["optimizer"]["scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["optimizer"]["param_groups"]})


def open_checkpoint(path: Path) -> tuple[dict[str, Any], LazyTensors, LazyTensors]:
    """A checkpoint's meta.json and its two tensor files, opened (headers read and checked against the
    files' sizes, so that a truncated file raises UnreadableCheckpoint before anything is restored)."""
    if not (path / "meta.json").is_file():  # as a missing weights file: the checkpoint before it is used
        raise UnreadableCheckpoint(f"cannot read {path / 'meta.json'}: the file is missing")
    meta = read_meta(path)
    weights = LazyTensors.of_file(path / "model.safetensors")
    train = LazyTensors.of_file(path / "train_state.safetensors")
    return meta, weights, train


def restore_schedule_and_rng(meta: dict[str, Any], train: LazyTensors, scheduler: Any) -> None:
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(train.read("rng.torch"))
    if "rng.cuda" in train and torch.cuda.is_available():
        torch.cuda.set_rng_state(train.read("rng.cuda"))
    random.setstate((meta["python_rng"][0], tuple(meta["python_rng"][1]), meta["python_rng"][2]))


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG from `path`; returns meta.json's contents. Every
    file is opened and the weights read before anything is restored (an unreadable one raises
    UnreadableCheckpoint)."""
    path = Path(path)
    meta, weights, train = open_checkpoint(path)
    check_model_args(path, meta.get("model_args"), model)
    if optimizer is not None:  # its one-line error before any weight is replaced
        keys = check_optimizer_state(path, optimizer, meta, train)
    copy_state_into(model, weights.read_all(), source=str(path))
    if optimizer is not None:
        load_optimizer_state(optimizer, meta, train, keys)
    restore_schedule_and_rng(meta, train, scheduler)
    return meta


def load_newest_intact(
    run_dir: str | Path, load: Callable[[Path], dict[str, Any]]
) -> tuple[Path, dict[str, Any]] | None:
    """`load` (load_checkpoint or its parallel twin, bound to the model) the run's newest readable
    checkpoint, warning about each newer one that is not: (its path, its meta), or None when the run has
    no checkpoint yet."""
    found = list_checkpoints(run_dir)
    problems = []
    for path in reversed(found):
        try:
            return path, load(path)
        except UnreadableCheckpoint as err:
            problems.append(str(err))
            if path != found[0]:
                log.warning(f"warning: {err}; resuming from the checkpoint before it instead")
    if problems:
        raise UnreadableCheckpoint(
            f"no checkpoint in {checkpoint_dir(run_dir)} is readable ({'; '.join(problems)}): "
            "move the directory away to start afresh"
        )
    return None
