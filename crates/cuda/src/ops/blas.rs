//! Blas's vector operations (everything but the GEMMs): `elementwise.cu`.

use super::*;

impl<L: Launcher> KernelOps<L> {
    /// `y += alpha * x` (f32 or bf16).
    pub fn axpy(&self, y: ViewMut, alpha: f32, x: View) {
        let (n, dt) = (y.len(), y.dtype());
        assert_eq!((x.len(), x.dtype()), (n, dt), "axpy: x vs y");
        if n == 0 {
            return;
        }
        let args = [self.arg_mut(y), alpha.into(), self.arg(x), i64_of(n)];
        self.launch(by_dtype!("axpy", dt), self.ew(n), &args);
    }

    /// `y *= alpha`.
    pub fn scale(&self, y: ViewMut, alpha: f32) {
        let (n, dt) = (y.len(), y.dtype());
        if n == 0 {
            return;
        }
        let args = [self.arg_mut(y), alpha.into(), i64_of(n)];
        self.launch(by_dtype!("scale", dt), self.ew(n), &args);
    }

    /// `y += x`.
    pub fn add(&self, y: ViewMut, x: View) {
        let (n, dt) = (y.len(), y.dtype());
        assert_eq!((x.len(), x.dtype()), (n, dt), "add: x vs y");
        if n == 0 {
            return;
        }
        let args = [self.arg_mut(y), self.arg(x), i64_of(n)];
        self.launch(by_dtype!("add", dt), self.ew(n), &args);
    }

    /// `acc[0] += Σ x²` at the address `acc` (an f64), in two deterministic passes.
    pub(super) fn sumsq_into(&self, acc: Arg, x: View, partial: *mut c_void, blocks: usize) {
        let n = x.len();
        let k = by_dtype!("sumsq_partial", x.dtype());
        let pass1 = LaunchConfig::linear(u32_of(blocks), self.tuning.ew_block);
        self.launch(k, pass1, &[partial.into(), self.arg(x), i64_of(n)]);
        let pass2 = LaunchConfig::linear(1, 256);
        let args = [acc, partial.into(), i32_of(blocks)];
        self.launch(kernel!("sum_acc_f64"), pass2, &args);
    }

    /// `acc[0] += Σ x²` over every tensor of `xs` (f32), in two launches whatever their number
    /// (`sumsq_partial_multi_f32`, `sum_acc_multi_f64`): the bits of [`Self::sumsq_acc`] on each
    /// in turn, which other dtypes take.
    pub fn sumsq_acc_many(&self, mut acc: ViewMut, xs: &[View]) {
        assert_eq!(acc.dtype(), DType::F64, "sumsq_acc_many: acc must be f64");
        assert!(!acc.is_empty(), "sumsq_acc_many: empty acc");
        let xs: Vec<View> = xs.iter().copied().filter(|x| !x.is_empty()).collect();
        if xs.iter().any(|x| x.dtype() != DType::F32) || xs.len() > u16::MAX as usize {
            for x in xs {
                self.sumsq_acc(acc.reborrow(), x);
            }
            return;
        }
        if xs.is_empty() {
            return;
        }
        // Per tensor: its address, length, first pass's blocks and where its partials start.
        let (mut table, mut start, mut most) = (Vec::with_capacity(4 * xs.len()), 0, 0);
        for x in &xs {
            let blocks = self.sumsq_blocks(x.len());
            let addr = self.launcher.addr(*x) as i64;
            table.extend([addr, x.len() as i64, blocks as i64, start as i64]);
            start += blocks;
            most = most.max(blocks);
        }
        let table = self.table(table);
        let (_s, [partial]) = self.scratch([start * 8]);
        let pass1 = cfg(grid(most, xs.len(), 1), self.tuning.ew_block);
        let k = kernel!("sumsq_partial_multi_f32");
        self.launch(k, pass1, &[partial.into(), table.into()]);
        let args = [
            self.arg_mut(acc),
            partial.into(),
            table.into(),
            i32_of(xs.len()),
        ];
        let pass2 = LaunchConfig::linear(1, 256);
        self.launch(kernel!("sum_acc_multi_f64"), pass2, &args);
    }

    /// Blocks of the first pass of a sum of squares over `n` elements.
    pub(super) fn sumsq_blocks(&self, n: usize) -> usize {
        self.ew(n).grid[0] as usize
    }

    /// Σ x² in f64, read back to the host.
    pub fn sumsq(&self, x: View) -> f64 {
        let blocks = self.sumsq_blocks(x.len());
        let (_s, [partial, acc]) = self.scratch([blocks * 8, 8]);
        self.zero(acc, 8);
        self.sumsq_into(acc.into(), x, partial, blocks);
        let mut out = [0.0f64];
        self.get(&mut out, acc);
        out[0]
    }

    /// `acc[0] += Σ x²`, `acc` an f64 view.
    pub fn sumsq_acc(&self, acc: ViewMut, x: View) {
        assert_eq!(acc.dtype(), DType::F64, "sumsq_acc: acc must be f64");
        assert!(!acc.is_empty(), "sumsq_acc: empty acc");
        let blocks = self.sumsq_blocks(x.len());
        let (_s, [partial]) = self.scratch([blocks * 8]);
        self.sumsq_into(self.arg_mut(acc), x, partial, blocks);
    }

    /// `dst = src` between f32 and bf16 (round to nearest even, NaN kept). Same-dtype copies are
    /// the memory's (`Memory::copy`), which [`crate::kernel_backend::KernelBackend`] routes.
    pub fn cast(&self, dst: ViewMut, src: View) {
        let n = dst.len();
        assert_eq!(src.len(), n, "cast between different lengths");
        let k = match (src.dtype(), dst.dtype()) {
            (DType::F32, DType::BF16) => kernel!("cast_f32_to_bf16"),
            (DType::BF16, DType::F32) => kernel!("cast_bf16_to_f32"),
            (a, b) => panic!("no cast kernel from {} to {}", a.name(), b.name()),
        };
        if n == 0 {
            return;
        }
        let args = [self.arg_mut(dst), self.arg(src), i64_of(n)];
        self.launch(k, self.ew(n), &args);
    }
}
