//! A full [`ganymede_core::Backend`] from the kernel ops plus a device's memory and GEMMs:
//! [`KernelBackend`]`<L, D>` runs every elementwise, norm, attention, routing, loss and
//! optimizer op through [`KernelOps`]`<L>` and takes `Memory` and the GEMMs from `D`.
//! [`HostKernelBackend`] is the host build over the CPU backend (the model-level check that the
//! kernels compose into training: `crates/device-check/tests/kernel_backend.rs`); the GPU
//! backend is the same struct over a CUDA launcher and a device with cuBLAS.

use crate::launch::{HostLauncher, Launcher};
use crate::ops::{KernelOps, Tuning};
use ganymede_core::{
    Blas, CpuBackend, DType, ExpertGemm, ExpertRows, Gemm, Memory, NnOps, OptimOps, Syrk, View,
    ViewMut,
};

/// The matrix products a BLAS library provides (cuBLAS on a GPU), with the seam's semantics
/// ([`Blas::gemm`], [`Blas::syrk`], [`NnOps::gemm_grouped`]).
pub trait Gemms: Send + Sync {
    fn gemm(&self, c: ViewMut, a: View, b: View, g: Gemm);
    fn syrk(&self, c: ViewMut, a: View, s: Syrk);
    /// [`Blas::native_bf16`] of the library's device.
    fn native_bf16(&self) -> bool;
    fn gemm_grouped(&self, c: ViewMut, a: View, b: View, groups: &[(Gemm, usize, usize, usize)]);
    /// [`Blas::gemm_strided`]: one call per matrix unless the library batches.
    fn gemm_strided(
        &self,
        c: ViewMut,
        a: View,
        b: View,
        g: Gemm,
        batch: usize,
        strides: [usize; 3],
    );
    /// [`Blas::syrk_strided`].
    fn syrk_strided(&self, c: ViewMut, a: View, s: Syrk, batch: usize, strides: [usize; 2]);
    /// [`Blas::syrk_strided_into_bf16`].
    fn syrk_strided_into_bf16(
        &self,
        work: ViewMut,
        c16: ViewMut,
        a: View,
        s: Syrk,
        batch: usize,
        strides: [usize; 2],
    );
    /// [`Blas::batches_matrices`].
    fn batches_matrices(&self) -> bool;
}

impl Gemms for CpuBackend {
    fn gemm_strided(
        &self,
        c: ViewMut,
        a: View,
        b: View,
        g: Gemm,
        batch: usize,
        strides: [usize; 3],
    ) {
        Blas::gemm_strided(self, c, a, b, g, batch, strides)
    }
    fn syrk_strided(&self, c: ViewMut, a: View, s: Syrk, batch: usize, strides: [usize; 2]) {
        Blas::syrk_strided(self, c, a, s, batch, strides)
    }
    fn syrk_strided_into_bf16(
        &self,
        work: ViewMut,
        c16: ViewMut,
        a: View,
        s: Syrk,
        batch: usize,
        strides: [usize; 2],
    ) {
        Blas::syrk_strided_into_bf16(self, work, c16, a, s, batch, strides)
    }
    fn batches_matrices(&self) -> bool {
        Blas::batches_matrices(self)
    }
    fn gemm(&self, c: ViewMut, a: View, b: View, g: Gemm) {
        Blas::gemm(self, c, a, b, g)
    }
    fn syrk(&self, c: ViewMut, a: View, s: Syrk) {
        Blas::syrk(self, c, a, s)
    }
    fn native_bf16(&self) -> bool {
        Blas::native_bf16(self)
    }
    fn gemm_grouped(&self, c: ViewMut, a: View, b: View, groups: &[(Gemm, usize, usize, usize)]) {
        NnOps::gemm_grouped(self, c, a, b, groups)
    }
}

/// Memory and GEMMs from `D`, every other op a kernel launched through `L`.
pub struct KernelBackend<L: Launcher, D: Memory + Gemms> {
    ops: KernelOps<L>,
    dev: D,
}

impl<L: Launcher, D: Memory + Gemms> KernelBackend<L, D> {
    pub fn new(ops: KernelOps<L>, dev: D) -> Self {
        KernelBackend { ops, dev }
    }
    pub fn ops(&self) -> &KernelOps<L> {
        &self.ops
    }
    pub fn device_memory(&self) -> &D {
        &self.dev
    }
}

/// The kernels' host build as a backend: the CPU backend's memory and GEMMs, the shim's kernels.
pub type HostKernelBackend = KernelBackend<HostLauncher, CpuBackend>;

impl HostKernelBackend {
    /// Over `cpu` (an f32 backend, plain or two-memory), with the given launch sizes.
    pub fn host(cpu: CpuBackend, tuning: Tuning) -> Self {
        assert_eq!(cpu.dtype(), DType::F32, "the kernels are f32 (and bf16)");
        let ops = KernelOps::with_tuning(HostLauncher::new(cpu.clone()), tuning);
        KernelBackend::new(ops, cpu)
    }
}

impl<L: Launcher, D: Memory + Gemms> Memory for KernelBackend<L, D> {
    ganymede_core::forward_all_memory!(dev);
}

impl<L: Launcher, D: Memory + Gemms> Blas for KernelBackend<L, D> {
    // The products are the library's (`Gemms`), the vector ops the kernels'.
    ganymede_core::forward_blas!(dev:
        gemm, syrk, native_bf16, gemm_strided, syrk_strided, syrk_strided_into_bf16,
        batches_matrices,
    );
    ganymede_core::forward_blas!(ops: axpy, scale, add, sumsq, sumsq_acc, sumsq_acc_many);
    fn cast(&self, dst: ViewMut, src: View) {
        // A same-dtype "cast" is a copy, which is the memory's.
        if dst.dtype() == src.dtype() {
            assert_eq!(dst.len(), src.len(), "cast between different lengths");
            self.dev.copy(dst, src)
        } else {
            self.ops.cast(dst, src)
        }
    }
}

impl<L: Launcher, D: Memory + Gemms> NnOps for KernelBackend<L, D> {
    fn gemm_grouped(&self, c: ViewMut, a: View, b: View, groups: &[(Gemm, usize, usize, usize)]) {
        let bf16 = groups.first().is_some_and(|(g, ..)| g.bf16_inputs);
        if self.ops.tuning().grouped_tc && bf16 {
            self.ops.gemm_grouped_tc(c, a, b, groups)
        } else {
            Gemms::gemm_grouped(&self.dev, c, a, b, groups)
        }
    }
    fn gemm_experts(&self, c: ViewMut, a: View, b: View, rows: ExpertRows, g: &ExpertGemm) {
        match rows {
            ExpertRows::Device { offsets, rows } if self.experts_on_device(g.gemm.bf16_inputs) => {
                self.ops.gemm_experts_tc(c, a, b, (offsets, rows), g)
            }
            // Sizes for a library's grouped GEMM: the host's, or read back (a wait).
            ExpertRows::Device { offsets, .. } => {
                let o: Vec<usize> = self
                    .dev
                    .download_u32(offsets)
                    .iter()
                    .map(|&x| x as usize)
                    .collect();
                NnOps::gemm_grouped(self, c, a, b, &g.groups(&o))
            }
            ExpertRows::Host(o) => NnOps::gemm_grouped(self, c, a, b, &g.groups(o)),
        }
    }
    fn experts_on_device(&self, bf16_inputs: bool) -> bool {
        // gemm.cu's kernel rounds its operands to bf16, so f32 GEMMs take the library's.
        self.ops.tuning().grouped_tc && bf16_inputs
    }
    ganymede_core::forward_nn_kernels!(ops);
}

impl<L: Launcher, D: Memory + Gemms> OptimOps for KernelBackend<L, D> {
    ganymede_core::forward_all_optim_ops!(ops);
}

#[cfg(test)]
mod tests {
    use super::HostKernelBackend;
    use crate::ops::Tuning;
    use ganymede_core::{CpuBackend, Memory, StepPhase};

    /// The host build's phase clock is its CPU memory's: marks reach it through the kernel
    /// backend (a missing forward would leave the seam's no-op and report nothing).
    #[test]
    fn phase_marks_reach_the_device_memorys_clock() {
        let be = HostKernelBackend::host(CpuBackend::default(), Tuning::default());
        assert_eq!(be.take_phase_times(), None);
        be.start_phases();
        assert_eq!(be.phase(StepPhase::Attention), None);
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(be.phase(StepPhase::Optimizer), Some(StepPhase::Attention));
        let t = be.take_phase_times().expect("a running clock");
        assert_eq!(t.marks, 2);
        assert!(t.get(StepPhase::Attention) >= 5.0, "{t:?}");
    }
}
