"""Training text -> packed fixed-length token windows, sharded deterministically across ranks, with
a position that a checkpoint saves for an exact resume."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from model.tokenizer import Tokenizer

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text"}
SUFFIXES = "/".join(sorted(TEXT_SUFFIXES | {".jsonl"}))


def default_corpus() -> list[str]:
    """Python's own documentation topics: about 465 KB of English and code shipped with every Python."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def read_text(path: Path) -> str:
    try:
        # A byte order mark (some Windows editors start UTF-8 files with one) is no part of the text.
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path} is not UTF-8 text ({error.reason} at byte {error.start}): convert it to UTF-8"
        ) from None


def read_documents(path: Path, jsonl_field: str) -> list[str]:
    """A .jsonl file's documents (the `jsonl_field` string of each line), or a text file as one."""
    if path.suffix not in TEXT_SUFFIXES | {".jsonl"}:
        raise ValueError(f"{path} is not a {SUFFIXES} file: weft reads UTF-8 text (decompress or rename it)")
    if path.suffix == ".jsonl":
        documents = []
        # Lines end at "\n" only: str.splitlines also breaks at U+2028, U+2029 and U+0085, which JSON
        # writers leave unescaped inside strings (json.dumps with ensure_ascii=False does).
        for number, line in enumerate(read_text(path).split("\n"), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not valid JSON ({error.msg})") from None
            if not isinstance(record, dict) or jsonl_field not in record:
                raise ValueError(f"{path}:{number} has no field {jsonl_field!r}: set data.jsonl_field")
            if not isinstance(record[jsonl_field], str):
                kind = type(record[jsonl_field]).__name__
                raise ValueError(
                    f"{path}:{number}: {jsonl_field!r} is a {kind}, not text: set data.jsonl_field"
                )
            documents.append(record[jsonl_field])
        return documents
    return [read_text(path)]


def corpus_files(root: Path) -> list[Path]:
    """The text and .jsonl files under `root`, sorted. Symlinked directories are followed (Path.rglob
    leaves them out, and a corpus assembled from links would lose their files without a word), each
    real directory once so that a link back up the tree ends."""
    files, seen = [], set()
    for directory, subdirectories, names in os.walk(root, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen:
            subdirectories.clear()
            continue
        seen.add(real)
        subdirectories.sort()  # a directory linked twice is read where the sorted walk meets it first
        files += [Path(directory, name) for name in names if Path(name).suffix in TEXT_SUFFIXES | {".jsonl"}]
    return sorted(file for file in files if file.is_file())


def load_documents(path: str | None, jsonl_field: str = "text") -> list[str]:
    """Documents of the corpus: the default one (path None), a text or .jsonl file, or a directory
    of such files (read in sorted order)."""
    if path is None:
        return default_corpus()
    root = Path(path)
    if root.is_dir():
        files = corpus_files(root)
        if not files:
            raise FileNotFoundError(f"data.path={path} holds no {SUFFIXES} files")
        documents = [doc for file in files for doc in read_documents(file, jsonl_field)]
    elif root.is_file():
        documents = read_documents(root, jsonl_field)
    else:
        raise FileNotFoundError(f"data.path={path} does not exist: give a text/.jsonl file or a directory")
    if not any(documents):
        raise ValueError(f"data.path={path} holds no text: give a corpus")
    return documents


def tokenize_corpus(documents: Sequence[str], tokenizer: Tokenizer, chunk: int = 1024) -> torch.Tensor:
    """One stream of token ids, each document starting with BOS and ending with EOS. Nothing is cached
    on disk."""
    parts = [torch.zeros(0, dtype=torch.int64)]
    for first in range(0, len(documents), chunk):
        encoded = tokenizer.encode_batch(documents[first : first + chunk], bos=True, eos=True)
        parts.append(torch.tensor([i for ids in encoded for i in ids], dtype=torch.int64))
    return torch.cat(parts)


def marks_document_boundaries(tokenizer: Tokenizer) -> bool:
    """Whether tokenize_corpus puts anything between two documents: a BOS or EOS id, or the specials
    of a post-processor where no BOS id is known. A tokenizer without either packs them back to back."""
    return tokenizer.encode_batch(["a"], bos=True, eos=True) != tokenizer.encode_batch(["a"], bos=False)


class PackedDataset:
    """The token stream cut into windows of seq_len + 1 tokens (inputs and the targets one ahead).
    Each epoch visits the windows in an order drawn from (seed, epoch); step i of rank r takes windows
    [(i * world + r) * batch, ... + batch) of that order, so ranks never share a window."""

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, batch_size: int, rank: int, world_size: int, seed: int
    ):
        if tokens.dim() != 1:
            raise ValueError(
                f"PackedDataset takes a 1-D tensor of token ids, got shape {tuple(tokens.shape)}"
            )
        if seq_len <= 0 or batch_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"need seq_len > 0, batch_size > 0 and 0 <= rank < world_size "
                f"(got {seq_len}, {batch_size}, rank {rank} of {world_size})"
            )
        tokens = tokens.to(torch.int64)
        self.n_windows = max(0, (tokens.numel() - 1) // seq_len)
        self.windows = tokens[: self.n_windows * seq_len + 1]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.steps_per_epoch = self.n_windows // (batch_size * world_size)
        if self.steps_per_epoch == 0:
            needed = batch_size * world_size * seq_len + 1
            raise ValueError(
                f"the corpus has {tokens.numel()} tokens but one step over {world_size} rank(s) needs "
                f"{needed}: use more data or a smaller training.batch_size / training.seq_len"
            )
        self.epoch, self.step = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n_windows, generator=generator)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
            self._order = self._epoch_order()
        first = (self.step * self.world_size + self.rank) * self.batch_size
        starts = self._order[first : first + self.batch_size] * self.seq_len
        offsets = torch.arange(self.seq_len + 1)
        batch = self.windows[starts[:, None] + offsets[None, :]]
        self.step += 1
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from: the epoch, the steps already taken in it, and the windows a
        step took (data-parallel ranks x batch size), so that another layout resumes at the same place."""
        return {"epoch": self.epoch, "step": self.step, "windows_per_step": self.world_size * self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        per_step = self.world_size * self.batch_size
        taken = int(state["step"]) * int(state.get("windows_per_step", per_step))  # this epoch's windows
        if taken % per_step:
            raise ValueError(
                f"the checkpoint's data position is {taken} windows into its epoch, not a whole number of "
                f"this launch's steps of {per_step} windows (data-parallel ranks x training.batch_size = "
                f"{self.world_size} x {self.batch_size}): resume with ranks x batch size dividing {taken}"
            )
        step = taken // per_step
        if step > self.steps_per_epoch:
            raise ValueError(
                f"saved data position {step} is past this corpus' {self.steps_per_epoch} steps per epoch: "
                "resume with the same data, training.batch_size and training.seq_len"
            )
        self.epoch, self.step = int(state["epoch"]), step
        self._order = self._epoch_order()


def build_dataset(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
) -> PackedDataset:
    """Tokenize the documents (as `load_documents` gives them) and pack them."""
    return PackedDataset(tokenize_corpus(documents, tokenizer), seq_len, batch_size, rank, world_size, seed)
