"""Tokenizers: UTF-8 bytes for the built-in default, and `tokenizer.json` (through the `tokenizers`
library) for Hugging Face checkpoints. Both expose encode / decode / vocab_size / bos_id / eos_id."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Where a Hugging Face directory may name its begin/end tokens, in the order they are consulted.
CONFIG_FILES = ("tokenizer_config.json", "config.json", "generation_config.json", "special_tokens_map.json")
# Begin/end tokens looked up by name when no file names them.
KNOWN_SPECIALS = {"bos": ("<|begin_of_text|>", "<s>", "<bos>"), "eos": ("<|end_of_text|>", "</s>", "<eos>")}


class ByteTokenizer:
    """Token ids 0..255 are the UTF-8 bytes; 256 and 257 mark the beginning and end of a text."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

    def encode_batch(self, texts: Sequence[str], bos: bool = True, eos: bool = False) -> list[list[int]]:
        return [self.encode(text, bos, eos) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`. Begin/end ids come from tokenizer_config.json, config.json,
    generation_config.json or special_tokens_map.json (the first that names one the vocabulary has),
    else from the usual special tokens (Llama-3's <|begin_of_text|> / <|end_of_text|>, <s> / </s>)."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        file = self.directory / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist: a Hugging Face tokenizer needs tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(file))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special_id("bos")
        self.eos_id = self._special_id("eos")

    def _special_id(self, kind: str) -> int | None:
        for name in CONFIG_FILES:
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
            if isinstance(token_id, int) and 0 <= token_id < self.vocab_size:
                return token_id
        for token in KNOWN_SPECIALS[kind]:
            if self.tokenizer.token_to_id(token) is not None:
                return self.tokenizer.token_to_id(token)
        return None

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return self.encode_batch([text], bos, eos)[0]

    def encode_batch(self, texts: Sequence[str], bos: bool = True, eos: bool = False) -> list[list[int]]:
        """`encode` of each text, the tokenizer's threads working on all of them at once. Texts are
        encoded without the post-processor's specials and BOS/EOS added here, so a post-processor
        that adds its own BOS (Llama-3's does) can never double it; with no known BOS id the
        post-processor's own choice stands."""
        specials = bos and self.bos_id is None
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        encoded = self.tokenizer.encode_batch(list(texts), add_special_tokens=specials)
        return [head + e.ids + tail for e in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(directory: str | Path | None) -> Tokenizer:
    """The tokenizer saved in `directory` (a Hugging Face model or a weft run directory), else bytes."""
    if directory is not None and (Path(directory) / "tokenizer.json").is_file():
        return HFTokenizer(directory)
    return ByteTokenizer()


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Copy a Hugging Face tokenizer's files into `directory`, its tokenizer_config.json naming the
    begin/end tokens in use (they may have come from a config.json that is not copied), so that
    `load_tokenizer(directory)` gives the same ids. The byte tokenizer needs no files."""
    if not isinstance(tokenizer, HFTokenizer):
        return
    out = Path(directory)
    if out.resolve() == tokenizer.directory.resolve():
        return
    out.mkdir(parents=True, exist_ok=True)
    for name in HF_TOKENIZER_FILES:
        if (tokenizer.directory / name).is_file():
            shutil.copyfile(tokenizer.directory / name, out / name)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    changed = False
    for kind, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
        token = tokenizer.tokenizer.id_to_token(token_id) if token_id is not None else None
        named = config.get(f"{kind}_token")
        named = named.get("content") if isinstance(named, dict) else named
        if token is not None and named != token:
            config[f"{kind}_token"] = token
            changed = True
    if changed:
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
