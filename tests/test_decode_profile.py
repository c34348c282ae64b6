"""benchmarks/decode_profile.py on a CPU: kernel names into op classes, and kernel events into the
per-step breakdown rows (the profiling itself needs a GPU)."""

import re
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.decode_profile import OTHER, KernelEvent, breakdown, busy_us, classify, largest_other, main

KERNELS = Path(__file__).resolve().parent.parent / "kernels"

# Kernel names as the profiler reports them (cuBLAS and ATen names shortened where they run long).
NAMES = {
    "GEMM": [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x32x64_warpgroupsize1x1x1_execute_segment_k_off"
        "_kernel__5x_cublas",
        "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false>",
        "cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>",
        "_skinny_gemm_kernel",
        "triton_tem_fused_mm_0",
    ],
    "split-K reduce": [
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true>"
        "(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)",
    ],
    "attention": [
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x64x128_4x1x1_kernel0_0",
        "void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
        "cutlass::bfloat16_t>, false, true>(pytorch_flash::Flash_fwd_params)",
        "void pytorch_flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<bfloat16_t>::Params)",
    ],
    "norm": [
        "_add_rmsnorm_kernel",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, "
        "float, float, float>, unsigned int, float, 4, 4> >",
        "void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul> >",
    ],
    "SwiGLU": [
        "_swiglu_kernel",
        "triton_poi_fused_mul_silu_1",
        "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel"
        "(at::TensorIteratorBase&)::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >",
    ],
    "FP8 quantize": ["_quantize_rows_kernel"],
    "rotary, cache write, copies": [
        "void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl<float>>",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
        "OpaqueType<4u>, unsigned int, 4, 128, 1>",
        "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
        "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >",
        "void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long, unsigned int, 2>",
        "triton_poi_fused__to_copy_cat_clone_index_put_2",
        "Memcpy DtoD (Device -> Device)",
        "Memset (Device)",
    ],
    "communication": [
        "_one_shot_push_kernel",
        "_two_shot_push_kernel",
        "_matmul_rs_own_kernel",
        "_ag_matmul_kernel",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    ],
    OTHER: [
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
        "unsigned int, long, 4, 4> >",
        "my_new_kernel",
    ],
}


@pytest.mark.parametrize("op, name", [(op, name) for op, names in NAMES.items() for name in names])
def test_kernel_names_fall_into_their_op_class(op: str, name: str) -> None:
    assert classify(name) == op


def test_every_weft_kernel_has_an_op_class() -> None:
    """A kernel added to kernels/ (or renamed) is not silently profiled as "other"."""
    source = "\n".join(path.read_text() for path in sorted(KERNELS.glob("*.py")))
    launched = set(re.findall(r"\b(_\w+_kernel)\[", source))
    assert "_skinny_gemm_kernel" in launched
    assert {name for name in launched if classify(name) == OTHER} == set()


def test_breakdown_sums_kernels_per_class_and_step() -> None:
    # Two replays of a 100 us step: per step a 40 us GEMM overlapping (PDL) a 10 us norm by 5 us,
    # two 5 us copies, one unknown 2 us kernel, and 43 us idle.
    events = []
    for start in (0.0, 100.0):
        events += [
            KernelEvent("_skinny_gemm_kernel", start, 40.0),
            KernelEvent("_add_rmsnorm_kernel", start + 35, 10.0),
            KernelEvent("Memcpy DtoD (Device -> Device)", start + 45, 5.0),
            KernelEvent("triton_poi_fused_cat_0", start + 50, 5.0),
            KernelEvent("my_new_kernel", start + 55, 2.0),
        ]
    rows = breakdown(events, steps=2, wall_us=100.0, roofline_us={"GEMM": 30.0, "attention": 6.0})
    by_op = {row["op"]: row for row in rows}
    assert [row["op"] for row in rows] == [
        "step (wall)",
        "all kernels",
        "GPU busy",
        "GEMM",
        "norm",
        "rotary, cache write, copies",
        OTHER,
    ]
    assert by_op["step (wall)"]["us"] == 100.0
    assert by_op["step (wall)"]["roofline_us"] == 36.0
    assert by_op["step (wall)"]["of_roofline"] == pytest.approx(0.36)
    assert by_op["all kernels"]["kernels"] == 5
    assert by_op["all kernels"]["us"] == pytest.approx(62.0)
    assert by_op["GPU busy"]["us"] == pytest.approx(57.0)
    classes = rows[3:]
    assert [row["kernels"] for row in classes] == [1, 1, 2, 1]
    assert [row["us"] for row in classes] == pytest.approx([40.0, 10.0, 10.0, 2.0])
    assert sum(row["of_kernels"] for row in classes) == pytest.approx(1.0)
    assert by_op["GEMM"]["of_kernels"] == pytest.approx(40 / 62)
    assert by_op["GEMM"]["of_step"] == pytest.approx(0.4)
    assert by_op["GEMM"]["of_roofline"] == pytest.approx(0.75)
    assert by_op["norm"]["roofline_us"] == ""
    assert largest_other(events, steps=2) == [("my_new_kernel", 2.0)]


def test_busy_time_is_the_union_of_kernel_intervals() -> None:
    events = [
        KernelEvent("a", 0, 10),
        KernelEvent("b", 5, 2),
        KernelEvent("c", 8, 4),
        KernelEvent("d", 20, 1),
    ]
    assert busy_us(events) == 13.0
    assert busy_us([]) == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["decode_profile", "--batch-sizes", "1"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main()


def test_step_roofline_reads_the_kv_cache_up_to_the_profiled_position() -> None:
    """The profiled step is the graph's captured one, at position prompt_len (512): its attention
    roofline is the KV cache's 513 positions, not the whole cache of prompt + decode steps (640); its
    GEMM roofline is every weight but the embedding table."""
    from omegaconf import OmegaConf

    from benchmarks.decode_profile import step_roofline_us
    from serve import build_model
    from tests.test_user_errors import composed

    args = OmegaConf.to_object(composed("serve", "model=llama3_8b").model)
    model = build_model(args, None, torch.device("meta"), torch.bfloat16)
    roofline = step_roofline_us(model, batch=8, position=512, bandwidth=1e12)
    assert roofline["attention"] == pytest.approx(2 * 32 * 8 * 8 * 128 * 2 * 513 / 1e6)
    assert roofline["GEMM"] == pytest.approx(2 * (args.num_params() - args.vocab_size * args.dim) / 1e6)
