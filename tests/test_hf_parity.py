"""Parity with `transformers`: a random Llama (GQA, Llama-3.1 rope scaling, a shape no preset has)
loaded through the Hugging Face directory path gives the same logits and greedy tokens; weft's export
loads back into `transformers` with the same logits."""

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.args import ModelArgs, RopeScaling  # noqa: E402
from model.generate import generate  # noqa: E402
from model.hf import export_hf, load_hf_checkpoint  # noqa: E402
from model.llama import Llama  # noqa: E402
from model.loading import load_weights_into  # noqa: E402

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
    model = weft_from_dir(tmp_path)
    tokens = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4

    prompt = tokens[:1, :8]
    new = generate(model, prompt, max_new_tokens=32, cuda_graph=False)
    expected = reference.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)[:, 8:]
    assert torch.equal(new, expected)


@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers(tmp_path: Path, tie: bool) -> None:
    args = ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=120,
        ffn_hidden=160,
        tie_embeddings=tie,
        rope_scaling=RopeScaling(original_max_position=32),
        max_seq_len=128,
    )
    model = Llama(args)
    model.init_weights()
    export_hf(model, args, tmp_path / "hf", dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
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
