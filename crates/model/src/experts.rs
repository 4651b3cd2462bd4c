//! The routed experts' compute, behind [`ExpertExecutor`] so expert parallelism can move the
//! rows to the ranks that hold their experts without the block code knowing. The block hands
//! over rows grouped by expert (expert `e`'s rows from `offsets[e]` to `offsets[e + 1]`, on the
//! host or in device memory, see [`ExpertRows`]); the executor returns one output row per input
//! row. [`LocalExperts`] runs every expert here.

use anyhow::Result;
use ganymede_core::{Backend, ExpertGemm, ExpertRows, Gemm, ParamStore, Routed, View, ViewMut};

/// What an executor needs besides the rows: routing counts, shapes, where the weights are.
pub struct ExpertsIo<'a> {
    pub layer: usize,
    /// Each expert's rows.
    pub rows: ExpertRows<'a>,
    /// The routed rows (`offsets[E]`; the buffers may hold more).
    pub routed: usize,
    /// Rows per expert on the host: read back for an executor that asks for them
    /// ([`ExpertExecutor::host_counts`]), or where the backend cannot leave them on the device;
    /// empty otherwise.
    pub counts: &'a [usize],
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

impl<'a> ExpertsIo<'a> {
    /// The same layer and shapes over rows laid out on the host (an expert-parallel owner's
    /// received rows, say).
    pub fn on_host(&self, counts: &'a [usize], offsets: &'a [usize]) -> ExpertsIo<'a> {
        ExpertsIo {
            rows: ExpertRows::Host(offsets),
            routed: offsets.last().copied().unwrap_or(0),
            counts,
            ..*self
        }
    }
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
    /// Whether it needs each chunk's per-expert counts on the host (an all-to-all's sizes),
    /// which the block then reads back after the dispatch.
    fn host_counts(&self) -> bool {
        false
    }
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

/// A GEMM per expert, routed on `m` (a product over each expert's rows) or `k` (a sum over
/// them): `gemm` with the routed dimension left 0, and each operand's offset per routed row and
/// per expert.
fn per_expert(
    gemm: Gemm,
    routed: Routed,
    a: [usize; 2],
    b: [usize; 2],
    c: [usize; 2],
) -> ExpertGemm {
    ExpertGemm {
        gemm,
        routed,
        a,
        b,
        c,
    }
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
        let (f, h, rows) = (io.f, io.h, io.rows);
        let (wg, wu, wd) = (
            io.params.get(io.gate),
            io.params.get(io.up),
            io.params.get(io.down),
        );
        // One GEMM per expert over its tokens: rows r0..r0+c of the dispatched buffers.
        let gm = Gemm::new(0, f, h, false, true).bf16_inputs(io.bf16);
        let gate = per_expert(gm, Routed::M, [h, 0], [0, f * h], [f, 0]);
        be.gemm_experts(g.reborrow(), xe, wg.view(), rows, &gate);
        // The same rows again: a bf16 backend reuses their cast (`Gemm::unchanged`).
        let up = gate.with(|g| g.unchanged(true, false));
        be.gemm_experts(u.reborrow(), xe, wu.view(), rows, &up);
        // The views may be longer than the routed rows (an expert-parallel owner's buffers are
        // sized for the most it can receive): the element-wise op covers the rows only.
        let n = io.routed * f;
        be.swiglu_forward(
            a.reborrow().slice(0, n),
            g.as_view().slice(0, n),
            u.as_view().slice(0, n),
        );
        let gm = Gemm::new(0, h, f, false, true).bf16_inputs(io.bf16);
        let down = per_expert(gm, Routed::M, [f, 0], [0, h * f], [h, 0]);
        be.gemm_experts(ye, a.as_view(), wd.view(), rows, &down);
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
        let (f, h, rows) = (io.f, io.h, io.rows);
        let (wg, wu, wd) = (
            io.params.get(io.gate),
            io.params.get(io.up),
            io.params.get(io.down),
        );
        // dA = dY·W_down[e];  dW_down[e] += dYᵀ·A
        let gm = Gemm::new(0, f, h, false, false).bf16_inputs(io.bf16);
        let da_e = per_expert(gm, Routed::M, [h, 0], [0, h * f], [f, 0]);
        be.gemm_experts(da.reborrow(), dye, wd.view(), rows, &da_e);
        // dye again in A (cast by the last call).
        let gm = Gemm::new(h, f, 0, true, false)
            .bf16_inputs(io.bf16)
            .beta(1.0)
            .unchanged(true, false);
        let dwd = per_expert(gm, Routed::K, [h, 0], [f, 0], [0, h * f]);
        be.gemm_experts(grads.get_mut(io.down).view_mut(), dye, a, rows, &dwd);
        // Routed rows only, as in the forward.
        let n = io.routed * f;
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
        let gm = Gemm::new(0, h, f, false, false).bf16_inputs(io.bf16);
        let gx = per_expert(gm, Routed::M, [f, 0], [0, f * h], [h, 0]);
        let gm = Gemm::new(f, h, 0, true, false)
            .bf16_inputs(io.bf16)
            .beta(1.0);
        let gw = per_expert(gm, Routed::K, [f, 0], [h, 0], [0, f * h]);
        be.gemm_experts(dxe.reborrow(), dg.as_view(), wg.view(), rows, &gx);
        let gw_g = gw.with(|g| g.unchanged(true, false));
        be.gemm_experts(
            grads.get_mut(io.gate).view_mut(),
            dg.as_view(),
            xe,
            rows,
            &gw_g,
        );
        let gx_u = gx.with(|g| g.beta(1.0));
        be.gemm_experts(dxe.reborrow(), du.as_view(), wu.view(), rows, &gx_u);
        let gw_u = gw.with(|g| g.unchanged(true, true));
        be.gemm_experts(
            grads.get_mut(io.up).view_mut(),
            du.as_view(),
            xe,
            rows,
            &gw_u,
        );
        Ok(())
    }
}
