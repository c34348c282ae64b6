"""Tokenizers: bytes, a Hugging Face tokenizer.json (BOS never doubled, begin/end ids found where Hugging
Face directories keep them), loading by directory and saving for a run directory."""

import json
from pathlib import Path

import pytest

from model.generation_config import stop_ids
from model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, save_tokenizer

TEXT = "naïve café ✓ — def f(x): return x"


def test_byte_tokenizer_round_trip_and_specials() -> None:
    tokenizer = ByteTokenizer()
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (256, 257, 258)
    ids = tokenizer.encode(TEXT, bos=True, eos=True)
    assert ids[0] == 256 and ids[-1] == 257 and ids[1:-1] == list(TEXT.encode("utf-8"))
    assert tokenizer.encode("ab", bos=False) == [97, 98]
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode([104, 105, 0xFF]) == "hi\ufffd"  # invalid UTF-8 replaced, not raised
    assert tokenizer.encode_batch(["a", "b"], eos=True) == [[256, 97, 257], [256, 98, 257]]


def write_hf_tokenizer(directory: Path, config: dict | None = None) -> Path:
    """A small byte-level BPE with Llama-3's special tokens and a post-processor that adds BOS, as
    Llama-3's tokenizer.json has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TEXT * 3, "the quick brown fox jumps over the lazy dog " * 5], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_hf_tokenizer_adds_bos_once(tmp_path: Path) -> None:
    tokenizer = HFTokenizer(write_hf_tokenizer(tmp_path))
    # No config names the specials: found by Llama-3's names.
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1) and 256 + 3 < tokenizer.vocab_size <= 400
    ids = tokenizer.encode(TEXT)
    assert ids[0] == 0 and ids.count(0) == 1
    assert tokenizer.encode(TEXT, bos=False) == ids[1:]
    assert tokenizer.encode(TEXT, eos=True) == [*ids, 1]
    assert tokenizer.decode(tokenizer.encode(TEXT, eos=True)) == TEXT
    assert tokenizer.encode_batch([TEXT, "fox"], eos=True) == [
        tokenizer.encode(TEXT, eos=True),
        tokenizer.encode("fox", eos=True),
    ]


def test_hf_tokenizer_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    directory = write_hf_tokenizer(tmp_path, {**config, "tokenizer_class": "PreTrainedTokenizerFast"})
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    assert HFTokenizer(directory).encode(TEXT) == reference(TEXT)["input_ids"]


def test_hf_special_ids_from_config_files(tmp_path: Path) -> None:
    # tokenizer_config.json names an instruct model's end token (as a dict, as some files do).
    tokenizer = HFTokenizer(write_hf_tokenizer(tmp_path / "a", {"eos_token": {"content": "<|eot_id|>"}}))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 2)
    # config.json ids (a list of end ids keeps the first).
    directory = write_hf_tokenizer(tmp_path / "b")
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 1]}))
    tokenizer = HFTokenizer(directory)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)

    # Saved into a run directory without config.json: the same ids come back.
    save_tokenizer(tokenizer, tmp_path / "run")
    assert not (tmp_path / "run" / "config.json").exists()
    reloaded = load_tokenizer(tmp_path / "run")
    assert isinstance(reloaded, HFTokenizer)
    assert (reloaded.bos_id, reloaded.eos_id) == (1, 2)
    assert reloaded.encode(TEXT) == tokenizer.encode(TEXT)
    # ... and every end id config.json lists still ends a completion (the run's generation_config.json).
    assert stop_ids(tmp_path / "run", reloaded) == stop_ids(directory, tokenizer) == [2, 1]


def test_load_tokenizer_picks_by_directory(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)  # no tokenizer.json
    assert isinstance(load_tokenizer(write_hf_tokenizer(tmp_path / "hf")), HFTokenizer)
    save_tokenizer(ByteTokenizer(), tmp_path / "bytes")
    assert isinstance(load_tokenizer(tmp_path / "bytes"), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        HFTokenizer(tmp_path / "missing")
