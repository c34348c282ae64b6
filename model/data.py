"""Training text -> a file of token ids on disk, memory-mapped by every rank -> packed fixed-length
windows, sharded deterministically across ranks, with a position that a checkpoint saves for an exact
resume.

A corpus is tokenized once: `corpus_tokens` streams it, file by file and a chunk of documents at a time,
into a token file under data.cache_dir named by everything its tokens depend on (`cache_key`); every rank
of the launch, and every later launch, memory-maps that file. A rank's host memory then holds a batch and
the epoch's order of windows, not the corpus. A .npy file of token ids is memory-mapped as it is."""

from __future__ import annotations

import codecs
import fcntl
import hashlib
import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
import torch.distributed as dist

from model.tokenizer import HFTokenizer, Tokenizer

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text"}
SUFFIXES = "/".join(sorted(TEXT_SUFFIXES | {".jsonl"}))
# Part of every token file's key: bump it when the tokens written for the same key change, so that no
# launch reads a file an older weft wrote.
FORMAT_VERSION = 1
# What a build holds at once: this many documents, or fewer whose text reaches CHUNK_CHARS characters.
CHUNK_DOCUMENTS = 1024
CHUNK_CHARS = 1 << 24
# Seconds between the progress lines of a build.
PROGRESS_S = 30.0
# How long ranks wait for a build of the token file (a large corpus takes hours).
BUILD_TIMEOUT = timedelta(days=1)
# Token ids of a .npy file checked at once (128 MiB of int64).
CHECK_CHUNK = 1 << 24
# A build's temporary file that no process holds locked is abandoned once this old (younger, it may be
# a file just created whose build has not locked it yet).
ABANDONED_S = 60.0


def default_corpus() -> list[str]:
    """Python's own documentation topics: about 465 KB of English and code shipped with every Python."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def not_utf8(path: Path, reason: str, byte: int) -> ValueError:
    return ValueError(f"{path} is not UTF-8 text ({reason} at byte {byte}): convert it to UTF-8")


def read_text(path: Path) -> str:
    try:
        # A byte order mark (some Windows editors start UTF-8 files with one) is no part of the text.
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise not_utf8(path, error.reason, error.start) from None


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines of a UTF-8 file, numbered from 1, as `read_text(path).split("\\n")` gives them (a byte
    order mark dropped; "\\r\\n" and a lone "\\r" end a line too, as in Python's text files), read a
    line at a time. A byte that is not UTF-8 is named at the offset read_text names (after any BOM)."""
    number, offset = 0, 0
    with path.open("rb") as file:
        # Lines end at b"\n" here: no UTF-8 character holds that byte, so each line decodes on its own,
        # with its "\n" (a character cut short before it is an "invalid continuation byte", as in the
        # whole file).
        for index, raw in enumerate(file):
            if index == 0 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise not_utf8(path, error.reason, offset + error.start) from None
            offset += len(raw)
            lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            if lines[-1] == "":  # (the nothing after this line's end is no line)
                lines.pop()
            for line in lines:
                number += 1
                yield number, line


def read_documents(path: Path, jsonl_field: str) -> Iterator[str]:
    """A .jsonl file's documents (the `jsonl_field` string of each line), read a line at a time, or a
    text file as one document."""
    if path.suffix not in TEXT_SUFFIXES | {".jsonl"}:
        raise ValueError(
            f"{path} is not a {SUFFIXES} file: weft reads UTF-8 text (decompress or rename it) or a .npy "
            "array of token ids"
        )
    if path.suffix != ".jsonl":
        yield read_text(path)
        return
    # Lines end at line ends only (text_lines): str.splitlines also breaks at U+2028, U+2029 and U+0085,
    # which JSON writers leave unescaped inside strings (json.dumps with ensure_ascii=False does). Read a
    # line at a time, a file's first error is the first in its lines' order (a byte that is not UTF-8
    # included).
    for number, line in text_lines(path):
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
            raise ValueError(f"{path}:{number}: {jsonl_field!r} is a {kind}, not text: set data.jsonl_field")
        text = record[jsonl_field]
        # JSON's escapes can spell half a UTF-16 pair ("\ud83d", scraped text holds them), which no
        # tokenizer encodes: name the line here rather than fail inside a tokenizer naming none.
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(
                    f"{path}:{number}: {jsonl_field!r} holds an unpaired surrogate "
                    f"({text[error.start]!r} at character {error.start}): repair or drop that line"
                ) from None
        yield text


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


def data_files(path: str, key: str = "data.path") -> list[Path]:
    """The files `path` names (the config key `key`'s value): itself, or a directory's text and .jsonl
    files (in sorted order)."""
    root = Path(path)
    if root.is_dir():
        files = corpus_files(root)
        if not files:
            raise FileNotFoundError(f"{key}={path} holds no {SUFFIXES} files")
        return files
    if root.is_file():
        return [root]
    raise FileNotFoundError(
        f"{key}={path} does not exist: give a text/.jsonl file, a directory of them or a .npy file"
    )


def shared_files(path: str, other: str) -> list[Path]:
    """The files (resolved, sorted) that both paths take in (`data_files`): a file named by one and held
    in the other's directory, or one file named by both."""
    resolved = {file.resolve() for file in data_files(path)}
    return sorted(resolved & {file.resolve() for file in data_files(other)})


def no_text(path: str | None, key: str = "data.path") -> ValueError:
    return ValueError(f"{key}={path} holds no text: give a corpus")


def load_documents(path: str | None, jsonl_field: str = "text") -> list[str]:
    """Documents of the corpus, all in memory: the default one (path None), a text or .jsonl file, or a
    directory of such files. A token file holds tokenize_corpus of these, built without holding them
    all (`build_token_file`)."""
    if path is None:
        return default_corpus()
    documents = [doc for file in data_files(path) for doc in read_documents(file, jsonl_field)]
    if not any(documents):
        raise no_text(path)
    return documents


def tokenize_corpus(documents: Sequence[str], tokenizer: Tokenizer, chunk: int = 1024) -> torch.Tensor:
    """One stream of token ids, each document starting with BOS and ending with EOS."""
    parts = [torch.zeros(0, dtype=torch.int64)]
    for first in range(0, len(documents), chunk):
        encoded = tokenizer.encode_batch(documents[first : first + chunk], bos=True, eos=True)
        # (fromiter: 3x faster than torch.tensor of a flattened list)
        parts.append(torch.from_numpy(np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64)))
    return torch.cat(parts)


def marks_document_boundaries(tokenizer: Tokenizer) -> bool:
    """Whether tokenize_corpus puts anything between two documents: a BOS or EOS id, or the specials
    of a post-processor where no BOS id is known. A tokenizer without either packs them back to back."""
    return tokenizer.encode_batch(["a"], bos=True, eos=True) != tokenizer.encode_batch(["a"], bos=False)


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/weft/tokens, else ~/.cache/weft/tokens."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "weft", "tokens")


def token_dtype(tokenizer: Tokenizer) -> np.dtype:
    """uint16 while every id fits (2 bytes a token), else uint32."""
    return np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)


def cache_key(files: list[Path] | None, jsonl_field: str, tokenizer: Tokenizer) -> str:
    """A name that changes whenever the tokens would: the corpus, the field read from its .jsonl files,
    the tokenizer and FORMAT_VERSION.

    Files count by their resolved path, size and modification time, not by a hash of their contents:
    hashing a 40 GB corpus at every launch would cost much of what the file saves, and any write
    (an editor's, cp's, rsync's without -t) changes the time to the nanosecond. What this misses is
    content replaced by the same number of bytes with the old time put back (touch -r, rsync -t): delete
    the token file then. The default corpus, a few hundred KB, is hashed."""
    if files is None:
        corpus: object = hashlib.sha256("\0".join(default_corpus()).encode()).hexdigest()
    else:
        stats = [(str(file.resolve()), file.stat()) for file in files]
        corpus = [(name, stat.st_size, stat.st_mtime_ns) for name, stat in stats]
    if isinstance(tokenizer, HFTokenizer):
        tokenizer_file = (tokenizer.directory / "tokenizer.json").read_bytes()
        # tokenizer_config.json's split_special_tokens changes how a text naming a special token encodes.
        encoding: object = [
            hashlib.sha256(tokenizer_file).hexdigest(),
            tokenizer.tokenizer.encode_special_tokens,
        ]
    else:
        encoding = "bytes"
    parts = [FORMAT_VERSION, corpus, jsonl_field, encoding, tokenizer.bos_id, tokenizer.eos_id]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def chunks(documents: Iterable[str]) -> Iterator[list[str]]:
    """The documents in lists of CHUNK_DOCUMENTS, or fewer where their text reaches CHUNK_CHARS."""
    chunk, chars = [], 0
    for document in documents:
        chunk.append(document)
        chars += len(document)
        if len(chunk) == CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def corpus_name(path: str | None, key: str) -> str:
    return "Python's documentation topics" if path is None else f"{key}={path}"


def unwritable(directory: Path, error: OSError) -> ValueError:
    return ValueError(
        f"cannot write token files in {directory} ({error.strerror or error}): set data.cache_dir to a "
        "directory you can write, with room for the corpus' tokens"
    )


def lock(file: BinaryIO) -> bool:
    """Take an exclusive lock on `file` without waiting: False where another process holds one (or the
    file system has no locks). Held until the file is closed."""
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def remove_abandoned_builds(directory: Path) -> None:
    """Delete the temporary files that builds on this host killed outright (SIGKILL) left in
    `directory`. A running build holds a lock on its file throughout, whatever its process's PID
    namespace; a file that nobody holds and that is older than ABANDONED_S is abandoned."""
    for temp in directory.glob(f"*.tmp-{socket.gethostname()}-*"):
        try:
            if time.time() - temp.stat().st_mtime < ABANDONED_S:
                continue
            with temp.open("rb") as file:
                if lock(file):
                    temp.unlink()
        except OSError:  # gone already (another rank's cleanup), or not ours to delete
            pass


def build_token_file(
    target: Path,
    path: str | None,
    files: list[Path] | None,
    jsonl_field: str,
    tokenizer: Tokenizer,
    stop_requested: Callable[[], bool],
    key: str,
) -> str:
    """Write the corpus' tokens (tokenize_corpus(load_documents(path, jsonl_field)) as token_dtype) to
    `target`, a file at a time and a chunk of documents at a time, logging progress every PROGRESS_S
    seconds; returns a line on what it wrote, and how fast. The tokens go to a temporary name renamed
    to `target` once complete: a build that fails or is stopped leaves no file that a launch takes for
    finished, and builders running at once (one per node over a shared file system) each rename a whole
    file of the same tokens."""
    temp = target.with_name(f"{target.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    dtype = token_dtype(tokenizer)
    count = 1 if files is None else len(files)
    sources = [default_corpus()] if files is None else (read_documents(file, jsonl_field) for file in files)
    start = shown = time.monotonic()
    tokens, has_text = 0, False
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        out = temp.open("wb")
    except OSError as error:
        raise unwritable(target.parent, error) from None
    try:
        with out:
            lock(out)  # (until the file is closed, after it is published: remove_abandoned_builds)
            for done, documents in enumerate(sources):
                for chunk in chunks(documents):
                    if stop_requested():
                        raise KeyboardInterrupt
                    ids = tokenize_corpus(chunk, tokenizer).numpy()
                    if ids.size and ids.max() > np.iinfo(dtype).max:  # a vocabulary with gaps in its ids
                        raise ValueError(
                            f"the tokenizer gave id {ids.max()}, not below its vocab_size "
                            f"{tokenizer.vocab_size}: give a tokenizer whose ids are below its size"
                        )
                    ids = ids.astype(dtype)
                    has_text = has_text or any(chunk)
                    try:
                        ids.tofile(out)  # (written through to the file: nothing left in out's buffer)
                    except OSError as error:  # a full disk
                        raise unwritable(target.parent, error) from None
                    tokens += ids.size
                    if time.monotonic() - shown >= PROGRESS_S:
                        shown = time.monotonic()
                        log.info(
                            f"tokenizing {corpus_name(path, key)} into {target}: {done} of {count} files "
                            f"done, {tokens:,} tokens ({shown - start:.0f} s)"
                        )
            if not has_text:
                raise no_text(path, key)
            try:
                os.fsync(out.fileno())  # the tokens on disk before the name that says they are complete
            except OSError as error:  # a network file system's full disk shows here
                raise unwritable(target.parent, error) from None
            # A link, not a rename: where another builder (another node on a shared file system) got
            # there first, its file stays, and the ranks that already map it keep a file that exists.
            try:
                os.link(temp, target)
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise
            except OSError:  # a file system without hard links
                os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    seconds = time.monotonic() - start
    return (
        f"tokenized {corpus_name(path, key)} into {target}: {tokens:,} tokens in {seconds:.2f} s "
        f"({tokens / seconds / 1e6:.2f}M tokens/s)"
    )


def read_token_file(target: Path, dtype: np.dtype) -> np.ndarray:
    # (mmap refuses an empty file; a corpus of texts that tokenize to nothing makes one)
    return np.memmap(target, dtype=dtype, mode="r") if target.stat().st_size else np.zeros(0, dtype)


def pretokenized(path: str, key: str) -> np.ndarray:
    """A .npy file's 1-D array of integer token ids, memory-mapped (`checked_once` checks the ids)."""
    try:
        tokens = np.load(path, mmap_mode="r")
    except ValueError as error:  # an object array (pickled), or no .npy header
        raise ValueError(f"{key}={path} is not a .npy array of token ids ({error})") from None
    if not isinstance(tokens, np.ndarray):
        raise ValueError(f"{key}={path} is a .npz archive: give one array of token ids, saved by numpy.save")
    if tokens.ndim != 1:
        raise ValueError(
            f"{key}={path} holds an array of shape {tokens.shape}: give a 1-D array of token ids"
        )
    if tokens.dtype.kind not in "iu":  # (np.integer would let timedelta64 through)
        raise ValueError(f"{key}={path} holds {tokens.dtype} values: give integer token ids")
    return tokens


def id_outside(tokens: np.ndarray, vocab_size: int) -> int | None:
    """The first id found outside [0, vocab_size) (the model's embedding has a row for each id inside),
    or None: one pass over the ids, CHECK_CHUNK at a time."""
    for first in range(0, tokens.size, CHECK_CHUNK):
        part = tokens[first : first + CHECK_CHUNK]
        low, high = int(part.min()), int(part.max())
        if low < 0 or high >= vocab_size:
            return low if low < 0 else high
    return None


def checked_once(tokens: np.ndarray, vocab_size: int, path: str, key: str) -> None:
    """Raise a one-line error if the .npy file's ids leave the model's vocabulary. Under
    torch.distributed rank 0 reads the ids and tells every rank what it found (reading a corpus of
    billions of ids takes seconds, each rank reading it again takes them again), in a gloo group whose
    timeout outlasts the read; a rank whose file holds another number of ids than rank 0's stops."""
    if not dist.is_initialized():
        found = id_outside(tokens, vocab_size)
    else:
        group = dist.new_group(backend="gloo", timeout=BUILD_TIMEOUT)
        answer = [id_outside(tokens, vocab_size), tokens.size] if dist.get_rank() == 0 else [None, None]
        dist.broadcast_object_list(answer, src=0, group=group)
        dist.destroy_process_group(group)
        found, size = answer
        if size != tokens.size:
            raise ValueError(
                f"{key}={path} holds {tokens.size:,} token ids on rank {dist.get_rank()} and {size:,} on "
                "rank 0: give every rank the same file"
            )
    if found is not None:
        raise ValueError(
            f"{key}={path} holds token id {found}, outside the model's {vocab_size} ids: give ids of the "
            "model's tokenizer, or raise model.vocab_size"
        )


def corpus_tokens(
    path: str | None,
    jsonl_field: str,
    tokenizer: Tokenizer,
    cache_dir: str | None,
    vocab_size: int,
    stop_requested: Callable[[], bool] = lambda: False,
    key: str = "data.path",
) -> tuple[np.ndarray, str]:
    """The corpus' token ids, memory-mapped, and a line for the run's log on where they come from.

    A .npy file's ids are read as they are (checked against vocab_size, the model's, by rank 0 alone
    under torch.distributed: `checked_once`); any other corpus
    is tokenize_corpus(load_documents(path, jsonl_field), tokenizer), read from its token file under
    cache_dir (None: default_cache_dir()), built first where it is missing. Under torch.distributed
    every rank reads the file rank 0 names (the ranks' keys could differ if a corpus file changed
    between their looks), which rank 0 builds; then the first rank of each node (LOCAL_RANK 0) that
    still cannot see it (a cache on the node's own disk) builds it there. The others wait in barriers
    of a gloo group whose timeout outlasts a build (the default group's would end a long one). A signal
    (`stop_requested`) ends a build with KeyboardInterrupt. Messages name `path` as the config key `key`."""
    if path is not None and Path(path).suffix == ".npy" and Path(path).is_file():
        tokens = pretokenized(path, key)
        checked_once(tokens, vocab_size, path, key)
        return tokens, f"{key}={path}: {tokens.size:,} token ids"
    if cache_dir is not None and not cache_dir.strip():
        raise ValueError("data.cache_dir is empty: give a directory, or null")
    files = None if path is None else data_files(path, key)
    dtype = token_dtype(tokenizer)
    directory = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    target = directory / f"{cache_key(files, jsonl_field, tokenizer)}.{dtype.name}"

    def build() -> str | None:
        remove_abandoned_builds(target.parent)
        if target.exists():
            return None
        return build_token_file(target, path, files, jsonl_field, tokenizer, stop_requested, key)

    if not dist.is_initialized():
        built = build()
    else:
        group = dist.new_group(backend="gloo", timeout=BUILD_TIMEOUT)
        named = [str(target)]
        dist.broadcast_object_list(named, src=0, group=group)
        target = Path(named[0])
        built, failure = _attempt(build) if dist.get_rank() == 0 else (None, None)
        _raise_on_every_rank(failure, group)
        if built is None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            built, failure = _attempt(build)
        _raise_on_every_rank(failure, group)
        dist.destroy_process_group(group)
    tokens = read_token_file(target, dtype)
    return tokens, built or f"{corpus_name(path, key)}: {tokens.size:,} tokens from {target}"


def _attempt(build: Callable[[], str | None]) -> tuple[str | None, ValueError | FileNotFoundError | None]:
    """(what `build` returned, None), or (None, the user error it raised: a bad line, a file gone)."""
    try:
        return build(), None
    except (ValueError, FileNotFoundError) as err:
        return None, err


def _raise_on_every_rank(failure: ValueError | FileNotFoundError | None, group: dist.ProcessGroup) -> None:
    """The meeting after a build: if any rank's build met a user error, every rank raises it (the
    first by rank), so that it prints as one line rather than as the waiting ranks' broken barriers."""
    told: list[tuple[type, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(told, None if failure is None else (type(failure), str(failure)), group=group)
    first = next((item for item in told if item is not None), None)
    if first is None:
        return
    dist.destroy_process_group(group)
    if failure is not None:
        raise failure
    kind, message = first
    raise kind(message)


class PackedDataset:
    """The token stream cut into windows of seq_len + 1 tokens (inputs and the targets one ahead).
    Each epoch visits the windows in an order drawn from (seed, epoch); step i of rank r takes windows
    [(i * world + r) * batch, ... + batch) of that order, so ranks never share a window. The tokens may
    be a memory-mapped array (`corpus_tokens`): a batch reads its windows alone, as int64."""

    def __init__(
        self,
        tokens: torch.Tensor | np.ndarray,
        seq_len: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
    ):
        if tokens.ndim != 1:
            raise ValueError(
                f"PackedDataset takes a 1-D array or tensor of token ids, got shape {tuple(tokens.shape)}"
            )
        if seq_len <= 0 or batch_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"need seq_len > 0, batch_size > 0 and 0 <= rank < world_size "
                f"(got {seq_len}, {batch_size}, rank {rank} of {world_size})"
            )
        self.tokens = tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens
        self.n_windows = max(0, (len(self.tokens) - 1) // seq_len)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.steps_per_epoch = self.n_windows // (batch_size * world_size)
        if self.steps_per_epoch == 0:
            needed = batch_size * world_size * seq_len + 1
            raise ValueError(
                f"the corpus has {len(self.tokens)} tokens but one step over {world_size} rank(s) needs "
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
        starts = (self._order[first : first + self.batch_size] * self.seq_len).tolist()
        windows = [self.tokens[start : start + self.seq_len + 1] for start in starts]
        batch = torch.from_numpy(np.stack(windows).astype(np.int64))
        self.step += 1
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from: the epoch, the steps already taken in it, the windows a step
        took (data-parallel ranks x batch size), so that another layout resumes at the same place, and
        the epoch's windows, which name its order: a resume over a corpus of another number
        (`load_state_dict`) is told that its order is a new one."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "windows_per_step": self.world_size * self.batch_size,
            "windows": self.n_windows,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume the same number of windows into the saved epoch's order. A position at the end of its
        epoch is the start of the next one, which any layout can start. State without "windows" (saved
        before weft recorded them) is taken to be over this corpus. Over a corpus of another number of
        windows the epoch's order is a new one (train.py warns): the saved number of windows into it is
        kept, and a position past this corpus' epoch starts the next epoch."""
        per_step = self.world_size * self.batch_size
        saved_step, saved_per_step = int(state["step"]), int(state.get("windows_per_step", per_step))
        windows = int(state.get("windows", self.n_windows))
        epoch, taken = int(state["epoch"]), saved_step * saved_per_step  # this epoch's windows
        past_changed_corpus = windows != self.n_windows and taken > self.steps_per_epoch * per_step
        if (saved_step and saved_step == windows // saved_per_step) or past_changed_corpus:
            epoch, taken = epoch + 1, 0
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
        self.epoch, self.step = epoch, step
        self._order = self._epoch_order()
