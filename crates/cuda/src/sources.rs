//! The kernels' CUDA C source, embedded for NVRTC.
//!
//! Each entry of [`SOURCES`] is one file of `kernels/` with `kernels/common.cuh` (storage types,
//! bf16 conversions, block reductions) in front, ready for one NVRTC compilation (no include
//! paths, no headers). [`KERNELS`] names the `extern "C"` kernels each file defines; every
//! kernel documents its launch shape above its definition. The host build compiles the same
//! files (`build.rs`, `host`), and the tests check these lists against both builds.
//!
//! Conventions the device side follows (`ops` launches each op this way, for the host build and
//! the GPU alike; `tests/host_kernels.rs` checks each against the CPU backend):
//! - names end in the storage type of the activations, `_f32` or `_bf16` (f32 arithmetic
//!   either way), or `_f32_to_bf16` for f32 inputs with bf16 outputs (the rows bf16-input
//!   GEMMs read under bf16 compute); saved statistics (rstd, lse, delta) and weight gradients are f32, sums that
//!   the step reads at its end (losses, sums of squares, per-expert probability sums) f64;
//! - flat sizes are `long long`, dimensions `int`, token ids and routing indices `unsigned`;
//! - reductions are deterministic, without floating-point atomics: a partial pass into a
//!   scratch buffer, then an in-order sum. The scratch each op needs:
//!   - sum of squares: `sumsq_partial_*` (one f64 per block) then `sum_acc_f64`;
//!   - RMSNorm / head norm weight gradients: `ceil(rows / 64) × dim` f32 for
//!     `*_dw_partial_*`, then `col_sum_acc_f32`;
//!   - router per-expert sums: `ceil(rows / 64) × experts` f64 for `col_sum_partial_f64`,
//!     then `col_sum_set_f64`;
//!   - cross-entropy: `cross_entropy_forward_*` (lse) then `cross_entropy_loss_acc_*`;
//!   - attention backward: `delta`, `batch × heads × tq` f32 (`attention_backward_delta_*`),
//!     then `attention_backward_dkdv_*` and `attention_backward_dq_*` (or their tensor-core
//!     `*_tc{head_dim}_bf16` versions); the fused tensor-core backward
//!     (`attention_backward_fused_tc*_bf16`, `Tuning::attn_fused_dq`) instead adds dq into
//!     `batch × tq × heads × head_dim` f32 sums (zeroed first, scaled as they are added),
//!     which `cast_f32_to_bf16` rounds into dq;
//!   - embedding backward: the ids' grouping (`ganymede_core::embedding_segments`, three u32
//!     arrays), uploaded by the step with its ids (`EmbedIds`);
//! - `head_norm_rope_*` read RoPE's frequencies from a table the host computes once
//!   (`host::rope_inv_freq`, bitwise the CPU backend's);
//! - document masking (`data.document_mask`): `head_norm_rope_*_doc_*` and `attention_*_doc_*`
//!   (before the storage type) take each row's or query's document start, u32, as their last
//!   argument;
//! - `dispatch_tile_scan` runs as one block.

macro_rules! kernel_file {
    ($name:literal) => {
        (
            $name,
            // `#line` so NVRTC's messages name the file and line as in the repository.
            concat!(
                "#line 1 \"common.cuh\"\n",
                include_str!("../kernels/common.cuh"),
                "#line 1 \"",
                $name,
                "\"\n",
                include_str!(concat!("../kernels/", $name))
            ),
        )
    };
}

/// `(file name, source)` for every kernel file, `common.cuh` prepended.
pub const SOURCES: &[(&str, &str)] = &[
    kernel_file!("elementwise.cu"),
    kernel_file!("norm.cu"),
    kernel_file!("embed.cu"),
    kernel_file!("optim.cu"),
    kernel_file!("loss.cu"),
    kernel_file!("router.cu"),
    kernel_file!("dispatch.cu"),
    kernel_file!("attention.cu"),
    kernel_file!("gemm.cu"),
];

/// `(file name, kernels it defines)`, in the order of [`SOURCES`].
pub const KERNELS: &[(&str, &[&str])] = &[
    (
        "elementwise.cu",
        &[
            "zero_u32",
            "cast_f32_to_bf16",
            "cast_bf16_to_f32",
            "axpy_f32",
            "scale_f32",
            "add_f32",
            "axpy_bf16",
            "scale_bf16",
            "add_bf16",
            "sumsq_partial_f32",
            "sumsq_partial_bf16",
            "sum_acc_f64",
            "sumsq_partial_multi_f32",
            "sum_acc_multi_f64",
            "swiglu_forward_f32",
            "swiglu_forward_bf16",
            "swiglu_backward_f32",
            "swiglu_backward_bf16",
            "swiglu_forward_f32_to_bf16",
            "swiglu_backward_f32_to_bf16",
        ],
    ),
    (
        "norm.cu",
        &[
            "col_sum_acc_f32",
            "rmsnorm_forward_f32",
            "rmsnorm_backward_dx_f32",
            "rmsnorm_backward_dw_partial_f32",
            "rmsnorm_forward_bf16",
            "rmsnorm_backward_dx_bf16",
            "rmsnorm_backward_dw_partial_bf16",
            "head_norm_rope_forward_f32",
            "head_norm_rope_backward_dx_f32",
            "head_norm_rope_backward_dw_partial_f32",
            "head_norm_rope_forward_bf16",
            "head_norm_rope_backward_dx_bf16",
            "head_norm_rope_backward_dw_partial_bf16",
            "head_norm_rope_forward_doc_f32",
            "head_norm_rope_backward_dx_doc_f32",
            "head_norm_rope_backward_dw_partial_doc_f32",
            "head_norm_rope_forward_doc_bf16",
            "head_norm_rope_backward_dx_doc_bf16",
            "head_norm_rope_backward_dw_partial_doc_bf16",
            "head_norm_rope_forward_f32_bf16",
            "head_norm_rope_backward_dx_f32_bf16",
            "head_norm_rope_backward_dw_partial_f32_bf16",
            "head_norm_rope_forward_doc_f32_bf16",
            "head_norm_rope_backward_dx_doc_f32_bf16",
            "head_norm_rope_backward_dw_partial_doc_f32_bf16",
        ],
    ),
    (
        "embed.cu",
        &[
            "embedding_forward_f32",
            "embedding_forward_bf16",
            "embedding_forward_f32_bf16",
            "embedding_backward_sorted_f32",
            "embedding_backward_sorted_bf16",
        ],
    ),
    (
        "optim.cu",
        &[
            "adamw_step_f32",
            "adamw_step_f32_rounded",
            "adamw_step_multi_f32",
            "nesterov_f32",
            "step_scale_f64",
            "scale_by_inv_norm_f32",
            "sumsq_partial_strided_f32",
            "sum_rows_f64",
            "scale_by_inv_norm_strided_f32",
            "scale_by_inv_norm_strided_f32_to_bf16",
            "decay_update_f32",
            "decay_update_f32_rounded",
        ],
    ),
    (
        "loss.cu",
        &[
            "cross_entropy_forward_f32",
            "cross_entropy_loss_acc_f32",
            "cross_entropy_backward_f32",
            "cross_entropy_forward_bf16",
            "cross_entropy_loss_acc_bf16",
            "cross_entropy_backward_bf16",
        ],
    ),
    (
        "router.cu",
        &[
            "router_forward_f32",
            "router_backward_f32",
            "col_sum_partial_f64",
            "col_sum_set_f64",
        ],
    ),
    (
        "dispatch.cu",
        &[
            "dispatch_tile_counts",
            "dispatch_tile_scan",
            "dispatch_place",
            "moe_gather_f32",
            "moe_gather_backward_f32",
            "moe_combine_f32",
            "moe_combine_backward_f32",
            "moe_gather_bf16",
            "moe_gather_backward_bf16",
            "moe_combine_bf16",
            "moe_combine_backward_bf16",
            "moe_gather_f32_to_bf16",
            "moe_combine_backward_f32_to_bf16",
            "moe_combine_ye_bf16",
            "moe_combine_backward_ye_bf16",
        ],
    ),
    (
        "attention.cu",
        &[
            "attention_forward_f32",
            "attention_backward_delta_f32",
            "attention_backward_dkdv_f32",
            "attention_backward_dq_f32",
            "attention_forward_bf16",
            "attention_backward_delta_bf16",
            "attention_backward_dkdv_bf16",
            "attention_backward_dq_bf16",
            "attention_forward_tc16_bf16",
            "attention_backward_dkdv_tc16_bf16",
            "attention_backward_dq_tc16_bf16",
            "attention_forward_tc32_bf16",
            "attention_backward_dkdv_tc32_bf16",
            "attention_backward_dq_tc32_bf16",
            "attention_forward_tc64_bf16",
            "attention_backward_dkdv_tc64_bf16",
            "attention_backward_dq_tc64_bf16",
            "attention_forward_tc128_bf16",
            "attention_backward_dkdv_tc128_bf16",
            "attention_backward_dq_tc128_bf16",
            "attention_forward_tc16x2_bf16",
            "attention_forward_tc32x2_bf16",
            "attention_forward_tc64x2_bf16",
            "attention_backward_fused_tc16_bf16",
            "attention_backward_fused_tc32_bf16",
            "attention_backward_fused_tc64_bf16",
            "attention_forward_doc_f32",
            "attention_backward_dkdv_doc_f32",
            "attention_backward_dq_doc_f32",
            "attention_forward_doc_bf16",
            "attention_backward_dkdv_doc_bf16",
            "attention_backward_dq_doc_bf16",
            "attention_forward_tc16_doc_bf16",
            "attention_backward_dkdv_tc16_doc_bf16",
            "attention_backward_dq_tc16_doc_bf16",
            "attention_forward_tc32_doc_bf16",
            "attention_backward_dkdv_tc32_doc_bf16",
            "attention_backward_dq_tc32_doc_bf16",
            "attention_forward_tc64_doc_bf16",
            "attention_backward_dkdv_tc64_doc_bf16",
            "attention_backward_dq_tc64_doc_bf16",
            "attention_forward_tc128_doc_bf16",
            "attention_backward_dkdv_tc128_doc_bf16",
            "attention_backward_dq_tc128_doc_bf16",
            "attention_forward_tc16x2_doc_bf16",
            "attention_forward_tc32x2_doc_bf16",
            "attention_forward_tc64x2_doc_bf16",
            "attention_backward_fused_tc16_doc_bf16",
            "attention_backward_fused_tc32_doc_bf16",
            "attention_backward_fused_tc64_doc_bf16",
        ],
    ),
    (
        "gemm.cu",
        &[
            "gemm_grouped_f32_f32_f32",
            "gemm_grouped_f32_bf16_f32",
            "gemm_grouped_bf16_f32_f32",
            "gemm_grouped_bf16_bf16_f32",
            "gemm_grouped_f32_f32_bf16",
            "gemm_grouped_f32_bf16_bf16",
            "gemm_grouped_bf16_f32_bf16",
            "gemm_grouped_bf16_bf16_bf16",
            "gemm_experts_f32_f32_f32",
            "gemm_experts_f32_bf16_f32",
            "gemm_experts_bf16_f32_f32",
            "gemm_experts_bf16_bf16_f32",
            "gemm_experts_f32_f32_bf16",
            "gemm_experts_f32_bf16_bf16",
            "gemm_experts_bf16_f32_bf16",
            "gemm_experts_bf16_bf16_bf16",
        ],
    ),
];

/// NVRTC options the kernels are compiled with (besides `--gpu-architecture` and include
/// folders), on the device and in CI's compile test alike: C++17; IEEE division and square
/// roots and no flushing of denormals, so device results can be held against the CPU
/// backend's; fused multiply-adds allowed, as nvcc's default (the host build contracts none, so
/// the two differ by rounding, which the device check's tolerances allow for); and functions
/// without an execution space taken as device code, which is how the elementwise kernels'
/// generic lambdas (`ew_loop` in common.cuh) become device code without nvcc's
/// `--extended-lambda`.
pub const NVRTC_OPTIONS: &[&str] = &[
    "--std=c++17",
    "--fmad=true",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--ftz=false",
    "--device-as-default-execution-space",
];

/// The source file that defines `kernel`.
pub fn file_of(kernel: &str) -> Option<&'static str> {
    KERNELS
        .iter()
        .find(|(_, ks)| ks.contains(&kernel))
        .map(|(f, _)| *f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_agree_with_the_host_build() {
        let files: Vec<&str> = SOURCES.iter().map(|(f, _)| *f).collect();
        let listed: Vec<&str> = KERNELS.iter().map(|(f, _)| *f).collect();
        assert_eq!(files, listed, "SOURCES and KERNELS name the same files");
        // Every file of kernels/ is listed.
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut sorted: Vec<String> = files.iter().map(|s| s.to_string()).collect();
        sorted.sort();
        assert_eq!(on_disk, sorted, "kernels/*.cu vs SOURCES");
        // The host build (which parsed the preprocessed source) has exactly these kernels.
        let mut host = crate::host::kernel_names();
        let mut all: Vec<String> = KERNELS
            .iter()
            .flat_map(|(_, ks)| ks.iter().map(|s| s.to_string()))
            .collect();
        host.sort();
        all.sort();
        assert_eq!(all, host, "KERNELS vs the kernels the host build found");
        // (Whether each file really defines its kernels is checked on the PTX: tests/nvrtc.rs.)
        for (file, ks) in KERNELS {
            for k in *ks {
                assert_eq!(file_of(k), Some(*file), "{k} listed twice");
            }
        }
    }
}
