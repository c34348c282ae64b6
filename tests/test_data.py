"""Corpus loading and packed data: determinism, disjoint rank shares, exact resume, clear errors."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from model.data import (
    PackedDataset,
    corpus_tokens,
    load_documents,
    marks_document_boundaries,
    tokenize_corpus,
)
from model.tokenizer import ByteTokenizer, HFTokenizer
from tests.test_tokenizer import write_hf_tokenizer


def dataset(tokens: torch.Tensor, rank: int = 0, world_size: int = 1, seed: int = 3) -> PackedDataset:
    return PackedDataset(tokens, seq_len=16, batch_size=4, rank=rank, world_size=world_size, seed=seed)


def test_default_corpus_is_python_topics() -> None:
    from pydoc_data.topics import topics

    documents = load_documents(None)
    assert documents == [topics[key] for key in sorted(topics)]
    assert sum(map(len, documents)) > 400_000


def test_text_jsonl_and_directory(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second file")
    (tmp_path / "a.md").write_text("# first file")
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"text": "doc one", "body": "x"}) + "\n\n" + json.dumps({"text": "doc two"}) + "\n"
    )
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    assert load_documents(str(tmp_path / "b.txt")) == ["second file"]
    assert load_documents(str(tmp_path / "c.jsonl")) == ["doc one", "doc two"]
    assert load_documents(str(tmp_path)) == ["# first file", "second file", "doc one", "doc two"]
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "other field"}) + "\n")
    assert load_documents(str(tmp_path / "d.jsonl"), jsonl_field="body") == ["other field"]


def test_jsonl_lines_end_at_newlines_only(tmp_path: Path) -> None:
    # Characters that str.splitlines breaks at, left raw inside JSON strings by json.dumps
    # (ensure_ascii=False), and a file with Windows line ends.
    documents = ["one\u2028two", "next\u2029paragraph", "NEL\x85here", "form\x0cfeed", "plain"]
    lines = [json.dumps({"text": d}, ensure_ascii=False) for d in documents]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert load_documents(str(tmp_path / "c.jsonl")) == documents
    (tmp_path / "c.jsonl").write_bytes("\r\n".join(lines).encode("utf-8"))
    assert load_documents(str(tmp_path / "c.jsonl")) == documents


def test_utf8_byte_order_mark_is_not_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfhello")
    (tmp_path / "b.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    assert load_documents(str(tmp_path / "a.txt")) == ["hello"]
    assert load_documents(str(tmp_path / "b.jsonl")) == ["first", "second"]


def test_directory_follows_symlinked_directories(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "b.txt").write_text("linked shard")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("own file")
    (corpus / "linked").symlink_to(tmp_path / "shards")
    (corpus / "shards").symlink_to(tmp_path / "shards")  # the same directory again: read once
    (corpus / "loop").symlink_to(corpus)  # a link back up the tree: not followed round
    assert load_documents(str(corpus)) == ["own file", "linked shard"]


def test_loading_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_documents(str(tmp_path / "nope.txt"))
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"corpus\.jsonl:2 has no field 'text'"):
        load_documents(str(bad))
    bad.write_text('{"text": "fine"}\n\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"corpus\.jsonl:3 is not valid JSON"):
        load_documents(str(bad))
    bad.write_text('{"text": "fine"}\n{"text": null}\n')
    with pytest.raises(ValueError, match=r"corpus\.jsonl:2: 'text' is a NoneType, not text"):
        load_documents(str(bad))
    bad.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"corpus\.jsonl is not UTF-8 text \(invalid continuation byte"):
        load_documents(str(bad))
    (tmp_path / "corpus.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00")
    with pytest.raises(ValueError, match=r"corpus\.jsonl\.gz is not a \.jsonl/\.md/.*: .*decompress"):
        load_documents(str(tmp_path / "corpus.jsonl.gz"))
    bad.write_text("\n\n")
    with pytest.raises(ValueError, match=r"corpus\.jsonl holds no text: give a corpus"):
        load_documents(str(bad))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no \.jsonl/\.md/\.py/\.rst/\.text/\.txt files"):
        load_documents(str(tmp_path / "empty"))


def test_unpaired_surrogate_names_its_line_under_either_tokenizer(tmp_path: Path) -> None:
    """Half a UTF-16 pair escaped in a .jsonl line (valid JSON, "\\ud83d") is text no tokenizer can
    encode: the token file's build names the line, whichever tokenizer it runs."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine \\ud83d\\ude00 pair"}\n{"text": "broken \\ud83d half"}\n')
    for tokenizer in (ByteTokenizer(), HFTokenizer(write_hf_tokenizer(tmp_path / "hf"))):
        with pytest.raises(
            ValueError,
            match=r"corpus\.jsonl:2: 'text' holds an unpaired surrogate \('\\ud83d' at character 7\): repair",
        ):
            corpus_tokens(str(corpus), "text", tokenizer, str(tmp_path / "tokens"), tokenizer.vocab_size)
        assert not list((tmp_path / "tokens").iterdir())  # no token file, nor a temporary one left


def test_tokenize_joins_documents_with_eos() -> None:
    tokenizer = ByteTokenizer()
    assert tokenize_corpus(["ab", "c"], tokenizer).tolist() == [256, 97, 98, 257, 256, 99, 257]
    built = PackedDataset(
        tokenize_corpus(["x" * 500], tokenizer), 8, batch_size=2, rank=0, world_size=1, seed=0
    )
    inputs, targets = built.next_batch()
    assert inputs.shape == targets.shape == (2, 8) and inputs.dtype == torch.int64


def test_tokenizers_without_begin_or_end_ids_are_found(tmp_path: Path) -> None:
    """A tokenizer.json with no begin/end token and no post-processor packs documents back to back
    (train.py warns); one whose post-processor adds a BOS, or one with an EOS, does not."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2, "<sep>": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    plain = HFTokenizer(tmp_path)
    assert (plain.bos_id, plain.eos_id) == (None, None)
    assert tokenize_corpus(["a b", "b"], plain).tolist() == [0, 1, 1]
    assert not marks_document_boundaries(plain)
    tokenizer.post_processor = processors.TemplateProcessing(single="<sep> $A", special_tokens=[("<sep>", 3)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert marks_document_boundaries(HFTokenizer(tmp_path))
    assert marks_document_boundaries(ByteTokenizer())


def test_batches_are_shifted_windows_and_deterministic() -> None:
    tokens = torch.arange(10_000)
    a, b, other_seed = dataset(tokens), dataset(tokens), dataset(tokens, seed=4)
    differs = False
    for _ in range(5):
        inputs, targets = a.next_batch()
        assert inputs.shape == (4, 16)
        # Each row is a window of the stream starting at a multiple of seq_len; targets one ahead.
        assert torch.equal(targets, inputs + 1) and torch.all(inputs[:, 0] % 16 == 0)
        assert torch.equal(inputs, b.next_batch()[0])
        differs |= not torch.equal(inputs, other_seed.next_batch()[0])
    assert differs


def test_ranks_share_each_epoch_disjointly() -> None:
    tokens = torch.arange(16 * 4 * 3 * 5 + 7)  # 5 steps per epoch for 3 ranks, a ragged tail
    ranks = [dataset(tokens, rank=r, world_size=3) for r in range(3)]
    assert ranks[0].steps_per_epoch == 5
    epochs = []
    for _ in range(2):
        seen = [[], [], []]
        for _ in range(5):
            for r, data in enumerate(ranks):
                seen[r] += data.next_batch()[0][:, 0].tolist()
        flat = [s for rank_seen in seen for s in rank_seen]
        assert len(flat) == len(set(flat)) == 60  # no window twice in an epoch, on any rank
        epochs.append(flat)
    assert epochs[0] != epochs[1]  # a new order each epoch


def test_resume_gives_the_same_batches() -> None:
    tokens = torch.arange(10_000)
    data = dataset(tokens, rank=1, world_size=2)
    for _ in range(data.steps_per_epoch + 2):  # past an epoch boundary
        data.next_batch()
    state = data.state_dict()
    assert state == {"epoch": 1, "step": 2, "windows_per_step": 8, "windows": 624}
    resumed = dataset(tokens, rank=1, world_size=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as meta.json stores it
    for _ in range(data.steps_per_epoch + 1):
        assert torch.equal(data.next_batch()[0], resumed.next_batch()[0])
    # The epoch's end is a position (the next batch starts the next epoch); one step beyond is not.
    resumed.load_state_dict({"epoch": 0, "step": data.steps_per_epoch})
    fresh = dataset(tokens, rank=1, world_size=2)
    for _ in range(data.steps_per_epoch):
        fresh.next_batch()
    assert torch.equal(resumed.next_batch()[0], fresh.next_batch()[0])
    with pytest.raises(ValueError, match="past this corpus"):
        resumed.load_state_dict({"epoch": 0, "step": data.steps_per_epoch + 1})


def test_resume_over_another_number_of_ranks_continues_the_epoch() -> None:
    """Windows are handed out in one order per epoch whatever the layout: 4 steps over 2 ranks took its
    first 32, so 1 rank resumes at its step 8 and 4 ranks at their step 2; 3 ranks cannot (32 / 12)."""
    tokens = torch.arange(16 * 4 * 24 + 1)
    pair = [dataset(tokens, rank=r, world_size=2) for r in range(2)]
    for _ in range(4):
        for data in pair:
            data.next_batch()
    state = pair[0].state_dict()
    one, quad = dataset(tokens), [dataset(tokens, rank=r, world_size=4) for r in range(4)]
    one.load_state_dict(state)
    for data in quad:
        data.load_state_dict(state)
    assert (one.step, quad[0].step) == (8, 2)
    # The next 16 windows as 2 ranks would take them (2 steps), as 1 rank does (2 steps of 4) and as
    # 4 ranks do (one step).
    expected = torch.cat([data.next_batch()[0] for _ in range(2) for data in pair])
    assert torch.equal(torch.cat([one.next_batch()[0] for _ in range(4)]), expected)
    assert torch.equal(torch.cat([data.next_batch()[0] for data in quad]), expected)
    with pytest.raises(ValueError, match=r"32 windows into its epoch, not a whole number .* 3 x 4"):
        dataset(tokens, rank=0, world_size=3).load_state_dict(state)


def test_resume_at_the_end_of_an_epoch_starts_the_next_over_any_layout() -> None:
    """5 steps of 2 windows end an epoch of 10: the next batch starts the next epoch, which a launch of
    4 windows a step (not dividing 10) starts as well, with the windows the straight run takes next.
    A checkpoint that records no windows (saved before weft did) resumes there too."""
    tokens = torch.arange(16 * 10 + 1)
    pairs = PackedDataset(tokens, 16, batch_size=2, rank=0, world_size=1, seed=3)
    for _ in range(5):
        pairs.next_batch()
    state = json.loads(json.dumps(pairs.state_dict()))
    assert state == {"epoch": 0, "step": 5, "windows_per_step": 2, "windows": 10}
    expected = torch.cat([pairs.next_batch()[0] for _ in range(2)])
    for saved in (state, {"epoch": 0, "step": 5, "windows_per_step": 2}):
        fours = PackedDataset(tokens, 16, batch_size=4, rank=0, world_size=1, seed=3)
        fours.load_state_dict(saved)
        assert (fours.epoch, fours.step) == (1, 0)
        assert torch.equal(fours.next_batch()[0], expected)


def test_resume_over_a_changed_corpus_keeps_its_position_in_the_new_order() -> None:
    """A corpus of another number of windows draws another order: the resume goes as many windows
    into it as the checkpoint had taken (train.py warns), and a position past the new epoch's windows
    starts the next epoch rather than stopping the launch."""
    longer = PackedDataset(torch.arange(16 * 12 + 1), 16, batch_size=2, rank=0, world_size=1, seed=3)
    for _ in range(5):
        longer.next_batch()
    state = json.loads(json.dumps(longer.state_dict()))  # 10 of 12 windows into epoch 0
    assert state["windows"] == 12
    same_size = PackedDataset(torch.arange(16 * 11 + 1), 16, batch_size=2, rank=0, world_size=1, seed=3)
    same_size.load_state_dict(state)
    assert (same_size.epoch, same_size.step, same_size.steps_per_epoch) == (0, 5, 5)
    shorter = PackedDataset(torch.arange(16 * 9 + 1), 16, batch_size=2, rank=0, world_size=1, seed=3)
    shorter.load_state_dict(state)
    assert (shorter.epoch, shorter.step) == (1, 0)
    fresh = PackedDataset(torch.arange(16 * 9 + 1), 16, batch_size=2, rank=0, world_size=1, seed=3)
    for _ in range(fresh.steps_per_epoch):
        fresh.next_batch()
    assert torch.equal(shorter.next_batch()[0], fresh.next_batch()[0])


def test_too_small_corpus_says_how_many_tokens() -> None:
    with pytest.raises(ValueError, match=r"has 0 tokens but one step over 1 rank\(s\) needs 65"):
        dataset(torch.arange(0))
    # One step over 2 ranks needs 2 * 4 windows of 16 tokens plus the last target.
    with pytest.raises(ValueError, match=r"has 100 tokens but one step over 2 rank\(s\) needs 129"):
        dataset(torch.arange(100), world_size=2)
    dataset(torch.arange(129), world_size=2).next_batch()
    with pytest.raises(ValueError, match="rank"):
        dataset(torch.arange(1000), rank=2, world_size=2)


def test_memory_mapped_tokens_give_the_same_batches(tmp_path: Path) -> None:
    """Over a uint16 token file, memory-mapped as corpus_tokens gives it, the windows, their order, the
    int64 batches and a resume are those over the same ids in a tensor."""
    tokens = torch.randint(0, 258, (10_000,))
    tokens.numpy().astype(np.uint16).tofile(tmp_path / "tokens.uint16")
    mapped = np.memmap(tmp_path / "tokens.uint16", dtype=np.uint16, mode="r")
    in_memory, on_disk = dataset(tokens, rank=1, world_size=2), dataset(mapped, rank=1, world_size=2)
    for _ in range(in_memory.steps_per_epoch + 2):  # past an epoch boundary
        for want, got in zip(in_memory.next_batch(), on_disk.next_batch(), strict=True):
            assert got.dtype == torch.int64 and torch.equal(got, want)
    resumed = dataset(mapped, rank=1, world_size=2)
    resumed.load_state_dict(json.loads(json.dumps(on_disk.state_dict())))
    for _ in range(3):
        assert torch.equal(resumed.next_batch()[0], in_memory.next_batch()[0])
