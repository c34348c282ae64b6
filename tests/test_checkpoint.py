"""Checkpoints (round trip, atomic saves, clear errors), packed data (disjoint rank shares, exact
resume) and tokenizers."""

import os
from pathlib import Path

import pytest
import torch

from model.args import ModelArgs
from model.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from model.data import PackedDataset, load_documents, tokenize_corpus
from model.llama import Llama
from model.tokenizer import ByteTokenizer


def tiny_model(**overrides) -> Llama:
    model = Llama(
        ModelArgs(
            **{**dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50, ffn_hidden=48), **overrides}
        )
    )
    model.init_weights()
    return model


def trained_optimizer(model: Llama) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 50, (2, 8))).sum().backward()
    optimizer.step()
    return optimizer


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = trained_optimizer(model)
    save_checkpoint(tmp_path, 7, model, optimizer, data_state={"epoch": 1, "step": 3})
    expected_draw = torch.rand(3)
    other = tiny_model()
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    meta = load_checkpoint(latest_checkpoint(tmp_path), other, other_optimizer)
    assert meta["step"] == 7 and meta["data"] == {"epoch": 1, "step": 3}
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(torch.rand(3), expected_draw)
    saved, loaded = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert all(torch.equal(saved[i]["exp_avg"], loaded[i]["exp_avg"]) for i in saved)


def test_crash_mid_save_keeps_last_good_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    good = save_checkpoint(tmp_path, 1, model)

    def crash(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == good
    load_checkpoint(good, tiny_model())


def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    model = tiny_model()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, keep=2)
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == [
        "step_00000002",
        "step_00000003",
    ]


def test_other_shape_fails_clearly(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, tiny_model())
    with pytest.raises(ValueError, match="ffn_hidden"):
        load_checkpoint(latest_checkpoint(tmp_path), tiny_model(ffn_hidden=64))


def test_ranks_get_disjoint_windows_and_resume_exactly() -> None:
    tokens = torch.arange(10_000)
    ranks = [PackedDataset(tokens, seq_len=16, batch_size=4, rank=r, world_size=2, seed=3) for r in (0, 1)]
    seen = [set(), set()]
    for _ in range(5):
        for r, data in enumerate(ranks):
            inputs, targets = data.next_batch()
            assert torch.equal(inputs[:, 1:], targets[:, :-1])
            seen[r].update(inputs[:, 0].tolist())
    assert not seen[0] & seen[1]
    # Run past an epoch boundary, save, and continue in a fresh dataset from the saved position.
    data = PackedDataset(tokens, seq_len=16, batch_size=4, rank=0, world_size=2, seed=3)
    for _ in range(data.steps_per_epoch + 2):
        data.next_batch()
    resumed = PackedDataset(tokens, seq_len=16, batch_size=4, rank=0, world_size=2, seed=3)
    resumed.load_state_dict(data.state_dict())
    for _ in range(3):
        assert torch.equal(data.next_batch()[0], resumed.next_batch()[0])


def test_corpus_too_small_and_bad_jsonl_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs"):
        PackedDataset(torch.arange(100), seq_len=16, batch_size=4, rank=0, world_size=2, seed=0)
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"corpus\.jsonl:2"):
        load_documents(str(bad))


def test_default_corpus_and_byte_tokenizer() -> None:
    documents = load_documents(None)
    assert sum(len(d) for d in documents) > 400_000
    tokenizer = ByteTokenizer()
    text = "naïve café ✓"
    assert tokenizer.decode(tokenizer.encode(text, bos=True, eos=True)) == text
    stream = tokenize_corpus(["ab", "c"], tokenizer)
    assert stream.tolist() == [256, 97, 98, 257, 256, 99, 257]
