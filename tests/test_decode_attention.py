"""The fused decode attention (kernels/decode_attention.py) against the stock path it replaces (rotary,
index_copy_ into the cache, SDPA with the position mask): fresh random inputs, ragged head groups,
positions at the start, inside a split and in the last cache slot, outputs and workspaces poisoned; the
cache it writes equals the reference's; its FP8 output dequantized tracks the reference quantized. A tiny
model fed the stock path's greedy tokens decodes alike on it (teacher-forced, as in
tests/test_bf16_decode.py). On CPU through Triton's interpreter (with small tiles and splits so that
several of each are walked), on a GPU natively, there also compiled and captured in a CUDA graph with
the position changing between replays."""

import itertools

import pytest
import torch

import model.llama as llama
import tests.test_bf16_decode as bf16_decode_tests
from kernels import decode_attention as da
from kernels.decode_attention import decode_attention, decode_attention_reference
from kernels.fp8 import dequantize
from model.args import ModelArgs
from model.fp8 import convert_to_fp8
from model.generate import generate, prefill
from model.llama import Llama
from tests.sm90 import MAX_SHARED_BYTES, compile_sm90, ptxas_log, run_without_interpreter, spill_stores

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# FP8 logits of the fused path against the stock one. Wherever the two attention outputs differ by a bf16
# ulp, the e4m3 value fed to wo may round to its neighbour (up to 1/16 of the value apart), and each
# layer passes that on: on the tiny random model 4 layers of it came to 3.2% (H200, compiled step),
# against ~100% for a wrong head, position or scale.
FP8_LOGITS_TOL = 5e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all(), "output holds NaN/inf: an element was not written"
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors the op allocates per call start as NaN (floats) or a large count (integers), so an output
    or partial result never written fails the test. (Its arrival counts live in a persistent
    workspace: test_second_call_finds_the_counts_rearmed.) torch.empty, empty_like and new_empty alike."""

    def poisoning(allocate):
        def poisoned_allocate(*args, **kwargs):
            tensor = allocate(*args, **kwargs)
            if tensor.dtype == torch.float8_e4m3fn:
                tensor.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
            elif tensor.is_floating_point():
                tensor.fill_(float("nan"))
            else:
                tensor.fill_(12345)
            return tensor

        return poisoned_allocate

    monkeypatch.setattr(torch, "empty", poisoning(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoning(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoning(torch.Tensor.new_empty))


def poison(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> None:
    """NaN into a captured call's outputs before a replay, so that one the replay misses fails."""
    values, scales = out if isinstance(out, tuple) else (out, None)
    if values.dtype == torch.float8_e4m3fn:
        values.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    else:
        values.fill_(float("nan"))
    if scales is not None:
        scales.fill_(float("nan"))


@pytest.fixture(params=["default", "small"])
def tiles(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch's own tile and split sizes, or small ones: at this test's cache lengths the latter
    give several splits of several tiles each (on CPU the SM count is 4)."""
    if request.param == "small":
        monkeypatch.setattr(da, "BLOCK_N", 16)
        monkeypatch.setattr(da, "MIN_POSITIONS_PER_SPLIT", 8)


def inputs(batch: int, n_heads: int, n_kv_heads: int, head_dim: int, cache_len: int, pos: int):
    """q, k, v as column slices of one fused qkv output, the rotary table, input_pos, and a cache
    already holding random keys and values at every position."""
    qkv = torch.randn(batch, 1, (n_heads + 2 * n_kv_heads) * head_dim, device=DEVICE).to(torch.bfloat16)
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    freqs = 1.0 / 500.0 ** (torch.arange(0, head_dim, 2, device=DEVICE) / head_dim)
    angles = torch.outer(torch.arange(cache_len + 5, device=DEVICE, dtype=torch.float32), freqs)
    rope = torch.stack([angles.cos(), angles.sin()], dim=-1)
    shape = (batch, n_kv_heads, cache_len, head_dim)
    k_cache = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
    v_cache = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
    return q, k, v, rope, torch.tensor([pos], device=DEVICE), k_cache, v_cache


def assert_cache_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:  # a compiled rotation may fuse a multiply-add: at most one bf16 rounding step apart
        torch.testing.assert_close(got, want)


SHAPES = [
    # batch, query heads, kv heads, head dim, cache length, position
    (1, 4, 1, 16, 40, 0),
    (1, 4, 1, 16, 40, 39),
    (3, 6, 3, 32, 100, 58),
    (3, 6, 3, 32, 100, 99),
    (1, 32, 8, 16, 70, 69),
    (3, 32, 8, 16, 70, 37),
]


def assert_matches_reference(shape: tuple[int, ...], fp8: bool) -> None:
    """decode_attention at `shape` (batch, query heads, kv heads, head dim, cache length, position) on
    fresh inputs: the cache it writes and its output against the stock path's."""
    q, k, v, rope, pos, k_cache, v_cache = inputs(*shape)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out = decode_attention(q, k, v, rope, pos, k_cache, v_cache, fp8=fp8)
    ref = decode_attention_reference(q, k, v, rope, pos, ref_k, ref_v, fp8=fp8)
    assert_cache_equal(k_cache, ref_k)
    assert_cache_equal(v_cache, ref_v)
    if not fp8:
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        assert rel_err(out, ref) < 1e-2
        return
    (values, scales), (ref_values, ref_scales) = out, ref
    assert values.shape == q.shape and values.dtype == torch.float8_e4m3fn and scales.shape == shape[:3:2]
    torch.testing.assert_close(scales, ref_scales, rtol=2e-2, atol=0)
    batch = shape[0]
    got = dequantize(values.view(batch, -1), scales)
    assert rel_err(got, dequantize(ref_values.view(batch, -1), ref_scales)) < 3e-2


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-h{}-kv{}-d{}-l{}-pos{}".format(*s))
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_matches_reference(poisoned: None, tiles: None, shape: tuple[int, ...], fp8: bool) -> None:
    assert_matches_reference(shape, fp8)


REPEATED = [
    # batch, query heads, kv heads, head dim, cache length, the two calls' positions
    (3, 6, 2, 16, 50, (49, 0)),
    (3, 12, 2, 32, 40, (0, 39)),
    (1, 3, 1, 16, 64, (63, 20)),
]


@pytest.mark.parametrize(
    "shape", REPEATED, ids=lambda s: "b{}-h{}-kv{}-d{}-l{}-pos{}-{}".format(*s[:5], *s[5])
)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_second_call_finds_the_counts_rearmed(
    poisoned: None, tiles: None, shape: tuple[int, ...], fp8: bool
) -> None:
    """Two calls in a row on the device's one arrival-count workspace (as CUDA-graph replays reuse one
    launch), at ragged head groups (3, 6) and several splits: the second is right only if the first
    left every count at zero (else no split of the second would see itself last, and its outputs would
    stay poisoned), and it leaves them at zero too."""
    *heads, positions = shape
    batch, n_heads, n_kv_heads, head_dim, cache_len = heads
    group = n_heads // n_kv_heads
    assert da.num_splits(batch, n_kv_heads, group, head_dim, cache_len, torch.device(DEVICE)) > 1
    counts = da.arrival_counters(torch.device(DEVICE), 0)
    for position in positions:
        assert_matches_reference((*heads, position), fp8)
    assert da.arrival_counters(torch.device(DEVICE), 0) is counts
    assert not counts.any()


def test_split_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch's split count depends on the shapes and SMs only (a power of two): about two programs
    per SM, no share of the full cache below MIN_POSITIONS_PER_SPLIT, and no more partial outputs
    than a combine program holds."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(da, "programs_cap", lambda device: 132)
    assert da.num_splits(1, 8, 4, 128, 4096, cpu) == 32  # Llama-3-8B: 33 wanted
    assert da.num_splits(1, 8, 8, 128, 32768, cpu) == 16  # Llama-3-70B: the combine's registers
    assert da.num_splits(8, 8, 4, 128, 4096, cpu) == 4
    assert da.num_splits(1, 8, 4, 128, 640, cpu) == 16  # 20 shares of 32 positions
    assert da.num_splits(64, 8, 4, 128, 32768, cpu) == 1
    assert da.num_splits(1, 1, 4, 128, 4096, cpu) == 32  # a tensor-parallel shard with one kv head
    assert da.num_splits(1, 1, 2, 64, 8192, cpu) == da.MAX_SPLITS


def test_a_group_too_large_to_split_runs_unsplit(poisoned: None) -> None:
    """80 query heads a kv head at head dim 256: a group x head dim past what the combining program
    holds (COMBINE_ELEMENTS) runs as one split, not a failed shift by -1."""
    assert da.max_splits(80, 256) == da.max_splits(256, 128) == 1
    assert_matches_reference((1, 80, 1, 256, 16, 7), fp8=False)


@pytest.mark.parametrize("shape", [(1, 4, 1, 16, 40), (3, 6, 3, 32, 100)], ids=["split", "unsplit"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_position_outside_the_cache_gives_nan(
    monkeypatch: pytest.MonkeyPatch, tiles: None, shape: tuple[int, ...], fp8: bool
) -> None:
    """input_pos lives on the device, unchecked on the host: a position past the cache's end or below
    0 (where the stock path raises an IndexError) writes no cache row, reads no rotary row past a table
    of exactly the cache's length, and gives an all-NaN output (and FP8 scales), not a plausible one.
    The op's allocations start zeroed, so the NaN is the kernel's."""
    for allocate in ("empty", "empty_like"):
        real = getattr(torch, allocate)
        monkeypatch.setattr(torch, allocate, lambda *args, real=real, **kwargs: real(*args, **kwargs).zero_())
    cache_len = shape[-1]
    for pos in (cache_len, -1):
        q, k, v, rope, input_pos, k_cache, v_cache = inputs(*shape, pos)
        rope = rope[:cache_len].contiguous()
        k_before, v_before = k_cache.clone(), v_cache.clone()
        out = decode_attention(q, k, v, rope, input_pos, k_cache, v_cache, fp8=fp8)
        values, scales = out if fp8 else (out, None)
        if fp8:
            assert scales.isnan().all(), f"position {pos}"
            assert (values.view(torch.uint8) & 0x7F == 0x7F).all(), f"position {pos}"  # e4m3 NaN
        else:
            assert values.isnan().all(), f"position {pos}"
        assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before), f"position {pos}"
        with pytest.raises(IndexError):
            decode_attention_reference(q, k, v, rope, input_pos, k_cache, v_cache, fp8=fp8)


def test_caches_of_two_dtypes_are_refused() -> None:
    q, k, v, rope, pos, k_cache, v_cache = inputs(2, 4, 2, 16, 8, 3)
    for fn in (decode_attention, decode_attention_reference):
        with pytest.raises(ValueError, match="k_cache and v_cache must share a dtype"):
            fn(q, k, v, rope, pos, k_cache, v_cache.half())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_no_sequences_give_empty_outputs(fp8: bool) -> None:
    """Batch 0 returns empty outputs (and scales) instead of dividing the cache among no programs."""
    q, k, v, rope, pos, k_cache, v_cache = inputs(0, 4, 2, 16, 8, 3)
    out = decode_attention(q, k, v, rope, pos, k_cache, v_cache, fp8=fp8)
    values, scales = out if fp8 else (out, None)
    assert values.shape == (0, 1, 64)
    assert scales is None or scales.shape == (0, 2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head_dim": 24}, "power of two >= 16"),
        ({"head_dim": 8}, "power of two >= 16"),
        ({"n_heads": 5, "n_kv_heads": 2}, "multiple of key/value heads"),
        ({"seqlen": 2}, "one new token per sequence"),
        ({"positions": 2}, "one int64 position"),
        ({"pos_device": "meta"}, "input_pos must be on k_cache's device cpu, got meta"),
        ({"rope_len": 6}, "the model's whole rotary table"),
    ],
)
def test_bad_shapes_are_refused_clearly(change: dict[str, int | str], message: str) -> None:
    head_dim, n_heads, n_kv_heads = (
        change.get("head_dim", 16),
        change.get("n_heads", 4),
        change.get("n_kv_heads", 2),
    )
    seqlen, batch, cache_len = change.get("seqlen", 1), 2, 8
    q = torch.zeros(batch, seqlen, n_heads * head_dim, dtype=torch.bfloat16)
    k = torch.zeros(batch, 1, n_kv_heads * head_dim, dtype=torch.bfloat16)
    rope = torch.zeros(change.get("rope_len", cache_len), head_dim // 2, 2)
    pos = torch.zeros(change.get("positions", 1), dtype=torch.long, device=change.get("pos_device", "cpu"))
    cache = torch.zeros(batch, n_kv_heads, cache_len, head_dim, dtype=torch.bfloat16)
    for fn in (decode_attention, decode_attention_reference):
        with pytest.raises(ValueError, match=message):
            fn(q, k, k.clone(), rope, pos, cache, cache.clone())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_meta_input_is_refused(fp8: bool) -> None:
    """A meta tensor among the inputs sends the op to its fake implementation, which would return empty
    tensors on the other inputs' device (garbage, the cache not written): it runs the op's checks, so
    each input on the meta device is named. All on meta (shapes only) stays a fake call."""
    real = inputs(2, 4, 2, 16, 8, 3)
    device = real[0].device  # cuda:0, not cuda
    names = ["q", "k", "v", "rope", "input_pos", "k_cache", "v_cache"]
    for i, name in enumerate(names):
        args = [t.to("meta") if j == i else t for j, t in enumerate(real)]
        if name == "k_cache":
            message = "v_cache, q, k, v, rope, input_pos must be on k_cache's device meta"
        else:
            message = f"{name} must be on k_cache's device {device}, got meta"
        with pytest.raises(ValueError, match=message):
            decode_attention(*args, fp8=fp8)
    out = decode_attention(*[t.to("meta") for t in real], fp8=fp8)
    values = out[0] if fp8 else out
    assert values.device.type == "meta" and values.shape == real[0].shape


def tiny_model(n_heads: int = 4, n_kv_heads: int = 2, decode_kernels: bool = True) -> Llama:
    args = ModelArgs(
        dim=128,
        n_layers=2,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=160,
        ffn_hidden=200,
        max_seq_len=64,
        decode_kernels=decode_kernels,
    )
    model = Llama(args).to(DEVICE)
    model.init_weights()
    return model.to(torch.bfloat16).eval()


def count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = []
    real = da.decode_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(da, "decode_attention", counted)  # model.llama imports it at each decode step
    return calls


def use_fused_decode(model: Llama, on: bool) -> None:
    for layer in model.layers:
        layer.attention.fused_decode = on


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_model_decodes_the_stock_tokens(monkeypatch: pytest.MonkeyPatch, fp8: bool) -> None:
    """A tiny model's greedy tokens on the stock path, teacher-forced into the same model on the fused op
    (tests/test_bf16_decode.py says why not free-running): logits alike at every step, the same token at
    every clear step, the fused op called at every decode step of every layer."""
    model = bf16_decode_tests.tiny_model()
    if fp8:
        model.args.fp8 = True
        convert_to_fp8(model)
    prompt = torch.randint(0, 160, (3, 7), device=DEVICE)
    steps = 6 if fp8 else 12  # the FP8 model's other kernels are slow in the interpreter
    use_fused_decode(model, False)
    tokens = generate(model, prompt, steps, cuda_graph=False)
    stock = bf16_decode_tests.forced_logits(model, prompt, tokens, cuda_graph=False)
    use_fused_decode(model, True)
    calls = count_fused_calls(monkeypatch)
    fused = bf16_decode_tests.forced_logits(model, prompt, tokens, cuda_graph=False)
    assert len(calls) == (steps - 1) * len(model.layers)
    bf16_decode_tests.assert_decodes_alike(fused, stock, tol=FP8_LOGITS_TOL if fp8 else 1e-2)


@pytest.mark.parametrize("why", ["attention_fn replaced", "decode_kernels=false"])
def test_stock_path_where_asked(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """parallel/ may swap attention_fn (Ulysses), and model.decode_kernels=false asks for the stock
    modules: either way the model does not take the fused op."""
    if why == "attention_fn replaced":
        model = tiny_model()
        for layer in model.layers:
            layer.attention.attention_fn = lambda q, k, v, mask: llama.sdpa_attention(q, k, v, mask)
    else:
        model = tiny_model(decode_kernels=False)
    calls = count_fused_calls(monkeypatch)
    generate(model, torch.randint(0, 160, (1, 5), device=DEVICE), 3, cuda_graph=False)
    assert calls == []


def test_compiled_step_updates_the_cache_in_place() -> None:
    """torch.compile(fullgraph=True), as serve's decode step runs: the op is traced once per layer and
    called on the cache buffers themselves (a functionalized copy of each layer's cache per step
    would cost more than the attention), and the compiled step gives the eager step's logits."""
    from torch._inductor.utils import run_and_get_code

    from model.generate import register_weft_ops_with_inductor

    model = tiny_model()
    model.setup_caches(1, 40)
    prefill(model, torch.randint(0, 160, (1, 5), device=DEVICE))
    caches = [
        (layer.attention.kv_cache.k.clone(), layer.attention.kv_cache.v.clone()) for layer in model.layers
    ]
    token, pos = torch.randint(0, 160, (1, 1), device=DEVICE), torch.tensor([5], device=DEVICE)
    with torch.no_grad():
        eager = model(token, pos).float()
        for layer, (k, v) in zip(model.layers, caches, strict=True):
            layer.attention.kv_cache.k.copy_(k)
            layer.attention.kv_cache.v.copy_(v)
        register_weft_ops_with_inductor()
        compiled, code = run_and_get_code(torch.compile(model, dynamic=False, fullgraph=True), token, pos)
    code = "\n".join(code)
    assert code.count("torch.ops.weft.decode_attention.default(") == len(model.layers)
    assert "clone" not in code and "copy_(" not in code
    assert rel_err(compiled, eager) < 1e-2
    for layer, (k, v) in zip(model.layers, caches, strict=True):  # position 5, written by the compiled step
        assert not torch.equal(layer.attention.kv_cache.k[:, :, 5], k[:, :, 5])
        assert not torch.equal(layer.attention.kv_cache.v[:, :, 5], v[:, :, 5])


def check_sm90_ptx() -> None:
    """The kernel compiles for sm_90 at the served head shapes without register spills, the combine and
    the FP8 quantize included, waiting on the previous kernel (PDL); the splits count arrivals with one
    acquire-release atomic (one split needs no count), FP8 output included. Both as a launch at the
    served shapes specializes it (16-byte aligned pointers and strides, cache length a multiple of 16)
    and without that; aligned, with the launch's pipeline stages, the loop over a split's later tiles
    runs on cp.async and two programs fit an SM's shared memory (SPLIT_PROGRAMS_PER_SM)."""
    pointers = ["q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"]
    signature = {name: "*bf16" for name in pointers}
    signature.update(
        {name: "*fp32" for name in ["rope_ptr", "o_part_ptr", "m_part_ptr", "l_part_ptr", "scale_ptr"]},
        pos_ptr="*i64",
        counter_ptr="*i32",
        qk_scale="fp32",
    )
    ints = ["n_kv_heads", "cache_len", "stride_q", "stride_k", "stride_v", "stride_rope"]
    signature.update(dict.fromkeys([*ints, "stride_cb", "stride_ch"], "i32"))
    # What a launch at the served shapes specializes as multiples of 16 (pointers: 16-byte aligned).
    served = [*pointers, "rope_ptr", "o_part_ptr", "out_ptr", "cache_len", "stride_q", "stride_k", "stride_v",
              "stride_rope", "stride_cb", "stride_ch"]  # fmt: skip
    # (query heads, kv heads, head dim): Llama-3-8B, Llama-3-70B, a small-head model, Llama-3-405B (16
    # query heads a kv head).
    for n_heads, n_kv_heads, head_dim in [(32, 8, 128), (64, 8, 128), (16, 8, 64), (128, 8, 128)]:
        group = n_heads // n_kv_heads
        for splits in (1, da.max_splits(group, head_dim)):
            stages = da.pipeline_stages(4096, splits)  # a cache long enough for several tiles a split
            for fp8, aligned in itertools.product((False, True), (False, True)):
                signature["out_ptr"] = "*fp8e4nv" if fp8 else "*bf16"
                constexprs = dict(
                    G=group, G_PAD=max(16, group), G_ROWS=group, D=head_dim, SPLITS=splits,
                    BLOCK=da.BLOCK_N, FP8_OUT=fp8, SNAP=False, PDL=True,
                )  # fmt: skip
                kernel = compile_sm90(
                    da._decode_attention_kernel, signature, constexprs, served if aligned else (),
                    num_warps=da.NUM_WARPS, num_stages=stages,
                )  # fmt: skip
                ptx = kernel.asm["ptx"]
                where = (n_heads, n_kv_heads, head_dim, splits, fp8, aligned)
                assert "griddepcontrol.wait" in ptx
                assert spill_stores(ptxas_log(ptx)) == 0, where
                atomics = int(splits > 1)
                assert ptx.count("atom.global.gpu.acq_rel.add") == atomics
                # Whatever another program wrote is read back from L2, not from a stale L1 line.
                assert ("ld.global.cg" in ptx) == (atomics > 0)
                if aligned:
                    assert ("cp.async" in ptx) == (stages > 1), where
                    assert da.SPLIT_PROGRAMS_PER_SM * kernel.metadata.shared <= MAX_SHARED_BYTES, where


def test_kernels_compile_for_sm90() -> None:
    run_without_interpreter("tests.test_decode_attention")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_graph_replays_follow_the_position(fp8: bool) -> None:
    """Captured once, replayed at positions 0..L-1 with fresh q, k, v: each replay reads its position
    from the device, writes the cache there and attends over the positions up to it."""
    q, k, v, rope, pos, k_cache, v_cache = inputs(2, 32, 8, 128, 200, 0)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    decode_attention(q, k, v, rope, pos, k_cache, v_cache, fp8=fp8)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, rope, pos, k_cache, v_cache, fp8=fp8)
    k_cache.copy_(ref_k)
    v_cache.copy_(ref_v)
    for position in [0, 1, 63, 64, 150, 199]:
        for t in (q, k, v):
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        pos.fill_(position)
        poison(out)
        graph.replay()
        ref = decode_attention_reference(q, k, v, rope, pos, ref_k, ref_v, fp8=fp8)
        assert_cache_equal(k_cache, ref_k)
        assert_cache_equal(v_cache, ref_v)
        if fp8:
            got, want = dequantize(out[0].view(2, -1), out[1]), dequantize(ref[0].view(2, -1), ref[1])
            assert rel_err(got, want) < 3e-2
        else:
            assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
def test_arrival_counts_are_not_grown_inside_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arrival-count workspace is allocated outside CUDA-graph capture (a graph must not own
    memory that later calls rely on): a first call inside capture says to warm up first."""
    monkeypatch.setattr(da, "_COUNTERS", {})
    q, k, v, rope, pos, k_cache, v_cache = inputs(2, 32, 8, 128, 200, 10)
    ref = decode_attention_reference(q, k, v, rope, pos, k_cache.clone(), v_cache.clone())
    with pytest.raises(RuntimeError, match="warm-up"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        decode_attention(q, k, v, rope, pos, k_cache, v_cache)
    decode_attention(q, k, v, rope, pos, k_cache, v_cache)  # the warm-up call
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, rope, pos, k_cache, v_cache)
    poison(out)
    graph.replay()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compiled_cuda_graph_decode_tracks_the_stock_path(fp8: bool) -> None:
    """serve's decode step (torch.compile fullgraph + CUDA graph) traces the op: the stock path's greedy
    tokens over 24 steps, teacher-forced into it, decode alike (as test_model_decodes_the_stock_tokens)."""
    model = bf16_decode_tests.tiny_model()
    if fp8:
        model.args.fp8 = True
        convert_to_fp8(model)
    prompt = torch.randint(0, 160, (2, 9), device=DEVICE)
    use_fused_decode(model, False)
    tokens = generate(model, prompt, 24, cuda_graph=False)
    stock = bf16_decode_tests.forced_logits(model, prompt, tokens, cuda_graph=False)
    use_fused_decode(model, True)
    fused = bf16_decode_tests.forced_logits(model, prompt, tokens, cuda_graph=True, compile=True)
    bf16_decode_tests.assert_decodes_alike(fused, stock, tol=FP8_LOGITS_TOL if fp8 else 1e-2)
