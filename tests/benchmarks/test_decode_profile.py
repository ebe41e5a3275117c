"""``common.profiler``'s decode-step profile (issue #51 item 1): the kernel categories on the kernel names of a decode
step as the sources define them (vLLM 0.26's CUDA ops, FA3, punica's Triton LoRA kernels, cuBLAS / nvjet, torch's
row-wise ``_scaled_mm`` and reductions, inductor's fused names, our kernels) — written here by hand, not yet taken
from an H100 trace: the GPU run's ``other`` column and top kernels check them; the lm_head found by position; and
``profile_decode`` on the CPU (other names there: the plumbing only; ``rollout.py --profile`` end to end:
``test_rollout_smoke.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from common.profiler import CATEGORY_COLUMNS, label_kernels, profile_decode, profile_table  # noqa: E402

# One decoder layer and the step's tail in launch order, named as torch.profiler shows kernels (demangled).
VLLM_BF16_LORA_STEP = [
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm/rotary/act"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "cuBLAS gemm"),  # qkv_proj
    ("_lora_shrink_kernel", "LoRA"),
    ("_lora_expand_kernel", "LoRA"),
    (
        "void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*, c10::BFloat16*)",
        "norm/rotary/act",
    ),
    (
        "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(...)",
        "attention",
    ),
    (
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
        "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, "
        "128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, false, false, false, true> > > >(...)",
        "attention",
    ),
    (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
        "__5x_cublas",
        "cuBLAS gemm",
    ),  # o_proj
    (
        "void vllm::act_and_mul_kernel<c10::BFloat16, &(c10::BFloat16 vllm::silu_kernel<c10::BFloat16>(c10::BFloat16 "
        "const&)), true>(c10::BFloat16*, c10::BFloat16 const*, int)",
        "norm/rotary/act",
    ),
    ("triton_poi_fused_add_3", "inductor (fused)"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(...)", "norm/rotary/act"),  # the final norm
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "lm_head"),  # compute_logits, eager after the replay
    (
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false>(...)",
        "lm_head",
    ),
    (
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>(...)",
        "other",
    ),  # logits.float()
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
        "long, 4, 4> >(...)",
        "sampling",
    ),
    ("Memcpy DtoH (Device -> Pinned)", "memcpy/memset"),
]
OURS_FP8_AND_GRAPH_ENGINE = [
    ("_act_quant_kernel", "fp8 gemm"),
    (
        "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
        "cute::tuple<int, int, int, int>, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::"
        "MainloopSm90TmaGmmaWarpSpecializedPingpongFP8FastAccum<4, cute::tuple<cute::C<1>>>, cutlass::float_e4m3_t> > >",
        "fp8 gemm",
    ),
    # torch._scaled_mm row-wise as cuBLAS ran it on the H100 (decode_profile_vllm_7b_h100_35bcdd6.json, B >= 128)
    ("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT", "fp8 gemm"),
    ("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_bias_TNT", "fp8 gemm"),
    ("_linear_mma_kernel", "nvfp4 gemm"),
    ("_ws_linear_kernel", "nvfp4 gemm"),
    ("_gemv_kernel", "nvfp4 gemm"),
    ("_decode_attention_split_kernel", "attention"),
    ("_decode_attention_combine_kernel", "attention"),
    ("triton_poi_fused_mul_silu_2", "norm/rotary/act"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_7", "norm/rotary/act"),  # the final norm
    ("_linear_mma_kernel", "nvfp4 gemm"),  # a GEMM not followed by sampling stays a linear ...
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_8", "norm/rotary/act"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)", "lm_head"),
    ("triton_red_fused_argmax_9", "sampling"),  # ... the one before the sampler is lm_head
]


@pytest.mark.parametrize("step", [VLLM_BF16_LORA_STEP, OURS_FP8_AND_GRAPH_ENGINE], ids=["vllm-bf16-lora", "ours"])
def test_recorded_kernel_names_fall_in_their_categories(step):
    names, want = zip(*step)
    assert label_kernels(list(names)) == list(want)
    assert set(want) <= set(CATEGORY_COLUMNS)


def test_profile_decode_subtracts_the_prefill_on_the_cpu():
    w = torch.randn(64, 64)

    def run(n: int) -> float:  # a "prefill" of 5 matmuls, then one matmul and one argmax per new token
        x = torch.randn(8, 64)
        for _ in range(5):
            x = x @ w
        for _ in range(n - 1):
            x = (x @ w).softmax(-1)
            x.argmax(-1)
        return 0.001 * n

    p = profile_decode(run, cuda=False, steps=4)
    assert p["steps"] == 4 and p["wall_ms"] == pytest.approx(1.0)
    assert p["kernels_per_step"] > 0 and set(p["by_category_ms"]) == set(CATEGORY_COLUMNS)
    assert p["gpu_busy_ms"] > 0 and p["cpu_gap_ms"] == pytest.approx(p["wall_ms"] - p["gpu_busy_ms"], abs=1e-3)
    row = {"model": "tiny", "engine": "cpu", "arm": "x", "batches": [{"batch": 8, "profile": p}]}
    assert "| tiny | cpu | x | 8 |" in profile_table([row])
