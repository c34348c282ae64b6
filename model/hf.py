"""Hugging Face Llama directories: read (config.json, model.safetensors or a sharded index) into
weft's names and rotary layout, and write a directory that `transformers` loads. No `transformers`
import: only JSON and safetensors.

Hugging Face stores each q/k projection with the rows of a head reordered for its rotate-half rotary
embedding (first all even features, then all odd ones); weft rotates interleaved pairs as Meta's code
does, so q/k rows are permuted back at load and forward at export.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from model.args import ModelArgs, RopeScaling, positive
from model.checkpoint import (
    CheckpointWriteError,
    LazyTensors,
    TensorSpec,
    state_mismatch,
    tensor_names,
    write_tensors,
)
from model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    generation_settings,
    read_json,
    save_tokenizer,
)

LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
TOP_NAMES = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}
# transformers' own default shard size.
MAX_SHARD_BYTES = 5 * 10**9


def is_hf_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face Llama directory; a config.json of another model is a ValueError
    (weft runs Llama models only), so that it is not reported as missing."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    cfg = read_json(config)
    architectures = cfg.get("architectures") or []
    if cfg.get("model_type") == "llama" or "LlamaForCausalLM" in architectures:
        return True
    raise ValueError(
        f"{config} describes a model of type {cfg.get('model_type')!r} "
        f"({', '.join(map(str, architectures))}): weft runs Llama models (model_type llama, LlamaForCausalLM)"
    )


def _positive_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value > 0


def _positive_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and positive(value)


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """weft's ModelArgs for a Hugging Face Llama config.json (transformers 4's rope_theta/rope_scaling
    or transformers 5's rope_parameters); a config weft cannot run exactly fails with the reason."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    absent = [key for key in required if key not in cfg]
    if absent:
        raise ValueError(f"config.json lacks {', '.join(absent)}: is this a Llama config?")

    # A hand-edited value of the wrong type would otherwise fail deep inside the model's construction.
    def wrong(key: str, what: str) -> ValueError:
        return ValueError(f"config.json's {key}={cfg[key]!r} must be {what}: repair config.json")

    for key in sorted({*required, "num_key_value_heads", "max_position_embeddings"} & cfg.keys()):
        value = cfg[key]
        if key == "num_key_value_heads" and value is None:
            continue
        if not _positive_int(value):
            raise wrong(key, "a positive integer")
    for key in ("rms_norm_eps", "rope_theta"):
        if not _positive_number(cfg.get(key, 1.0)):
            raise wrong(key, "a finite number > 0")
    if not isinstance(cfg.get("tie_word_embeddings", False), bool):
        raise wrong("tie_word_embeddings", "true or false")
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(cfg.get(key), dict | None):
            raise wrong(key, "an object or null")
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads or dim % heads or (dim // heads) % 2:
        raise ValueError(
            f"config.json's num_attention_heads={heads}, num_key_value_heads={kv_heads} and "
            f"hidden_size={dim} do not make a Llama (heads a multiple of kv heads, hidden size a multiple "
            "of heads, an even head size for rotary embeddings): repair config.json"
        )
    if cfg.get("head_dim") not in (None, dim // heads):
        raise ValueError(
            f"head_dim {cfg['head_dim']} != hidden_size / num_attention_heads = {dim // heads}: "
            "weft cannot run this model"
        )
    unsupported = [
        f"{key}={cfg[key]}"
        for key, fine in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu"))
        if cfg.get(key, fine) != fine
    ]
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)} in config.json: weft's Llama has no biases and uses SiLU")
    # transformers 4 writes rope_theta and rope_scaling; transformers 5 one rope_parameters dict.
    raw = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"

    def rope_value(key: str, what: str, valid: bool) -> None:
        if not valid:
            raise ValueError(
                f"config.json's {rope_key}.{key}={raw[key]!r} must be {what}: repair config.json"
            )

    if "rope_theta" not in cfg and "rope_theta" in raw:
        rope_value("rope_theta", "a finite number > 0", _positive_number(raw["rope_theta"]))
    theta = cfg.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = None
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "llama3":
        needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in needed if key not in raw]
        if missing:
            raise ValueError(
                f"config.json's llama3 rope scaling lacks {', '.join(missing)}: repair config.json"
            )
        for key in needed[:3]:
            rope_value(key, "a finite number > 0", _positive_number(raw[key]))
        high = raw["high_freq_factor"]
        rope_value("low_freq_factor", f"below high_freq_factor={high!r}", raw["low_freq_factor"] < high)
        original = raw["original_max_position_embeddings"]
        rope_value("original_max_position_embeddings", "a positive integer", _positive_int(original))
        scaling = RopeScaling(
            factor=raw["factor"],
            low_freq_factor=raw["low_freq_factor"],
            high_freq_factor=raw["high_freq_factor"],
            original_max_position=raw["original_max_position_embeddings"],
        )
    elif kind != "default":
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported: weft knows plain RoPE and llama3 scaling"
        )
    # Keys a config.json may leave out take transformers' LlamaConfig defaults, which it would run with.
    return ModelArgs(
        name="hf",
        dim=dim,
        n_layers=cfg["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=kv_heads,
        vocab_size=cfg["vocab_size"],
        ffn_hidden=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
    )


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors a weft checkpoint of `args` holds (a tied output omitted)."""
    from model.llama import Llama

    with torch.device("meta"):
        model = Llama(args)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if args.tie_embeddings:
        shapes.pop("output.weight")
    return shapes


def check_state(shapes: dict[str, tuple[int, ...]], args: ModelArgs, problem: str, remedy: str) -> None:
    """One-line ValueError naming the first missing, unexpected or mis-shaped tensors of a state (its
    names and shapes)."""
    details = state_mismatch(expected_shapes(args), shapes)
    if details is not None:
        raise ValueError(f"{problem} ({details}): {remedy}")


def rotate_half_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from [evens..., odds...] (HF) to [e0, o0, e1, o1, ...] (weft)."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def interleaved_to_rotate_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: model.safetensors, else those its index lists.
    transformers looks in that order, and `save_pretrained` into a directory that held the other form
    leaves it behind: both then run the same weights."""
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        names = ["model.safetensors"]
    elif index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map: download the checkpoint again")
        names = sorted(set(map(str, weight_map.values())))
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    for name in names:
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"{path / name}, listed in the index, is missing: re-download the checkpoint"
            )
    return [path / name for name in names]


def open_hf_checkpoint(path: str | Path) -> tuple[ModelArgs, LazyTensors]:
    """(model args, the weights under weft's names, read tensor by tensor) of a Hugging Face Llama
    directory: q/k rows are put back in weft's interleaved rotary order as they are read, and every
    tensor's name and shape is checked against the config before any is read."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: give a Hugging Face model directory")
    args = args_from_hf_config(read_json(path / "config.json"))
    sources, unknown = {}, []
    for file in safetensors_files(path):
        for name in tensor_names(file):
            if name.endswith("rotary_emb.inv_freq"):
                continue
            ours = weft_name(name)
            if ours is None:
                unknown.append(name)
            else:
                sources[ours] = (file, name)
    if unknown:
        raise ValueError(
            f"{path} holds tensors a Llama does not have ({', '.join(sorted(unknown)[:4])}): "
            "is this a plain Llama checkpoint?"
        )
    if args.tie_embeddings and {"output.weight", "tok_embeddings.weight"} <= sources.keys():
        # Some tied checkpoints store lm_head anyway: a copy of the embedding is dropped. One that
        # differs, transformers 5 runs untied and transformers 4 tied: which was meant is unknown.
        pair = LazyTensors({name: sources[name] for name in ("output.weight", "tok_embeddings.weight")})
        if not torch.equal(pair.read("output.weight"), pair.read("tok_embeddings.weight")):
            raise ValueError(
                f"{path}'s config.json sets tie_word_embeddings, but its lm_head.weight differs from "
                "model.embed_tokens.weight: set tie_word_embeddings to false in config.json to run "
                "lm_head.weight (as transformers 5 does), or delete lm_head.weight to run the embedding"
            )
    if args.tie_embeddings and "tok_embeddings.weight" not in sources and "output.weight" in sources:
        # A tied checkpoint may store the shared matrix under lm_head.weight alone (transformers runs it).
        sources["tok_embeddings.weight"] = sources["output.weight"]
    if args.tie_embeddings:
        sources.pop("output.weight", None)
    transforms = {}
    for i in range(args.n_layers):
        transforms[f"layers.{i}.attention.wq.weight"] = lambda w: rotate_half_to_interleaved(w, args.n_heads)
        transforms[f"layers.{i}.attention.wk.weight"] = lambda w: rotate_half_to_interleaved(
            w, args.n_kv_heads
        )
    weights = LazyTensors(sources, transforms)
    check_state(
        weights.shapes,
        args,
        f"{path} does not match its config.json",
        "the checkpoint is incomplete or not a Llama",
    )
    return args, weights


def load_hf_checkpoint(path: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(model args, weft state dict) of a Hugging Face Llama directory (see open_hf_checkpoint)."""
    args, weights = open_hf_checkpoint(path)
    return args, weights.read_all()


def weft_name(hf_name: str) -> str | None:
    """weft's name for a Hugging Face Llama tensor name; None for a name a Llama does not have."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) >= 4 and parts[:2] == ["model", "layers"]:
        inner = ".".join(parts[3:])
        if inner in LAYER_NAMES:
            return f"layers.{parts[2]}.{LAYER_NAMES[inner]}.{suffix}"
    return None


def hf_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    for hf, ours in TOP_NAMES.items():
        if stem == ours:
            return f"{hf}.{suffix}"
    _, index, inner = stem.split(".", 2)
    hf_inner = next(hf for hf, ours in LAYER_NAMES.items() if ours == inner)
    return f"model.layers.{index}.{hf_inner}.{suffix}"


def hf_config(args: ModelArgs, dtype: torch.dtype, tokenizer: Tokenizer | None) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_hidden,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # transformers >= 4.56 reads `dtype`, older versions `torch_dtype`.
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if args.rope_scaling is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling.factor,
            "low_freq_factor": args.rope_scaling.low_freq_factor,
            "high_freq_factor": args.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": args.rope_scaling.original_max_position,
        }
    if tokenizer is not None:
        config["bos_token_id"], config["eos_token_id"] = tokenizer.bos_id, tokenizer.eos_id
    return config


class WeightStream(NamedTuple):
    """Weights that come one tensor at a time: the names and full shapes of the tensors `tensors` yields,
    in that order (a parallel model's, gathered in turn by parallel/checkpoint.export_parallel_hf)."""

    shapes: dict[str, tuple[int, ...]]
    tensors: Iterable[torch.Tensor]


def hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs, dtype: torch.dtype) -> torch.Tensor:
    """A weft tensor as a Hugging Face directory stores it: in `dtype` on the CPU, q/k rows in rotate-half
    order (cast before the permutation, whose copy is then in `dtype`)."""
    tensor = tensor.detach().to("cpu", dtype)
    if name.endswith("attention.wq.weight"):
        tensor = interleaved_to_rotate_half(tensor, args.n_heads)
    elif name.endswith("attention.wk.weight"):
        tensor = interleaved_to_rotate_half(tensor, args.n_kv_heads)
    return tensor.contiguous()


def _hf_tensors(weights: WeightStream, args: ModelArgs, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """hf_tensor of each tensor as it comes, the one before it no longer held when the next is asked for
    (from a parallel model: gathered)."""
    stream = iter(weights.tensors)
    for name in weights.shapes:
        tensor = next(stream, None)
        if tensor is None:
            raise ValueError(f"the weights to export end before {name}: give a tensor for each name")
        yield hf_tensor(name, tensor, args, dtype)
        del tensor


def _shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """The tensors in files of at most `max_bytes` each (a larger tensor alone in its own), in order."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def clear_killed_exports(out: Path) -> None:
    """One process exports into `out` at a time: what an export killed mid-way (SIGKILL, a scheduler's
    time limit) left beside it goes. Its temporary directory is removed; a previous export it had moved
    aside takes its name back if nothing has it, and is removed otherwise."""
    pattern = glob.escape(out.name)
    for tmp in out.parent.glob(f"{pattern}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for old in out.parent.glob(f"{pattern}.old-*"):
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, out)


def export_hf(
    weights: torch.nn.Module | Mapping[str, torch.Tensor] | WeightStream,
    args: ModelArgs,
    out_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write a weft model (its state dict, or a WeightStream) as a Hugging Face Llama directory that
    `transformers` loads: config.json, generation_config.json, safetensors (sharded with an index above
    `max_shard_bytes`) and the tokenizer's files (a tokenizer.json of the byte tokenizer, so that
    transformers encodes as weft does). The files are planned from the shapes and each tensor is
    converted and written as it comes: besides the weights given, the export holds one converted tensor
    at a time (from a WeightStream, one tensor and its converted copy in all). Atomic: written in a
    temporary directory, then renamed; an existing non-empty `out_dir` is refused unless `overwrite`,
    and a failed write (a full disk) raises CheckpointWriteError, leaving `out_dir` as it was."""
    out = Path(out_dir)
    clear_killed_exports(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out} exists and is not empty: choose another directory or pass overwrite=True"
        )
    if not isinstance(weights, WeightStream):
        state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
        names = [name for name in state if not (args.tie_embeddings and name == "output.weight")]
        # (A checkpoint's LazyTensors knows its shapes from the header: no tensor is read twice.)
        shapes = state.shapes if isinstance(state, LazyTensors) else {n: tuple(state[n].shape) for n in names}
        weights = WeightStream({n: tuple(shapes[n]) for n in names}, (state[n] for n in names))
    check_state(weights.shapes, args, "the weights to export do not fit `args`", "pass the model's own args")
    specs = [TensorSpec(hf_name(name), dtype, shape) for name, shape in weights.shapes.items()]
    shards = _shards(specs, max_shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    tensors = _hf_tensors(weights, args, dtype)

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        # The small files first: one that cannot be written (or a tokenizer's broken JSON) fails the
        # export before the weights' pass, which gathers a whole sharded model.
        config = hf_config(args, dtype, tokenizer)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if isinstance(tokenizer, HFTokenizer):
            save_tokenizer(tokenizer, tmp)
        elif isinstance(tokenizer, ByteTokenizer):
            tokenizer.write_hf_files(tmp)
        # The source's generation_config.json (its end ids and sampling defaults; read from the
        # tokenizer's own directory, so that an error names that file), or where it has none the ids of
        # its config.json, every end id of a list (`generation_settings`), win over the tokenizer's.
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        source = tokenizer.directory if isinstance(tokenizer, HFTokenizer) else tmp
        generation.update(generation_settings(source))
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        for file, shard in zip(files, shards, strict=True):
            # transformers refuses a safetensors file whose metadata names no framework.
            write_tensors(tmp / file, shard, itertools.islice(tensors, len(shard)), metadata={"format": "pt"})
        if len(shards) > 1:
            weight_map = {
                spec.name: file for file, shard in zip(files, shards, strict=True) for spec in shard
            }
            index = {"metadata": {"total_size": sum(spec.nbytes for spec in specs)}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        # Renames: the old export stays whole until the new one has its name.
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException as err:
        # A full disk or a quota: the partial files would hold space that the next export needs.
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)
        if isinstance(err, OSError):
            raise CheckpointWriteError(f"cannot export the model to {out}: {err}") from err
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out
