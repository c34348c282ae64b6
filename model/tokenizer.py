"""Tokenizers: UTF-8 bytes for the built-in default, and `tokenizer.json` (through the `tokenizers`
library) for Hugging Face checkpoints. Both expose encode / decode / vocab_size / bos_id / eos_id."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class ByteTokenizer:
    """Token ids 0..255 are the UTF-8 bytes; 256 and 257 mark the beginning and end of a text."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`; begin/end ids from tokenizer_config.json or config.json."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        self.tokenizer = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special_id("bos")
        self.eos_id = self._special_id("eos")

    def _special_id(self, kind: str) -> int | None:
        for name in ("tokenizer_config.json", "config.json", "generation_config.json"):
            path = self.directory / name
            if not path.is_file():
                continue
            config = json.loads(path.read_text())
            token = config.get(f"{kind}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and self.tokenizer.token_to_id(token) is not None:
                return self.tokenizer.token_to_id(token)
            token_id = config.get(f"{kind}_token_id")
            if isinstance(token_id, list):
                token_id = token_id[0] if token_id else None
            if isinstance(token_id, int):
                return token_id
        return None

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        # The tokenizer's own post-processor may already add a begin token: add ours only if it did not.
        ids = self.tokenizer.encode(text, add_special_tokens=bos).ids
        if bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        if not bos and ids and ids[0] == self.bos_id:
            ids = ids[1:]
        if eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(directory: str | Path | None) -> Tokenizer:
    """The tokenizer saved in `directory` (a Hugging Face model or a weft run directory), else bytes."""
    if directory is not None and (Path(directory) / "tokenizer.json").is_file():
        return HFTokenizer(directory)
    return ByteTokenizer()


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Copy a Hugging Face tokenizer's files into `directory`; the byte tokenizer needs no files."""
    if isinstance(tokenizer, HFTokenizer):
        Path(directory).mkdir(parents=True, exist_ok=True)
        for name in HF_TOKENIZER_FILES:
            source = tokenizer.directory / name
            if source.is_file() and source.resolve() != (Path(directory) / name).resolve():
                shutil.copyfile(source, Path(directory) / name)
