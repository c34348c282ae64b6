"""What a checkpoint directory says about generating, read as transformers reads it: the token ids that
end a completion and the default sampling settings (config.json and generation_config.json)."""

from __future__ import annotations

from pathlib import Path

from model.generate import Sampling
from model.tokenizer import Tokenizer, read_json

# transformers' top_k when generation_config.json asks for sampling without naming one.
TRANSFORMERS_TOP_K = 50
# New tokens at most where neither serve.py's max_new_tokens nor generation_config.json's is set.
DEFAULT_MAX_NEW_TOKENS = 64
# generation_config.json settings by which transformers' generate would choose other tokens (or stop
# elsewhere) and that weft does not apply, with the value that leaves each off.
UNAPPLIED_SETTINGS = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_p": None,
    "typical_p": 1.0,
    "top_h": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "num_beams": 1,
    "penalty_alpha": None,
    "min_length": 0,
    "min_new_tokens": None,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "guidance_scale": 1.0,
    "watermarking_config": None,
    "stop_strings": None,
}


def stop_ids(directory: Path | None, tokenizer: Tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's end token and each `eos_token_id` (an id or a
    list, as Llama-3 Instruct's [128001, 128008, 128009]) of config.json and generation_config.json."""
    ids = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    for name in ("config.json", "generation_config.json"):
        value = read_json(directory / name).get("eos_token_id") if directory is not None else None
        ids += [i for i in (value if isinstance(value, list) else [value]) if isinstance(i, int)]
    return list(dict.fromkeys(ids))


def default_sampling(directory: Path | None) -> Sampling:
    """generation_config.json's sampling settings: greedy unless it sets do_sample, and then its
    temperature, top_k and top_p with transformers' defaults (1.0, 50, 1.0) for those it leaves out."""
    file = directory / "generation_config.json" if directory is not None else None
    config = read_json(file) if file is not None else {}
    if not config.get("do_sample"):
        return Sampling()
    for key, types, what in (
        ("temperature", int | float, "a number"),
        ("top_k", int, "a whole number"),
        ("top_p", int | float, "a number"),
    ):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise ValueError(f"{file} sets {key}={value!r}, not {what}: fix the file or give {key}=...")
    temperature, top_k, top_p = (config.get(key) for key in ("temperature", "top_k", "top_p"))
    return Sampling(
        temperature=1.0 if temperature is None else float(temperature),
        top_k=TRANSFORMERS_TOP_K if top_k is None else top_k,
        top_p=1.0 if top_p is None else float(top_p),
    )


def resolve_max_new_tokens(directory: Path | None, given: int | None) -> tuple[int, str]:
    """(New tokens at most, where the number came from): `given` ("max_new_tokens"), else
    generation_config.json's max_new_tokens (as transformers' generate takes it; the file), else
    DEFAULT_MAX_NEW_TOKENS ("the default"). Checked: ValueError naming the file."""
    if given is not None:
        return given, "max_new_tokens"
    file = directory / "generation_config.json" if directory is not None else None
    value = read_json(file).get("max_new_tokens") if file is not None else None
    if value is None:
        return DEFAULT_MAX_NEW_TOKENS, "the default"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{file} sets max_new_tokens={value!r}, not a whole number >= 1: fix the file or give "
            "max_new_tokens=N"
        )
    return value, str(file)


def unapplied_settings(directory: Path | None) -> list[str]:
    """generation_config.json's settings (`UNAPPLIED_SETTINGS`) that weft does not apply, as "key=value"."""
    config = read_json(directory / "generation_config.json") if directory is not None else {}
    return [
        f"{key}={config[key]}"
        for key, off in UNAPPLIED_SETTINGS.items()
        if config.get(key) not in (off, None, [])
    ]


def resolve_sampling(
    directory: Path | None, temperature: float | None, top_k: int | None, top_p: float | None
) -> Sampling:
    """The sampling settings of a completion: each one given (not None) replaces the checkpoint's
    default (`default_sampling`). Checked: ValueError naming the setting and where it came from."""
    defaults = default_sampling(directory)
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    sampling = Sampling(**{k: getattr(defaults, k) if v is None else v for k, v in given.items()})
    file = directory / "generation_config.json" if directory is not None else None
    sources = {
        k: f"from {file}" for k, v in given.items() if v is None and file is not None and file.is_file()
    }
    sampling.validate(sources)
    # As transformers warns: top_k and top_p narrow a draw, and greedy decoding draws nothing.
    narrowing = [f"{k}={v}" for k, v in (("top_k", top_k), ("top_p", top_p)) if v not in (None, 0, 1, 1.0)]
    if sampling.temperature == 0 and narrowing:
        where = f" {sources['temperature']}" if "temperature" in sources else ""
        raise ValueError(
            f"{' and '.join(narrowing)} narrow sampling, but the temperature is 0{where} (greedy): "
            "set temperature > 0 too"
        )
    return sampling
