"""The plain model: shapes, KV-cache decoding against the full forward, rotary scaling, bad input."""

import math

import pytest
import torch

from model.args import ModelArgs, RopeScaling
from model.generate import generate, sample
from model.llama import Llama, apply_rope, rope_frequencies


def small_model(**overrides) -> Llama:
    args = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_hidden=96, max_seq_len=64
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_cached_decode_matches_full_forward(tie: bool) -> None:
    model = small_model(tie_embeddings=tie, rope_scaling=RopeScaling(original_max_position=16))
    tokens = torch.randint(0, 97, (3, 20))
    with torch.no_grad():
        full = model(tokens)
        model.setup_caches(3, 24)
        step_logits = [model(tokens[:, :11], torch.arange(11))[:, -1]]
        for pos in range(11, 20):
            step_logits.append(model(tokens[:, pos : pos + 1], torch.tensor([pos]))[:, -1])
    cached = torch.stack(step_logits[1:], dim=1)
    torch.testing.assert_close(cached, full[:, 11:20], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_logits[0], full[:, 10], rtol=1e-5, atol=1e-5)


def test_tied_embeddings_share_storage() -> None:
    model = small_model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight


def test_initial_loss_near_log_vocab() -> None:
    model = small_model()
    tokens = torch.randint(0, 97, (4, 32))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(loss.item() - math.log(97)) < 1.0


@pytest.mark.parametrize("tie", [False, True])
def test_init_draws_each_weight_at_its_scale(tie: bool) -> None:
    """init_plan: truncated normals of init_std, the residual writers (wo, w2) scaled down by
    sqrt(2 * n_layers), the untied embedding at 1 and output at dim**-0.5, norms at one."""
    model = small_model(dim=256, n_heads=8, ffn_hidden=512, n_layers=4, tie_embeddings=tie)
    std = model.args.init_std
    expected = {
        "wq": std,
        "wk": std,
        "wv": std,
        "w1": std,
        "w3": std,
        "wo": std / math.sqrt(8),
        "w2": std / math.sqrt(8),
    }
    expected["tok_embeddings"] = std if tie else 1.0
    if not tie:
        expected["output"] = 256**-0.5
    for name, param in model.named_parameters():
        kind = name.split(".")[-2]
        if "norm" in kind:
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        want = expected[kind]
        # Cut at 3 standard deviations, which leaves 0.987 of the normal's: within the 5%.
        assert abs(param.std().item() / want - 1) < 0.05, (name, param.std().item(), want)
        if kind != "tok_embeddings":
            assert param.abs().max().item() <= 3 * want, name


def test_rope_scaling_keeps_high_and_divides_low_frequencies() -> None:
    plain = rope_frequencies(128, 500000.0, None)
    scaled = rope_frequencies(128, 500000.0, RopeScaling())
    assert torch.equal(scaled[:4], plain[:4])  # short wavelengths untouched
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 8.0)  # long wavelengths divided by the factor


def test_rope_is_a_rotation_of_pairs() -> None:
    x = torch.randn(2, 5, 3, 8)
    angles = torch.rand(5, 4)
    rope = torch.stack([angles.cos(), angles.sin()], dim=-1)
    out = apply_rope(x, rope)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    back = apply_rope(out, torch.stack([angles.cos(), -angles.sin()], dim=-1))
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def test_generate_greedy_is_argmax_chain() -> None:
    model = small_model()
    prompt = torch.randint(0, 97, (2, 5))
    new = generate(model, prompt, max_new_tokens=6, cuda_graph=False)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(new, seq[:, 5:])


def test_sample_top_k_stays_in_top_k() -> None:
    logits = torch.randn(4, 50)
    top = torch.topk(logits, 3).indices
    for _ in range(20):
        token = sample(logits, temperature=1.0, top_k=3)
        assert all(token[i] in top[i] for i in range(4))


def test_bad_shapes_and_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="n_kv_heads"):
        Llama(ModelArgs(n_heads=8, n_kv_heads=3))
    model = small_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.setup_caches(1, 100)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, torch.tensor([[1, 2, 500]]), max_new_tokens=2, cuda_graph=False)
