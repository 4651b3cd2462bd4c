//! The routed experts' compute, behind [`ExpertExecutor`] so expert parallelism can move the
//! rows to the ranks that hold their experts without the block code knowing. The block hands
//! over rows grouped by expert (`counts[e]` rows of expert `e` from `offsets[e]`); the executor
//! returns one output row per input row. [`LocalExperts`] runs every expert here.

use anyhow::Result;
use ganymede_core::{Backend, Gemm, ParamStore, View, ViewMut};

/// What an executor needs besides the rows: routing counts, shapes, where the weights are.
pub struct ExpertsIo<'a> {
    pub layer: usize,
    pub counts: &'a [usize],
    pub offsets: &'a [usize],
    /// Expert hidden size and model width.
    pub f: usize,
    pub h: usize,
    /// Experts each token picks (distinct ones): bounds the rows an expert-parallel owner can
    /// receive.
    pub top_k: usize,
    pub params: &'a ParamStore,
    /// Indices of the stacked gate, up and down weights in `params` (and in the gradients).
    pub gate: usize,
    pub up: usize,
    pub down: usize,
    /// bf16-input GEMMs (the model's compute dtype).
    pub bf16: bool,
}

/// The block's buffers for one routed-expert pass (rows grouped by expert).
pub struct ExpertsFwdBufs<'a> {
    pub xe: View<'a>,
    /// Gate, up and SwiGLU outputs (kept for backward by a local executor).
    pub g: ViewMut<'a>,
    pub u: ViewMut<'a>,
    pub a: ViewMut<'a>,
    pub ye: ViewMut<'a>,
}

pub struct ExpertsBwdBufs<'a> {
    /// The forward's rows and saved internals.
    pub xe: View<'a>,
    pub g: View<'a>,
    pub u: View<'a>,
    pub a: View<'a>,
    pub dye: View<'a>,
    /// Scratch.
    pub da: ViewMut<'a>,
    pub dg: ViewMut<'a>,
    pub du: ViewMut<'a>,
    pub dxe: ViewMut<'a>,
}

/// What an executor's fixed row buffers held in the steps since it was last asked
/// ([`ExpertExecutor::take_use`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowBufferUse {
    /// Rows the buffers are sized for now.
    pub capacity: usize,
    /// Most rows one layer's pass received.
    pub peak: usize,
    /// Rows of an even routing (what a rank receives when every expert is equally loaded).
    pub even: usize,
    /// Times a pass received more rows than the buffers held, so that they grew.
    pub regrowths: u64,
}

/// Runs the routed experts of a MoE layer, forward and backward. An executor that moves rows
/// between processes returns its collectives' errors, which end the step.
pub trait ExpertExecutor {
    fn forward(&mut self, be: &dyn Backend, io: &ExpertsIo, b: ExpertsFwdBufs) -> Result<()>;
    /// The internals of `layer`'s last forward will not be read by a backward (they are
    /// recomputed under full activation checkpointing, or there is no backward). An executor
    /// that keeps its own copy of them (expert parallelism) frees it here.
    fn discard(&mut self, _layer: usize) {}
    /// The use of the executor's own row buffers since the last call, which starts a new
    /// count; `None` for one that has none (it works in the block's buffers).
    fn take_use(&mut self) -> Option<RowBufferUse> {
        None
    }
    /// Writes `dxe` and ADDS the weight gradients into `grads`.
    fn backward(
        &mut self,
        be: &dyn Backend,
        io: &ExpertsIo,
        grads: &mut ParamStore,
        b: ExpertsBwdBufs,
    ) -> Result<()>;
}

/// Every expert on this process: one grouped GEMM per op over all experts with rows.
pub struct LocalExperts;

/// The per-expert GEMMs of a grouped call: `f(first_row, rows, expert)` for experts with rows.
pub(crate) fn expert_groups(
    offsets: &[usize],
    counts: &[usize],
    f: impl Fn(usize, usize, usize) -> (Gemm, usize, usize, usize),
) -> Vec<(Gemm, usize, usize, usize)> {
    (0..counts.len())
        .filter(|&ex| counts[ex] > 0)
        .map(|ex| f(offsets[ex], counts[ex], ex))
        .collect()
}

/// `groups` with `f` applied to each GEMM (a promise of `Gemm::unchanged`, a beta).
fn each(
    groups: &[(Gemm, usize, usize, usize)],
    f: impl Fn(Gemm) -> Gemm,
) -> Vec<(Gemm, usize, usize, usize)> {
    groups.iter().map(|&(g, x, y, z)| (f(g), x, y, z)).collect()
}

impl ExpertExecutor for LocalExperts {
    fn forward(&mut self, be: &dyn Backend, io: &ExpertsIo, b: ExpertsFwdBufs) -> Result<()> {
        let ExpertsFwdBufs {
            xe,
            mut g,
            mut u,
            mut a,
            ye,
        } = b;
        let (f, h) = (io.f, io.h);
        let (wg, wu, wd) = (
            io.params.get(io.gate),
            io.params.get(io.up),
            io.params.get(io.down),
        );
        // One GEMM per expert over its tokens: rows r0..r0+c of the dispatched buffers.
        let gs = expert_groups(io.offsets, io.counts, |r0, c, ex| {
            (
                Gemm::new(c, f, h, false, true).bf16_inputs(io.bf16),
                r0 * h,
                ex * f * h,
                r0 * f,
            )
        });
        be.gemm_grouped(g.reborrow(), xe, wg.view(), &gs);
        // The same rows again: a bf16 backend reuses their cast (`Gemm::unchanged`).
        be.gemm_grouped(
            u.reborrow(),
            xe,
            wu.view(),
            &each(&gs, |g| g.unchanged(true, false)),
        );
        // The views may be longer than the routed rows (an expert-parallel owner's buffers are
        // sized for the most it can receive): the element-wise op covers the rows only.
        let n = io.offsets.last().copied().unwrap_or(0) * f;
        be.swiglu_forward(
            a.reborrow().slice(0, n),
            g.as_view().slice(0, n),
            u.as_view().slice(0, n),
        );
        let gs = expert_groups(io.offsets, io.counts, |r0, c, ex| {
            (
                Gemm::new(c, h, f, false, true).bf16_inputs(io.bf16),
                r0 * f,
                ex * h * f,
                r0 * h,
            )
        });
        be.gemm_grouped(ye, a.as_view(), wd.view(), &gs);
        Ok(())
    }

    fn backward(
        &mut self,
        be: &dyn Backend,
        io: &ExpertsIo,
        grads: &mut ParamStore,
        b: ExpertsBwdBufs,
    ) -> Result<()> {
        let ExpertsBwdBufs {
            xe,
            g,
            u,
            a,
            dye,
            mut da,
            mut dg,
            mut du,
            mut dxe,
        } = b;
        let (f, h) = (io.f, io.h);
        let (wg, wu, wd) = (
            io.params.get(io.gate),
            io.params.get(io.up),
            io.params.get(io.down),
        );
        let (off, cnt) = (io.offsets, io.counts);
        // dA = dY·W_down[e];  dW_down[e] += dYᵀ·A
        let gs = expert_groups(off, cnt, |r0, c, ex| {
            (
                Gemm::new(c, f, h, false, false).bf16_inputs(io.bf16),
                r0 * h,
                ex * h * f,
                r0 * f,
            )
        });
        be.gemm_grouped(da.reborrow(), dye, wd.view(), &gs);
        let gs = expert_groups(off, cnt, |r0, c, ex| {
            let gm = Gemm::new(h, f, c, true, false)
                .bf16_inputs(io.bf16)
                .beta(1.0);
            (gm, r0 * h, r0 * f, ex * h * f)
        });
        // dye again in A (cast by the last call).
        be.gemm_grouped(
            grads.get_mut(io.down).view_mut(),
            dye,
            a,
            &each(&gs, |g| g.unchanged(true, false)),
        );
        // Routed rows only, as in the forward.
        let n = off.last().copied().unwrap_or(0) * f;
        be.swiglu_backward(
            dg.reborrow().slice(0, n),
            du.reborrow().slice(0, n),
            da.as_view().slice(0, n),
            g.slice(0, n),
            u.slice(0, n),
        );
        // dXe = dG·W_gate[e] + dU·W_up[e];  dW_gate[e] += dGᵀ·Xe;  dW_up[e] += dUᵀ·Xe, in the
        // order that reads each of dG and dU twice in a row in A, and Xe in B twice with only a
        // bf16 weight in B between (so a bf16 backend casts each once; dXe's sum is unchanged).
        let gx = expert_groups(off, cnt, |r0, c, ex| {
            (
                Gemm::new(c, h, f, false, false).bf16_inputs(io.bf16),
                r0 * f,
                ex * f * h,
                r0 * h,
            )
        });
        let gw = expert_groups(off, cnt, |r0, c, ex| {
            let gm = Gemm::new(f, h, c, true, false)
                .bf16_inputs(io.bf16)
                .beta(1.0);
            (gm, r0 * f, r0 * h, ex * f * h)
        });
        be.gemm_grouped(dxe.reborrow(), dg.as_view(), wg.view(), &gx);
        let gw_g = each(&gw, |g| g.unchanged(true, false));
        be.gemm_grouped(grads.get_mut(io.gate).view_mut(), dg.as_view(), xe, &gw_g);
        be.gemm_grouped(
            dxe.reborrow(),
            du.as_view(),
            wu.view(),
            &each(&gx, |g| g.beta(1.0)),
        );
        let gw_u = each(&gw, |g| g.unchanged(true, true));
        be.gemm_grouped(grads.get_mut(io.up).view_mut(), du.as_view(), xe, &gw_u);
        Ok(())
    }
}
