"""decode_floor's ablation rows: weft's structure with one class of ops on weft's kernels (no timing)."""

import pytest
import torch

from benchmarks.bench_bf16_gemm import preset_args
from benchmarks.decode_floor import STRUCTURES, WEFT_ROWS, WEFT_STRUCTURE, step_ops, weft_call
from kernels.fp8 import FP8
from model.args import ModelArgs
from model.llama import rope_table

CPU = torch.device("cpu")
LAYER = ["add+norm", "wqkv", "attention", "wo", "add+norm", "w13", "SwiGLU", "w2"]  # weft's, as served


def served_ops(layers: int) -> list[str]:
    """The op names of serve.py's step: the first block's norm has no residual to add."""
    return ["norm", *(LAYER * layers)[1:], "add+norm", "output"]


@pytest.mark.parametrize("fp8", [False, True])
def test_ablation_rows_swap_one_class_and_keep_the_rest(fp8: bool) -> None:
    """Each row runs exactly its class of ops on weft's kernels (Llama-3-8B: 32 * 4 + 1 GEMMs, 32
    attentions, 65 norms, 32 SwiGLUs) and keeps every other op the floor's stand-in, in order, with
    the step's 258 launches and bytes."""
    args = preset_args("llama3_8b")
    floor = step_ops(args, 1, 640, fp8, WEFT_STRUCTURE, CPU)
    assert not any(op.weft for op in floor)
    expected = {
        "weft's GEMMs": ["wqkv", "wo", "w13", "w2"] * 32 + ["output"],
        "weft's attention": ["attention"] * 32,
        "weft's norms": ["norm"] + ["add+norm"] * 64,
        "weft's SwiGLU": ["SwiGLU"] * 32,
        "all weft's kernels": served_ops(32),
    }
    for row, classes in WEFT_ROWS.items():
        ops = step_ops(args, 1, 640, fp8, WEFT_STRUCTURE, CPU, classes)
        assert [op.name for op in ops if op.weft] == expected[row], row
        assert [op for op in ops if not op.weft] == [op for op in floor if op.kind not in classes], row
        assert len(ops) == 258, row
        assert sum(op.reads for op in ops) == sum(op.reads for op in floor), row
    assert "attention combine" not in {op.name for op in floor}  # decode_attention is one launch


def test_ablation_rows_need_weft_structure() -> None:
    with pytest.raises(ValueError, match="weft's launch structure"):
        step_ops(preset_args("llama3_8b"), 1, 640, True, STRUCTURES[0], CPU, {"GEMM"})


@pytest.mark.parametrize("fp8", [False, True])
def test_weft_calls_run_each_op_as_the_decode_step_does(fp8: bool) -> None:
    """weft_call's kernels run (on a GPU, or through the interpreter on CPU: without a GPU only) on the
    model's shapes and return what the next op of the served step takes: bf16 rows, or for FP8 e4m3 rows
    with a scale per token (per token and kv head out of the attention)."""
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    args = ModelArgs(n_layers=1)  # dim 256, 8 heads of 32, 4 kv heads, ffn 768, vocab 264
    batch, cache_len = 2, 64
    ops = step_ops(args, batch, cache_len, fp8, WEFT_STRUCTURE, device, WEFT_ROWS["all weft's kernels"])
    assert [op.name for op in ops] == served_ops(1)
    # Each add+norm takes the split-K partials of the GEMM that runs before it in the step (the final
    # norm those of w2, as does each block's first norm after the first block).
    before = [
        next(o.name for o in reversed(ops[:i]) if o.kind == "GEMM") for i, op in enumerate(ops) if op.after
    ]
    assert before == [op.after for op in ops if op.after] == ["wo", "w2"]
    rope = rope_table(args, device)
    out = {op.name: weft_call(op, args, batch, cache_len, fp8, rope)() for op in ops}

    def check_activation(activation: object, width: int, scales_shape: tuple[int, ...] = (batch,)) -> None:
        values, scales = activation if fp8 else (activation, None)
        assert values.dtype == (FP8 if fp8 else torch.bfloat16)
        assert values.reshape(batch, -1).shape == (batch, width)
        assert torch.isfinite(values.float()).all()
        if fp8:
            assert scales.shape == scales_shape and (scales > 0).all()

    check_activation(out["norm"], args.dim)
    normed, residual = out["add+norm"]
    check_activation(normed, args.dim)
    assert residual.shape == (batch, args.dim) and residual.dtype == torch.bfloat16
    check_activation(out["attention"], args.n_heads * args.head_dim, (batch, args.n_kv_heads))
    check_activation(out["SwiGLU"], args.ffn_hidden)
    widths = {
        "wqkv": (args.n_heads + 2 * args.n_kv_heads) * args.head_dim,
        "wo": args.dim,
        "w13": 2 * args.ffn_hidden,
        "w2": args.dim,
        "output": args.vocab_size,
    }
    for name, width in widths.items():
        # wo and w2 leave their split-K partials to the norm after them, as served (model/decode.py).
        if name in ("wo", "w2"):
            assert out[name].shape[1:] == (batch, width) and out[name].dtype == torch.float32, name
        else:
            assert out[name].shape == (batch, width) and out[name].dtype == torch.bfloat16, name
        assert torch.isfinite(out[name].float()).all(), name
