"""Parity with `transformers`: a random Llama (GQA, Llama-3.1 rope scaling, a shape no preset has)
loaded through the Hugging Face directory path gives the same logits and greedy tokens; weft's export
loads back into `transformers` with the same logits; configs weft cannot run fail with the reason."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from model.args import ModelArgs, RopeScaling  # noqa: E402
from model.checkpoint import save_checkpoint  # noqa: E402
from model.generate import generate  # noqa: E402
from model.hf import args_from_hf_config, export_hf, is_hf_checkpoint, load_hf_checkpoint  # noqa: E402
from model.llama import Llama  # noqa: E402
from model.loading import load_weights_into, resolve_checkpoint  # noqa: E402
from model.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from tests.test_tokenizer import write_hf_tokenizer  # noqa: E402

HF_CONFIG = dict(
    hidden_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    intermediate_size=200,
    vocab_size=300,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def hf_model(**overrides) -> "transformers.LlamaForCausalLM":
    config = transformers.LlamaConfig(**{**HF_CONFIG, **overrides}, attn_implementation="eager")
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # default init leaves norms at 1: randomise them so a mix-up would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def weft_from_dir(path: Path) -> Llama:
    args, _ = load_hf_checkpoint(path)
    model = Llama(args)
    load_weights_into(model, path)
    return model.eval()


@pytest.mark.parametrize("shard", [False, True])
def test_hf_directory_matches_transformers(tmp_path: Path, shard: bool) -> None:
    reference = hf_model()
    reference.save_pretrained(
        tmp_path, safe_serialization=True, **({"max_shard_size": "100KB"} if shard else {})
    )
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard
    assert is_hf_checkpoint(tmp_path)
    model = weft_from_dir(tmp_path)
    tokens = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4

    prompt = tokens[:, :8]  # two rows decoded together through weft's KV cache
    new = generate(model, prompt, max_new_tokens=32, cuda_graph=False)
    expected = reference.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)[:, 8:]
    assert torch.equal(new, expected)


@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers(tmp_path: Path, tie: bool) -> None:
    """Settings away from the defaults (norm eps, every rope scaling field, theta, max_seq_len), so that
    a config.json that wrote a default in place of the model's value would show."""
    args = ModelArgs(
        name="hf",
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=120,
        ffn_hidden=160,
        norm_eps=1e-3,
        rope_theta=20000.0,
        tie_embeddings=tie,
        rope_scaling=RopeScaling(
            factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position=32
        ),
        max_seq_len=128,
    )
    model = Llama(args)
    model.init_weights()
    with torch.no_grad():  # at init, attention is near uniform and rotary positions barely show: sharpen it
        for layer in model.layers:
            layer.attention.wq.weight.mul_(10)
            layer.attention.wk.weight.mul_(10)
            layer.attention_norm.weight.uniform_(0.5, 1.5)
            layer.ffn_norm.weight.uniform_(0.5, 1.5)
    export_hf(model, args, tmp_path / "hf", dtype=torch.float32)
    assert load_hf_checkpoint(tmp_path / "hf")[0] == args
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
    assert reference.config.max_position_embeddings == args.max_seq_len
    tokens = torch.randint(0, 120, (2, 24))
    with torch.no_grad():
        diff = (model(tokens) - reference(tokens).logits).abs().max().item()
    assert diff <= 1e-4
    with pytest.raises(FileExistsError):
        export_hf(model, args, tmp_path / "hf")


def test_hf_directory_with_missing_tensor_fails_clearly(tmp_path: Path) -> None:
    hf_model().save_pretrained(tmp_path, safe_serialization=True)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing: layers\.1\.feed_forward\.w3\.weight"):
        weft_from_dir(tmp_path)


def test_tied_hf_model_matches_transformers(tmp_path: Path) -> None:
    reference = hf_model(tie_word_embeddings=True)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    model = weft_from_dir(tmp_path)
    assert model.args.tie_embeddings
    tokens = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert (model(tokens) - reference(tokens).logits).abs().max().item() <= 1e-4


def test_tied_hf_model_with_a_stored_lm_head(tmp_path: Path) -> None:
    """A tied checkpoint may store lm_head too: a copy of the embedding loads; one that differs (which
    transformers 5 runs untied, transformers 4 tied) is refused."""
    hf_model(tie_word_embeddings=True).save_pretrained(tmp_path, safe_serialization=True)
    file = tmp_path / "model.safetensors"
    state = load_file(str(file))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(file), metadata={"format": "pt"})
    assert weft_from_dir(tmp_path).args.tie_embeddings
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"])
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        weft_from_dir(tmp_path)
    # The shared matrix stored as lm_head.weight alone: transformers runs it, and so does weft.
    del state["model.embed_tokens.weight"]
    save_file(state, str(file), metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    model = weft_from_dir(tmp_path)
    assert torch.equal(model.tok_embeddings.weight, state["lm_head.weight"])
    tokens = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert (model(tokens) - reference.float().eval()(tokens).logits).abs().max().item() <= 1e-4


def test_a_directory_saved_twice_runs_the_file_transformers_runs(tmp_path: Path) -> None:
    """save_pretrained into a directory that held the other form leaves it behind: a stale index beside
    model.safetensors (or the reverse). transformers reads model.safetensors first; so does weft."""
    old, new = hf_model(), hf_model()
    with torch.no_grad():
        for param in new.parameters():
            param.add_(1.0)
    old.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    new.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    for path in tmp_path.glob("model-*.safetensors"):  # the index now names files that are gone
        path.unlink()
    tokens = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert (weft_from_dir(tmp_path)(tokens) - new(tokens).logits).abs().max().item() <= 1e-4


def test_config_without_optional_keys_runs_as_transformers_runs_it(tmp_path: Path) -> None:
    """Keys a config.json may leave out take LlamaConfig's defaults (rms_norm_eps 1e-6, not 1e-5)."""
    hf_model(rms_norm_eps=1e-6).save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    optional = ("rms_norm_eps", "rope_parameters", "max_position_embeddings", "tie_word_embeddings")
    for key in optional:
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    model = weft_from_dir(tmp_path)
    # max_position_embeddings does not change the logits: compared directly, as are the others.
    defaults = reference.config
    assert (model.args.norm_eps, model.args.max_seq_len, model.args.tie_embeddings) == (
        defaults.rms_norm_eps,
        defaults.max_position_embeddings,
        defaults.tie_word_embeddings,
    )
    tokens = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert (model(tokens) - reference.eval()(tokens).logits).abs().max().item() <= 1e-4


def test_sharded_export_of_a_state_dict_round_trips(tmp_path: Path) -> None:
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=120, ffn_hidden=160)
    model = Llama(args)
    model.init_weights()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = export_hf(state, args, tmp_path / "hf", dtype=torch.float32, max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # Back through weft's loader: the same tensors (q/k permuted there and back), the same shape.
    loaded_args, loaded = load_hf_checkpoint(out)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert (loaded_args.dim, loaded_args.n_kv_heads, loaded_args.rope_theta) == (64, 2, args.rope_theta)
    # And through transformers.
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = torch.randint(0, 120, (2, 16))
    with torch.no_grad():
        assert (model(tokens) - reference(tokens).logits).abs().max().item() <= 1e-4


def test_an_export_clears_what_a_killed_one_left(tmp_path: Path) -> None:
    """An export killed mid-way leaves hf.tmp-<pid> (and, between its two renames, the previous export
    as hf.old-<pid>) beside hf/: the next export removes them, and gives a previous export its name back
    where hf/ is missing."""
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=300, ffn_hidden=48)
    model = Llama(args)
    model.init_weights()
    (tmp_path / "hf.tmp-1").mkdir()
    (tmp_path / "hf.tmp-1" / "model.safetensors").write_bytes(b"partial")
    out = export_hf(model, args, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]

    os.replace(out, tmp_path / "hf.old-2")  # killed between the renames: hf/ missing
    (tmp_path / "hf.tmp-2").mkdir()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(model, args, out)  # the previous export has its name again, so hf/ is not empty
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (out / "config.json").is_file()

    shutil.copytree(out, tmp_path / "hf.old-3")  # killed after the renames: hf/ whole
    export_hf(model, args, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_writes_config_tokenizer_and_refuses_overwrite(tmp_path: Path) -> None:
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=400, ffn_hidden=48)
    model = Llama(args)
    model.init_weights()
    tokenizer = load_tokenizer(write_hf_tokenizer(tmp_path / "tok"))
    out = export_hf(model, args, tmp_path / "hf", tokenizer=tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["dtype"] == "bfloat16" and (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)
    assert load_tokenizer(out).encode("the fox") == tokenizer.encode("the fox")
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(model, args, out)
    export_hf(model, args, out, tokenizer=ByteTokenizer(), overwrite=True)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 257)
    # The byte tokenizer exported as a tokenizer.json: transformers encodes and decodes as weft does.
    reference = transformers.AutoTokenizer.from_pretrained(out)
    byte = ByteTokenizer()
    for text in ["naïve café ✓ — def f(x):\n\treturn x", " two  spaces . ,", "<|eos|> <|bos|> </s>", ""]:
        assert (
            reference(text)["input_ids"]
            == byte.encode_prompt(text)
            == load_tokenizer(out).encode_prompt(text)
        )
        assert reference.decode(byte.encode(text, eos=True), skip_special_tokens=True) == text
    broken = [104, 105, 0xFF, 0xE2, 0x9C, 65, 257]  # invalid and truncated UTF-8: replaced alike
    assert reference.decode(broken, skip_special_tokens=True) == byte.decode(broken)
    assert (reference.bos_token_id, reference.eos_token_id) == (256, 257)
    with pytest.raises(ValueError, match=r"missing: norm\.weight"):
        export_hf({k: v for k, v in model.state_dict().items() if k != "norm.weight"}, args, tmp_path / "x")


def test_export_keeps_every_end_id_of_a_source_without_generation_config(tmp_path: Path) -> None:
    """transformers derives a generation config from config.json's ids where a directory has no
    generation_config.json: the export writes those ids, every end id of a list kept."""
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=400, ffn_hidden=48)
    model = Llama(args)
    model.init_weights()
    source = write_hf_tokenizer(tmp_path / "tok")
    (source / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    reference = transformers.GenerationConfig.from_model_config(
        transformers.LlamaConfig(bos_token_id=0, eos_token_id=[1, 2])
    )
    out = export_hf(model, args, tmp_path / "hf", tokenizer=load_tokenizer(source))
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == reference.eos_token_id == [1, 2]


def test_config_variants_and_unsupported_configs() -> None:
    v4 = {**HF_CONFIG, "rope_scaling": {**HF_CONFIG["rope_scaling"], "type": "llama3"}}
    del v4["rope_scaling"]["rope_type"]
    v5 = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**HF_CONFIG["rope_scaling"], "rope_theta": 10000.0}
    args = args_from_hf_config(v4)
    assert args == args_from_hf_config(v5)
    assert args.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64
    )
    assert (args.name, args.dim, args.n_heads, args.n_kv_heads, args.max_seq_len) == ("hf", 96, 6, 2, 256)
    plain = args_from_hf_config({**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert plain.rope_scaling is None and plain.rope_theta == 5e5

    for change, reason in [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"head_dim": 32}, "head_dim 32 != hidden_size / num_attention_heads = 16"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act=gelu"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "llama3 rope scaling lacks low_freq_factor",
        ),
        (
            {"num_key_value_heads": 4},
            "num_attention_heads=6, num_key_value_heads=4 and hidden_size=96 do not",
        ),
    ]:
        with pytest.raises(ValueError, match=reason):
            args_from_hf_config({**HF_CONFIG, **change})
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        args_from_hf_config({k: v for k, v in HF_CONFIG.items() if k != "intermediate_size"})


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"intermediate_size": 200.0}, "intermediate_size=200.0 must be a positive integer"),
        ({"vocab_size": "300"}, "vocab_size='300' must be a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
        ({"max_position_embeddings": None}, "max_position_embeddings=None must be a positive integer"),
        ({"num_key_value_heads": True}, "num_key_value_heads=True must be a positive integer"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5' must be a finite number > 0"),
        ({"rope_theta": 0}, "rope_theta=0 must be a finite number > 0"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' must be true or false"),
        ({"rope_scaling": "llama3"}, "rope_scaling='llama3' must be an object or null"),
        (
            {"rope_scaling": {**HF_CONFIG["rope_scaling"], "factor": "8"}},
            r"rope_scaling\.factor='8' must be a finite number > 0",
        ),
        (
            {"rope_scaling": {**HF_CONFIG["rope_scaling"], "low_freq_factor": None}},
            r"rope_scaling\.low_freq_factor=None must be a finite number > 0",
        ),
        (
            {"rope_scaling": {**HF_CONFIG["rope_scaling"], "low_freq_factor": 4.0}},
            r"rope_scaling\.low_freq_factor=4\.0 must be below high_freq_factor=4\.0",
        ),
        (
            {"rope_scaling": {**HF_CONFIG["rope_scaling"], "original_max_position_embeddings": 64.5}},
            r"rope_scaling\.original_max_position_embeddings=64\.5 must be a positive integer",
        ),
        ({"hidden_size": 90, "num_attention_heads": 6}, "an even head size"),
    ],
)
def test_a_hand_edited_config_value_is_named(change: dict, reason: str) -> None:
    """A value of the wrong type or range in config.json gets one line naming the key, not a traceback
    from inside the model (nor a message naming model.* settings a checkpoint's user cannot change)."""
    with pytest.raises(ValueError, match=rf"config\.json's .*{reason}") as err:
        args_from_hf_config({**HF_CONFIG, **change})
    assert "model." not in str(err.value)


def test_a_hand_edited_rope_parameters_value_is_named() -> None:
    """transformers 5 keeps rope_theta inside rope_parameters: checked there too."""
    config = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    config["rope_parameters"] = {**HF_CONFIG["rope_scaling"], "rope_theta": "1e4"}
    with pytest.raises(
        ValueError, match=r"config\.json's rope_parameters\.rope_theta='1e4' must be a finite"
    ):
        args_from_hf_config(config)
    config["rope_parameters"]["rope_theta"] = 5e5
    assert args_from_hf_config(config).rope_theta == 5e5


def test_hf_directory_checks(tmp_path: Path) -> None:
    hf_model().save_pretrained(tmp_path / "hf", safe_serialization=True)
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(str(file))
    state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"][:8]
    state["model.vision_tower.weight"] = torch.zeros(1)
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"a Llama does not have \(model\.vision_tower\.weight\)"):
        load_hf_checkpoint(tmp_path / "hf")
    del state["model.vision_tower.weight"]
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"mis-shaped: layers\.0\.attention\.wq\.weight \(8, 96\)"):
        load_hf_checkpoint(tmp_path / "hf")
    weft_run = tmp_path / "run"
    save_checkpoint(weft_run, 1, Llama(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2)))
    assert not is_hf_checkpoint(weft_run / "checkpoints" / "step_00000001")
    assert not is_hf_checkpoint(tmp_path)


def test_broken_or_foreign_directories_are_named(tmp_path: Path) -> None:
    """A config.json of another model, JSON files cut short or of the wrong kind, a shard index
    without its map: each a one-line error naming the file, not a traceback or 'no config.json'."""
    hf = tmp_path / "hf"
    hf_model().save_pretrained(hf, safe_serialization=True)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "mistral", "architectures": None}))
    with pytest.raises(ValueError, match=r"type 'mistral' \(\): weft runs Llama models"):
        resolve_checkpoint(hf)
    (hf / "config.json").write_text(json.dumps([config]))
    with pytest.raises(ValueError, match=r"config\.json holds a JSON list, not an object"):
        resolve_checkpoint(hf)
    (hf / "config.json").write_text(json.dumps(config)[:-20])
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON \("):
        resolve_checkpoint(hf)
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "model.safetensors").rename(hf / "model-00001-of-00001.safetensors")  # the index is read
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"index\.json has no weight_map"):
        load_hf_checkpoint(hf)
    write_hf_tokenizer(hf)
    text = (hf / "tokenizer.json").read_text()
    (hf / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"tokenizer\.json cannot be read \(.*\): download the tokenizer"):
        load_tokenizer(hf)
