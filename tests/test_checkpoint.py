"""Checkpoints: layout, round trip (weights, optimizer, scheduler, RNG, data position), atomic saves that
survive a crash mid-save, pruning, clear errors for checkpoints that do not fit or cannot be read, and
the fall-back to the newest readable one."""

import json
import os
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import model.checkpoint as checkpoint
from model.args import ModelArgs, RopeScaling
from model.checkpoint import (
    UnreadableCheckpoint,
    latest_checkpoint,
    load_checkpoint,
    load_model_state,
    load_newest_intact,
    read_model_args,
    save_checkpoint,
)
from model.llama import Llama

ARGS = dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50, ffn_hidden=48)


def tiny_model(**overrides) -> Llama:
    model = Llama(ModelArgs(**{**ARGS, **overrides}))
    model.init_weights()
    return model


def train_step(model: Llama, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
    optimizer.zero_grad()
    model(torch.randint(0, 50, (2, 8))).float().pow(2).mean().backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()


def build_optimizer(model: Llama) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))


def test_layout_and_meta(tmp_path: Path) -> None:
    model = tiny_model(tie_embeddings=True, rope_scaling=RopeScaling(original_max_position=64))
    optimizer, scheduler = build_optimizer(model)
    train_step(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path, 12, model, optimizer, scheduler, data_state={"epoch": 0, "step": 5})
    assert path == tmp_path / "checkpoints" / "step_00000012"
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json",
        "model.safetensors",
        "train_state.safetensors",
    ]
    weights = load_model_state(path)
    assert "output.weight" not in weights and "tok_embeddings.weight" in weights  # tied: stored once
    train = load_file(str(path / "train_state.safetensors"))
    assert "rng.torch" in train and "optim.0.exp_avg" in train and "optim.0.exp_avg_sq" in train
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 12 and meta["format_version"] == checkpoint.FORMAT_VERSION
    assert meta["data"] == {"epoch": 0, "step": 5} and meta["scheduler"]["last_epoch"] == 1
    assert [g["weight_decay"] for g in meta["optimizer"]["param_groups"]] == [0.1, 0.0]
    assert read_model_args(path) == model.args


def test_round_trip_resumes_training_exactly(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer, scheduler = build_optimizer(model)
    for _ in range(2):
        train_step(model, optimizer, scheduler)
    save_checkpoint(tmp_path, 2, model, optimizer, scheduler, data_state={"epoch": 1, "step": 3})
    expected_draws = torch.rand(3), random.random()

    torch.manual_seed(123)  # disturb the RNGs: loading puts them back
    random.seed(123)
    other = tiny_model()
    other_optimizer, other_scheduler = build_optimizer(other)
    meta = load_checkpoint(latest_checkpoint(tmp_path), other, other_optimizer, other_scheduler)
    assert meta["step"] == 2 and meta["data"] == {"epoch": 1, "step": 3}
    assert torch.equal(torch.rand(3), expected_draws[0]) and random.random() == expected_draws[1]
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert other_scheduler.get_last_lr() == scheduler.get_last_lr()
    assert tuple(other_optimizer.param_groups[0]["betas"]) == (0.9, 0.95)

    # Two more steps from the same RNG state give the same weights bit for bit.
    state = torch.get_rng_state()
    for _ in range(2):
        train_step(model, optimizer, scheduler)
    torch.set_rng_state(state)
    for _ in range(2):
        train_step(other, other_optimizer, other_scheduler)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_crash_mid_save_keeps_last_good_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    good = save_checkpoint(tmp_path, 1, model, keep=1)
    before = load_model_state(good)

    def crash(*_args: object) -> None:
        raise OSError("disk full")

    # Crash at the rename: the new checkpoint is complete in its temporary directory but not in place.
    monkeypatch.setattr(os, "replace", crash)
    with torch.no_grad():
        model.norm.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model, keep=1)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == good
    assert any(".tmp-" in p.name for p in (tmp_path / "checkpoints").iterdir())

    # Crash while writing the weights: a half-written file in the temporary directory.
    def half_written(tensors: dict, filename: str, metadata=None) -> None:
        Path(filename).write_bytes(b"\x00" * 100)
        raise OSError("killed")

    monkeypatch.setattr(checkpoint, "save_file", half_written)
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(tmp_path, 3, model, keep=1)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == good
    restored = tiny_model()
    load_checkpoint(good, restored)
    for name, tensor in before.items():
        assert torch.equal(restored.state_dict()[name], tensor), name

    # The next save completes, prunes the old one and clears the crashed saves' leftovers.
    newest = save_checkpoint(tmp_path, 4, model, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [newest.name]


def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    model = tiny_model()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, keep=2)
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == [
        "step_00000002",
        "step_00000003",
    ]
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    assert latest_checkpoint(tmp_path / "no-run") is None


def test_keep_never_prunes_the_checkpoint_just_written(tmp_path: Path) -> None:
    """A resume that skipped an unreadable newest checkpoint (step 10) saves earlier steps again: the
    checkpoint it writes is the newest good one and stays, however many `keep` allows."""
    model = tiny_model()
    for step in (5, 10):
        save_checkpoint(tmp_path, step, model, keep=2)
    broken = tmp_path / "checkpoints" / "step_00000010" / "model.safetensors"
    broken.write_bytes(broken.read_bytes()[:100])
    save_checkpoint(tmp_path, 6, model, keep=1)
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == [
        "step_00000006",
        "step_00000010",
    ]
    path, meta = load_newest_intact(tmp_path, lambda p: load_checkpoint(p, tiny_model()))
    assert path.name == "step_00000006" and meta["step"] == 6


def test_other_shape_fails_clearly(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, tiny_model())
    with pytest.raises(ValueError, match=r"ffn_hidden: saved 48 vs configured 64\): use its model preset"):
        load_checkpoint(latest_checkpoint(tmp_path), tiny_model(ffn_hidden=64))
    # A model read from a Hugging Face directory has no preset: the remedy names checkpoint.init_from.
    save_checkpoint(tmp_path / "hf", 1, tiny_model(name="hf"))
    with pytest.raises(ValueError, match=r"pass the checkpoint\.init_from=<Hugging Face directory> the run"):
        load_checkpoint(latest_checkpoint(tmp_path / "hf"), tiny_model(ffn_hidden=64))


def test_mismatched_tensors_fail_clearly(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, tiny_model())
    state = load_file(str(path / "model.safetensors"))
    del state["layers.0.ffn_norm.weight"]
    state["layers.0.extra.weight"] = torch.zeros(2)
    state["norm.weight"] = torch.zeros(31)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, tiny_model())
    message = str(error.value)
    assert "\n" not in message
    for part in (
        "missing: layers.0.ffn_norm.weight",
        "unexpected: layers.0.extra.weight",
        "mis-shaped: norm.weight",
    ):
        assert part in message


def test_optimizer_for_other_parameters_fails_clearly(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer, _ = build_optimizer(model)
    train_step(model, optimizer)
    path = save_checkpoint(tmp_path, 1, model, optimizer)
    other = tiny_model()
    single_group = torch.optim.AdamW(other.parameters())
    with pytest.raises(ValueError, match="optimizer state for other parameters"):
        load_checkpoint(path, other, single_group)
    weights_only = save_checkpoint(tmp_path / "b", 1, model)
    with pytest.raises(ValueError, match="no optimizer state"):
        load_checkpoint(weights_only, other, build_optimizer(other)[0])


def test_meta_from_another_version_fails_clearly(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, tiny_model())
    meta = json.loads((path / "meta.json").read_text())
    meta["model_args"]["new_field"] = 1
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="new_field"):
        read_model_args(path)
    with pytest.raises(FileNotFoundError, match="not a weft checkpoint"):
        read_model_args(tmp_path)


@pytest.mark.parametrize("damage", ["cut", "missing"])
@pytest.mark.parametrize("name", ["model.safetensors", "train_state.safetensors", "meta.json"])
def test_unreadable_file_is_named_and_skipped(
    tmp_path: Path, name: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model()
    optimizer, scheduler = build_optimizer(model)
    train_step(model, optimizer, scheduler)
    save_checkpoint(tmp_path, 1, model, optimizer, scheduler, data_state={"step": 1}, keep=2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, optimizer, scheduler)
    newest = save_checkpoint(tmp_path, 2, model, optimizer, scheduler, data_state={"step": 2}, keep=2)
    file = newest / name
    if damage == "cut":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # cut short, as by a full disk
    else:
        file.unlink()

    other = tiny_model()
    other_optimizer, other_scheduler = build_optimizer(other)
    with pytest.raises(UnreadableCheckpoint, match=re.escape(f"cannot read {file}")):
        load_checkpoint(newest, other, other_optimizer, other_scheduler)
    path, meta = load_newest_intact(
        tmp_path, lambda p: load_checkpoint(p, other, other_optimizer, other_scheduler)
    )
    assert path.name == "step_00000001" and meta["step"] == 1
    assert f"cannot read {file}" in caplog.text and "resuming from the checkpoint before it" in caplog.text
    for key, tensor in expected.items():
        assert torch.equal(other.state_dict()[key], tensor), key


def test_no_readable_checkpoint_names_each_one(tmp_path: Path) -> None:
    for step in (1, 2):
        path = save_checkpoint(tmp_path, step, tiny_model())
        (path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnreadableCheckpoint, match=r"no checkpoint in .* is readable") as error:
        load_newest_intact(tmp_path, lambda p: load_checkpoint(p, tiny_model()))
    assert "step_00000001/model.safetensors" in str(error.value)
    assert "step_00000002/model.safetensors" in str(error.value)
    assert load_newest_intact(tmp_path / "fresh", lambda p: load_checkpoint(p, tiny_model())) is None


def test_tensor_files_are_readable_as_the_umask_allows(tmp_path: Path) -> None:
    """safetensors 0.8 makes its files owner-only; a checkpoint's files get the umask's mode, as its
    JSON does."""
    previous = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path, 1, Llama(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2)))
    finally:
        os.umask(previous)
    modes = {file.name: file.stat().st_mode & 0o777 for file in path.iterdir()}
    assert modes == {"model.safetensors": 0o644, "train_state.safetensors": 0o644, "meta.json": 0o644}


def test_streamed_tensor_file_is_what_safetensors_reads(tmp_path: Path) -> None:
    """write_tensors (a parallel checkpoint's writer, one tensor at a time) gives a file safetensors
    reads back exactly, every dtype a checkpoint holds and a 0-dim tensor, with the umask's mode."""
    tensors = {
        "w": torch.randn(5, 3),
        "h": torch.randn(7).to(torch.bfloat16),
        "step": torch.tensor(3.0),
        "rng": torch.randint(0, 255, (13,), dtype=torch.uint8),
        "i": torch.arange(6, dtype=torch.int64).view(2, 3)[:, 1:],  # not contiguous
        "mask": torch.rand(9) > 0.5,
        "empty": torch.zeros(0, 4),
    }
    specs = [checkpoint.TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    previous = os.umask(0o022)
    try:
        checkpoint.write_tensors(tmp_path / "t.safetensors", specs, iter(tensors.values()), {"format": "pt"})
    finally:
        os.umask(previous)
    back = load_file(str(tmp_path / "t.safetensors"))
    assert safe_open(str(tmp_path / "t.safetensors"), framework="pt").metadata() == {"format": "pt"}
    assert back.keys() == tensors.keys()
    for key, t in tensors.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key
    assert (tmp_path / "t.safetensors").stat().st_mode & 0o777 == 0o644
    with pytest.raises(ValueError, match=r"w: torch.float32 \(3, 5\), the header says"):
        checkpoint.write_tensors(tmp_path / "u.safetensors", specs[:1], [torch.randn(3, 5)])
    with pytest.raises(ValueError, match=r"h: nothing, the header says"):
        checkpoint.write_tensors(tmp_path / "u.safetensors", specs[:2], [tensors["w"]])
    with pytest.raises(ValueError, match=r"more tensors than the 1 its header lists"):
        checkpoint.write_tensors(tmp_path / "u.safetensors", specs[:1], [tensors["w"], tensors["h"]])
