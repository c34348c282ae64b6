"""Token files (model/data.py's corpus_tokens): the stream tokenize_corpus(load_documents(...)) gives,
written once and memory-mapped after; a key that follows the corpus, the field and the tokenizer; no
trusted file from a failed build; ranks that wait for another process's build; .npy token ids."""

import json
import logging
import os
import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from model import data
from model.data import PackedDataset, cache_key, corpus_tokens, load_documents, tokenize_corpus
from model.tokenizer import ByteTokenizer, HFTokenizer
from tests.multiprocess import run_ranks
from tests.test_tokenizer import write_hf_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["naïve café ✓", "", "def f(x):\r\n    return x\n", "one\u2028two", "the quick brown fox " * 40]


def write_corpus(root: Path) -> None:
    """A directory of every kind of file: text, .jsonl (BOM, blank lines, Windows line ends, another
    field beside the text) and a symlinked directory."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.md").write_bytes(b"# first file\r\n\r\nwith two paragraphs.\n")
    lines = [json.dumps({"text": d, "body": d.upper()}, ensure_ascii=False) for d in DOCUMENTS]
    (root / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + "\r\n\n".join(lines).encode())
    (root / "shards").mkdir()
    (root / "shards" / "c.txt").write_text("a shard, linked in")
    (root / "linked").symlink_to(root / "shards")


def cached(path: Path | None, tokenizer, cache: Path, field: str = "text", **kwargs) -> np.ndarray:
    path = None if path is None else str(path)
    return corpus_tokens(path, field, tokenizer, str(cache), 1 << 20, **kwargs)[0]


def hf_tokenizer(directory: Path) -> HFTokenizer:
    return HFTokenizer(
        write_hf_tokenizer(directory, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )


@pytest.mark.parametrize("kind", ["bytes", "hf"])
@pytest.mark.parametrize("corpus", ["directory", "b.jsonl", "a.md"])
def test_token_file_holds_the_tokenized_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, corpus: str
) -> None:
    # Small chunks: a build of several chunks per file, and a chunk cut by its characters.
    monkeypatch.setattr(data, "CHUNK_DOCUMENTS", 2)
    monkeypatch.setattr(data, "CHUNK_CHARS", 500)
    write_corpus(tmp_path / "corpus")
    tokenizer = ByteTokenizer() if kind == "bytes" else hf_tokenizer(tmp_path / "tokenizer")
    path = tmp_path / "corpus" if corpus == "directory" else tmp_path / "corpus" / corpus
    tokens = cached(path, tokenizer, tmp_path / "cache")
    expected = tokenize_corpus(load_documents(str(path)), tokenizer).numpy()
    assert tokens.dtype == np.uint16 and isinstance(tokens, np.memmap)
    assert np.array_equal(tokens, expected) and len(expected) > 30
    field = cached(path, tokenizer, tmp_path / "cache", field="body")
    assert np.array_equal(field, tokenize_corpus(load_documents(str(path), "body"), tokenizer).numpy())


def test_default_corpus_goes_through_the_token_file(tmp_path: Path) -> None:
    tokens = cached(None, ByteTokenizer(), tmp_path)
    assert np.array_equal(tokens, tokenize_corpus(load_documents(None), ByteTokenizer()).numpy())


def test_ids_above_65535_are_stored_as_uint32(tmp_path: Path) -> None:
    class WideIds(ByteTokenizer):
        bos_id, eos_id, vocab_size = 70_000, 70_001, 70_002

    (tmp_path / "a.txt").write_text("wide")
    tokens = cached(tmp_path / "a.txt", WideIds(), tmp_path / "cache")
    assert tokens.dtype == np.uint32 and tokens.tolist() == [70_000, *b"wide", 70_001]
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".uint32"]


def test_a_second_launch_reads_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A build logs its progress and says what it wrote, and how fast; the next launch tokenizes
    nothing and says which file it read."""
    write_corpus(tmp_path / "corpus")
    path, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    monkeypatch.setattr(data, "PROGRESS_S", 0.0)  # a progress line after every chunk
    with caplog.at_level(logging.INFO, logger="model.data"):
        first, built = corpus_tokens(path, "text", ByteTokenizer(), cache, 264)
    (file,) = (tmp_path / "cache").iterdir()
    assert caplog.messages[0].startswith(f"tokenizing data.path={path} into {file}: 0 of 3 files done, ")
    assert built.startswith(f"tokenized data.path={path} into {file}: {len(first):,} tokens in ")

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(ByteTokenizer, "encode_batch", no_tokenizing)
    again, read = corpus_tokens(path, "text", ByteTokenizer(), cache, 264)
    assert np.array_equal(again, first) and read == f"data.path={path}: {len(first):,} tokens from {file}"


def test_the_key_follows_files_field_and_tokenizer(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus")
    files = data.data_files(str(tmp_path / "corpus"))
    key = cache_key(files, "text", ByteTokenizer())
    assert cache_key(files, "text", ByteTokenizer()) == key
    assert cache_key(files, "body", ByteTokenizer()) != key
    assert cache_key(files[:-1], "text", ByteTokenizer()) != key
    hf = hf_tokenizer(tmp_path / "tokenizer")
    hf_key = cache_key(files, "text", hf)
    assert hf_key not in {key, cache_key(None, "text", hf)}
    # The same tokenizer.json with another end token, or with other bytes, is another key.
    hf.eos_id = hf.tokenizer.token_to_id("<|eot_id|>")
    assert cache_key(files, "text", hf) != hf_key
    tokenizer_json = tmp_path / "tokenizer" / "tokenizer.json"
    tokenizer_json.write_text(json.dumps(json.loads(tokenizer_json.read_text()), indent=1))
    assert cache_key(files, "text", HFTokenizer(tmp_path / "tokenizer")) != hf_key

    # A corpus file touched (a new modification time, the same bytes) is a new key; edited, its new
    # tokens are read.
    stat = (tmp_path / "corpus" / "a.md").stat()
    os.utime(tmp_path / "corpus" / "a.md", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert cache_key(files, "text", ByteTokenizer()) != key
    tokens = cached(tmp_path / "corpus", ByteTokenizer(), tmp_path / "cache")
    (tmp_path / "corpus" / "a.md").write_text("# first file, edited\n")
    edited = cached(tmp_path / "corpus", ByteTokenizer(), tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 2 and len(edited) != len(tokens)
    assert np.array_equal(edited, tokenize_corpus(load_documents(str(tmp_path / "corpus")), ByteTokenizer()))


def test_a_failed_build_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "CHUNK_DOCUMENTS", 1)
    write_corpus(tmp_path / "corpus")
    calls = []

    def fails_on_the_third_chunk(self, texts, bos=True, eos=False):
        calls.append(texts)
        if len(calls) == 3:
            raise RuntimeError("killed mid-way")
        return [self.encode(text, bos, eos) for text in texts]

    with monkeypatch.context() as patch:
        patch.setattr(ByteTokenizer, "encode_batch", fails_on_the_third_chunk)
        with pytest.raises(RuntimeError, match="killed mid-way"):
            cached(tmp_path / "corpus", ByteTokenizer(), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    # A signal stops a build between chunks, and leaves nothing either.
    with pytest.raises(KeyboardInterrupt):
        cached(tmp_path / "corpus", ByteTokenizer(), tmp_path / "cache", stop_requested=lambda: True)
    assert list((tmp_path / "cache").iterdir()) == []
    # What a killed process leaves (its temporary file) is no token file: the next launch builds one.
    files = data.data_files(str(tmp_path / "corpus"))
    name = f"{cache_key(files, 'text', ByteTokenizer())}.uint16"
    (tmp_path / "cache" / f"{name}.tmp-otherhost-123").write_bytes(b"\x01\x00" * 10)
    tokens = cached(tmp_path / "corpus", ByteTokenizer(), tmp_path / "cache")
    assert np.array_equal(tokens, tokenize_corpus(load_documents(str(tmp_path / "corpus")), ByteTokenizer()))
    assert (tmp_path / "cache" / name).is_file()


def test_a_launch_deletes_what_killed_builds_on_its_host_left(tmp_path: Path) -> None:
    """Temporary files that no process holds locked and older than ABANDONED_S are deleted by the next
    launch, a cache hit's too; a running build's file (locked, however long since its last write), a
    file just created and other hosts' files stay."""
    cache = tmp_path / "cache"
    cache.mkdir()
    host = socket.gethostname()
    old = time.time() - data.ABANDONED_S - 60

    def temp(name: str, mtime: float, owner: str = host) -> Path:
        path = cache / f"{name}.tmp-{owner}-123"
        path.write_bytes(b"\x01\x00")
        os.utime(path, (mtime, mtime))
        return path

    killed = temp("a.uint16", old)
    fresh = temp("b.uint16", time.time())
    running = temp("c.uint16", old)
    elsewhere = temp("d.uint16", old, owner="otherhost")
    write_corpus(tmp_path / "corpus")
    with running.open("rb") as held:
        assert data.lock(held)  # as build_token_file holds its file
        cached(tmp_path / "corpus", ByteTokenizer(), cache)
        assert not killed.exists()
        assert fresh.exists() and running.exists() and elsewhere.exists()
    # A build holds its own file locked while it writes it.
    seen = []

    def still_writing() -> bool:
        for building in (tmp_path / "other_cache").glob(f"*.tmp-{host}-{os.getpid()}"):
            with building.open("rb") as file:
                seen.append(data.lock(file))
        return False

    cached(tmp_path / "corpus", ByteTokenizer(), tmp_path / "other_cache", stop_requested=still_writing)
    assert seen and not any(seen)
    killed_again = temp("e.uint16", old)
    cached(tmp_path / "corpus", ByteTokenizer(), cache)  # the token file exists: nothing is built
    assert not killed_again.exists() and not running.exists()


def test_corpus_errors_are_those_of_load_documents(tmp_path: Path) -> None:
    """Streamed a line at a time, a corpus fails with load_documents' message (line numbers counted as
    Python's text files count them, a byte that is not UTF-8 named at the same offset, after a BOM too)
    and leaves no token file."""
    bad = tmp_path / "corpus.jsonl"
    cases = [
        (b'{"text": "fine"}\n{"body": "no text field"}\n', r"corpus\.jsonl:2 has no field 'text'"),
        (b'{"text": "fine"}\r\n\r\n{"text": broken\n', r"corpus\.jsonl:3 is not valid JSON"),
        (b'{"text": "a"}\r{"text": null}\n', r"corpus\.jsonl:2: 'text' is a NoneType, not text"),
        ('{"text": "fine"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"), "continuation byte at byte 30"),
        (b'\xef\xbb\xbf{"text": "fine"}\n{"text": "caf\xc3"}\n', "continuation byte at byte 30"),
        (b"\n\n", r"corpus\.jsonl holds no text: give a corpus"),
        (b'{"text": ""}\n', r"corpus\.jsonl holds no text: give a corpus"),
    ]
    for content, error in cases:
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=error) as expected:
            load_documents(str(bad))
        with pytest.raises(ValueError) as streamed:
            cached(bad, ByteTokenizer(), tmp_path / "cache")
        assert str(streamed.value) == str(expected.value)
    assert list((tmp_path / "cache").iterdir()) == []
    (tmp_path / "corpus.jsonl.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(ValueError, match=r"corpus\.jsonl\.gz is not a \.jsonl/\.md/.*: .*decompress"):
        cached(tmp_path / "corpus.jsonl.gz", ByteTokenizer(), tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cached(tmp_path / "nope.txt", ByteTokenizer(), tmp_path / "cache")


def test_cache_dir_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"cannot write token files in .*a_file \(.*\): set data\.cache_dir"):
        cached(tmp_path / "a.txt", ByteTokenizer(), tmp_path / "a_file")
    with pytest.raises(ValueError, match=r"data\.cache_dir is empty: give a directory, or null"):
        corpus_tokens(str(tmp_path / "a.txt"), "text", ByteTokenizer(), " ", 258)


def test_default_cache_dir_follows_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.default_cache_dir() == tmp_path / "xdg" / "weft" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.default_cache_dir() == tmp_path / "home" / ".cache" / "weft" / "tokens"


def _ranks_read_rank_0s_file(rank: int, world: int, corpus: str, cache: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # one node
    built = []
    data.build_token_file = lambda *args, build=data.build_token_file: built.append(1) or build(*args)
    if rank == 1:  # this rank's look at the corpus gives another key (a file changed in between)
        data.cache_key = lambda *args: "another-key"
    tokens, origin = corpus_tokens(corpus, "text", ByteTokenizer(), cache, 258)
    (file,) = Path(cache).iterdir()
    assert built == ([1] if rank == 0 else [])
    assert origin.startswith("tokenized" if rank == 0 else f"data.path={corpus}: ") and str(file) in origin
    assert np.array_equal(tokens, tokenize_corpus(load_documents(corpus), ByteTokenizer()))


def test_ranks_read_the_file_rank_0_names_and_builds(tmp_path: Path) -> None:
    """Under torch.distributed rank 0 names the file and builds it while the others wait in a barrier
    (of a gloo group with a long timeout); a rank whose own key differs still reads rank 0's file."""
    write_corpus(tmp_path / "corpus")
    run_ranks(_ranks_read_rank_0s_file, 2, str(tmp_path / "corpus"), str(tmp_path / "cache"))


def test_npy_token_ids_are_mapped_as_they_are(tmp_path: Path) -> None:
    ids = np.random.default_rng(0).integers(0, 264, 5_000, dtype=np.int32)
    np.save(tmp_path / "ids.npy", ids)
    path = str(tmp_path / "ids.npy")
    tokens, origin = corpus_tokens(path, "text", ByteTokenizer(), str(tmp_path / "cache"), 264)
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, ids)
    assert origin == f"data.path={path}: 5,000 token ids"
    assert not (tmp_path / "cache").exists()
    over_file, over_tensor = (PackedDataset(t, 16, 4, 0, 1, seed=1) for t in (tokens, torch.from_numpy(ids)))
    for _ in range(3):
        assert torch.equal(over_file.next_batch()[0], over_tensor.next_batch()[0])


def _ranks_check_npy_ids_once(rank: int, world: int, path: str, vocab_size: int, case: str) -> None:
    read = []
    data.id_outside = lambda *args, scan=data.id_outside: read.append(1) or scan(*args)
    if case == "other file" and rank == 1:  # this node's copy of the file holds fewer ids
        data.pretokenized = lambda *args, load=data.pretokenized: load(*args)[:-1]
    if case == "good":
        tokens, _ = corpus_tokens(path, "text", ByteTokenizer(), None, vocab_size)
        assert np.array_equal(tokens, np.load(path))
    else:
        messages = {
            "bad id": f" holds token id 300, outside the model's {vocab_size} ids",
            "other file": " holds 4,999 token ids on rank 1 and 5,000 on rank 0: give every rank the same",
        }
        message = re.escape(path) + messages[case]
        if case == "other file" and rank == 0:
            corpus_tokens(path, "text", ByteTokenizer(), None, vocab_size)  # rank 0 cannot tell
        else:
            with pytest.raises(ValueError, match=message):
                corpus_tokens(path, "text", ByteTokenizer(), None, vocab_size)
    assert read == ([1] if rank == 0 else [])


@pytest.mark.parametrize("case", ["good", "bad id", "other file"])
def test_npy_ids_are_read_by_rank_0_alone(tmp_path: Path, case: str) -> None:
    """Under torch.distributed rank 0 alone reads a .npy file's ids against the vocabulary, and every
    rank stops with its one-line error; a rank whose file holds another number of ids stops too."""
    ids = np.random.default_rng(0).integers(0, 264, 5_000, dtype=np.int32)
    if case == "bad id":
        ids[4_321] = 300
    np.save(tmp_path / "ids.npy", ids)
    run_ranks(_ranks_check_npy_ids_once, 2, str(tmp_path / "ids.npy"), 264, case)


@pytest.mark.parametrize(
    ("array", "error"),
    [
        (np.zeros((4, 8), np.int64), r"holds an array of shape \(4, 8\): give a 1-D array of token ids"),
        (np.zeros(10, np.float32), "holds float32 values: give integer token ids"),
        (
            np.array([1, 2, 264, 3]),
            "holds token id 264, outside the model's 264 ids: .* raise model.vocab_size",
        ),
        (np.array([1, -1, 3]), "holds token id -1, outside the model's 264 ids"),
        (np.array(["a", 1], dtype=object), r"is not a \.npy array of token ids"),
    ],
)
def test_bad_npy_files_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, array: np.ndarray, error: str
) -> None:
    monkeypatch.setattr(data, "CHECK_CHUNK", 2)  # the bad id in a later chunk than the first
    np.save(tmp_path / "ids.npy", array)
    with pytest.raises(ValueError, match=error) as caught:
        corpus_tokens(str(tmp_path / "ids.npy"), "text", ByteTokenizer(), None, 264)
    assert "\n" not in str(caught.value) and str(tmp_path / "ids.npy") in str(caught.value)


def test_an_npz_archive_is_refused(tmp_path: Path) -> None:
    np.savez(tmp_path / "ids.npz", ids=np.arange(10))
    (tmp_path / "ids.npz").rename(tmp_path / "ids.npy")
    with pytest.raises(ValueError, match=r"ids\.npy is a \.npz archive: give one array of token ids"):
        corpus_tokens(str(tmp_path / "ids.npy"), "text", ByteTokenizer(), None, 264)


def test_ids_past_the_token_files_dtype_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dtype comes from the tokenizer's vocab_size; an id past it (a vocabulary with gaps) would wrap
    around in the cast, so the build refuses it (here: the byte tokenizer's BOS 256 in one byte)."""
    (tmp_path / "a.txt").write_text("text")
    monkeypatch.setattr(data, "token_dtype", lambda tokenizer: np.dtype(np.uint8))
    with pytest.raises(ValueError, match="the tokenizer gave id 257, not below its vocab_size 258: give"):
        cached(tmp_path / "a.txt", ByteTokenizer(), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_timedelta_npy_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "ids.npy", np.arange(10).astype("m8[s]"))
    with pytest.raises(ValueError, match=r"holds timedelta64.* values: give integer token ids"):
        corpus_tokens(str(tmp_path / "ids.npy"), "text", ByteTokenizer(), None, 264)
