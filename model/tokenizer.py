"""Tokenizers: UTF-8 bytes for the built-in default, and `tokenizer.json` (through the `tokenizers`
library) for Hugging Face checkpoints. Both expose encode / encode_batch / encode_prompt / decode /
vocab_size / bos_id / eos_id: `encode_batch` (`encode`, one text) builds training documents,
`encode_prompt` the ids transformers' tokenizer gives a prompt."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

# What a run directory keeps of a Hugging Face model besides its weights: the tokenizer, its chat
# template (chat_template.jinja, else inside tokenizer_config.json) and the generation defaults.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
# Where a Hugging Face directory may name its begin/end tokens, in the order they are consulted.
CONFIG_FILES = ("tokenizer_config.json", "config.json", "generation_config.json", "special_tokens_map.json")
# Begin/end tokens looked up by name when no file names them.
KNOWN_SPECIALS = {"bos": ("<|begin_of_text|>", "<s>", "<bos>"), "eos": ("<|end_of_text|>", "</s>", "<eos>")}
# The special tokens transformers names (`special_tokens_map`), which chat templates see by name.
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names of the byte tokenizer's begin/end ids in the tokenizer.json an export writes.
BYTE_SPECIALS = ("<|bos|>", "<|eos|>")


class ByteTokenizer:
    """Token ids 0..255 are the UTF-8 bytes; 256 and 257 mark the beginning and end of a text."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258
    byte_fallback_ids: frozenset[int] = frozenset()  # (its bytes decode as one UTF-8 text, see TextStream)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

    def encode_batch(self, texts: Sequence[str], bos: bool = True, eos: bool = False) -> list[list[int]]:
        return [self.encode(text, bos, eos) for text in texts]

    def encode_prompt(self, text: str, special_tokens: bool = True) -> list[int]:
        """A prompt's ids: BOS, then the bytes (the text alone without `special_tokens`)."""
        return self.encode(text, bos=special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def write_hf_files(self, directory: str | Path) -> None:
        """Write this tokenizer as a `tokenizer.json` and `tokenizer_config.json` that transformers'
        AutoTokenizer loads and that encode and decode exactly as this class does: one token per byte
        (GPT-2's byte-level alphabet, no merges), BOS put in front by the post-processor, and the
        special tokens' names in a text encoded as bytes (`split_special_tokens`)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

        tokenizer = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(byte_level_chars())}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        bos, eos = BYTE_SPECIALS
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)]
        )
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "split_special_tokens": True,
            "clean_up_tokenization_spaces": False,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def byte_level_chars() -> list[str]:
    """GPT-2's byte-level alphabet (the `tokenizers` ByteLevel pre-tokenizer's): the character that
    stands for each byte value, printable bytes for themselves, the others for 256, 257, ... in order."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def read_json(path: Path) -> dict:
    """A JSON object file's contents, {} where the file does not exist; a file that is no JSON object
    (cut short, hand-edited) is a ValueError naming it."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): repair it or download it again") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{path} holds a JSON {type(value).__name__}, not an object: repair it or download it again"
        )
    return value


def token_content(token: object) -> str | None:
    """A special token as tokenizer_config.json names it: a string, or an AddedToken's dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


class HFTokenizer:
    """A Hugging Face `tokenizer.json`. Begin/end ids come from tokenizer_config.json, config.json,
    generation_config.json or special_tokens_map.json (the first that names one the vocabulary has),
    else from the usual special tokens (Llama-3's <|begin_of_text|> / <|end_of_text|>, <s> / </s>).

    Prompts are encoded as transformers encodes them: through tokenizer.json's pipeline, with the
    specials its post-processor adds and no others, whatever `bos_token` a config names (checkpoints
    that transformers wrote keep `add_bos_token` and that post-processor in agreement). One known
    difference: transformers 5 rebuilds the pre-tokenizer of some model-specific classes (LlamaTokenizer
    among them) from its own code, so a tokenizer.json saved before version 5 with another pipeline
    (Llama-2's Prepend/Replace normalizer) can encode a text that starts with a space, or that follows a
    special token, differently there; transformers 4 and weft follow the file."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        file = self.directory / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist: a Hugging Face tokenizer needs tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as err:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{file} cannot be read ({err}): download the tokenizer files again") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        # SentencePiece-style byte fallback: tokens <0x00>..<0xFF> spell characters the vocabulary lacks.
        byte_fallback = read_json(file)["model"].get("byte_fallback", False)
        byte_ids = (self.tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)) if byte_fallback else ()
        self.byte_fallback_ids = frozenset(i for i in byte_ids if i is not None)
        self.bos_id = self._special_id("bos")
        self.eos_id = self._special_id("eos")
        config = read_json(self.directory / "tokenizer_config.json")
        specials_map = read_json(self.directory / "special_tokens_map.json")
        # The named special tokens as transformers' `special_tokens_map` holds them (tokenizer_config.json
        # first): chat templates refer to them as bos_token, eos_token, ...
        self.special_tokens: dict[str, str] = {}
        for name in NAMED_SPECIALS:
            content = token_content(config[name] if name in config else specials_map.get(name))
            if content is not None:
                self.special_tokens[name] = content
        # transformers matches special tokens written in a text unless the config says to split them.
        self.tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))

    def _special_id(self, kind: str) -> int | None:
        for name in CONFIG_FILES:
            config = read_json(self.directory / name)
            token = token_content(config.get(f"{kind}_token"))
            if token is not None and self.tokenizer.token_to_id(token) is not None:
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

    def encode_prompt(self, text: str, special_tokens: bool = True) -> list[int]:
        """`AutoTokenizer.from_pretrained(directory)(text, add_special_tokens=special_tokens)`'s ids."""
        return self.tokenizer.encode(text, add_special_tokens=special_tokens).ids

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


def generation_settings(directory: Path) -> dict:
    """A Hugging Face directory's generation_config.json, or, where it has none, the begin/end ids of its
    config.json: the generation config transformers derives from it (with every end id it lists)."""
    if (directory / "generation_config.json").is_file():
        return read_json(directory / "generation_config.json")
    config = read_json(directory / "config.json")
    return {key: config[key] for key in ("bos_token_id", "eos_token_id") if config.get(key) is not None}


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Copy a Hugging Face tokenizer's files into `directory`, its tokenizer_config.json naming the
    begin/end tokens in use (they may have come from a config.json that is not copied) and its
    generation_config.json the end ids (`generation_settings`), so that `load_tokenizer(directory)`
    gives the same ids and a completion stops where it did. The byte tokenizer needs no files."""
    if not isinstance(tokenizer, HFTokenizer):
        return
    out = Path(directory)
    if out.resolve() == tokenizer.directory.resolve():
        return
    out.mkdir(parents=True, exist_ok=True)
    for name in HF_TOKENIZER_FILES:
        if (tokenizer.directory / name).is_file():
            shutil.copyfile(tokenizer.directory / name, out / name)
    if not (out / "generation_config.json").is_file():
        settings = generation_settings(tokenizer.directory)
        if settings:
            (out / "generation_config.json").write_text(json.dumps(settings, indent=2))
    config_file = out / "tokenizer_config.json"
    config = read_json(config_file)
    changed = False
    for kind, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
        token = tokenizer.tokenizer.id_to_token(token_id) if token_id is not None else None
        named = token_content(config.get(f"{kind}_token"))
        if token is not None and named != token:
            config[f"{kind}_token"] = token
            changed = True
    if changed:
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))


class TextStream:
    """The text of a completion, piece by piece as its tokens arrive, such that the pieces joined are
    what decoding the whole sequence adds to the decoded prompt.

    Each piece is decoded together with a few tokens before it (a SentencePiece decoder drops the
    leading space of a text, so a token decoded alone may lose the space that precedes it). A piece is
    held back while it ends in an incomplete UTF-8 character (U+FFFD), in a byte-fallback token or in a
    token that decodes to nothing (a special token, skipped): the decoder turns a whole run of byte
    tokens into U+FFFDs when the run is not valid UTF-8, and skipped tokens do not end a run, so a byte
    may still change the text of the bytes before it. Costs a few tokens' decoding per token."""

    CONTEXT = 5  # tokens decoded in front of the new ones

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.prefix_start = max(0, len(self.ids) - self.CONTEXT)
        # Not inside the prompt's closing run of byte-fallback tokens: decoded from mid-character, the
        # run is invalid UTF-8 and all U+FFFDs, with whatever bytes of the completion continue it.
        while self.prefix_start > 0 and self.ids[self.prefix_start - 1] in tokenizer.byte_fallback_ids:
            self.prefix_start -= 1
        self.read_start = len(self.ids)

    def _pending(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_start : self.read_start])
        text = self.tokenizer.decode(self.ids[self.prefix_start :])
        return text[len(prefix) :]

    def push(self, token_id: int) -> str:
        """The text `token_id` completes ('' while it is held back)."""
        self.ids.append(token_id)
        if token_id in self.tokenizer.byte_fallback_ids or not self.tokenizer.decode([token_id]):
            return ""
        piece = self._pending()
        if not piece or piece.endswith("\ufffd"):
            return ""
        self.prefix_start, self.read_start = self.read_start, len(self.ids)
        return piece

    def flush(self) -> str:
        """What is still held back at the end of the completion."""
        piece = self._pending()
        self.prefix_start = self.read_start = len(self.ids)
        return piece
