//! Expert parallelism: the routed experts are split over the `ep` group (group rank `e` holds
//! experts `e·E/ep .. (e+1)·E/ep`, the local slice FSDP gathers over the expert-FSDP group).
//! The block hands over its rows grouped by expert; rows for another rank's experts are
//! contiguous, so one uneven all-to-all sends each rank its rows. The owner reorders what it
//! received expert-major (one row gather by a permutation, [`row_orders`]), runs its experts
//! with the local executor, and the outputs travel back the same way. Backward mirrors it:
//! output gradients out, input gradients back, weight gradients accumulated on the owner.
//!
//! Memory: every buffer is a backend tensor charged to the ledger. What the owner keeps of a
//! layer's forward for its backward (`Activations`) is held only while a backward will read it:
//! under full activation checkpointing the model discards it after each forward and the
//! backward's recompute makes it again, so one layer's worth is alive at a time, as for every
//! other block internal. Sets of buffers are pooled and sized for a capacity of rows, not for
//! the rows a step routed: the routing changes every step, and buffers sized to what was seen
//! would grow whenever a later step sent this rank more. The capacity is
//! `parallelism.ep_capacity_factor` times an even routing's rows, capped at the most the rank
//! can receive (`ganymede_config::ep_capacity_rows`), set in the first step. A pass that receives more grows it
//! (to a quarter above what came), counted in [`RowBufferUse`] so the trainer can say so; the
//! pooled sets catch up when next used, so a regrowth's allocations end by the next step.
//! Otherwise no step after the first allocates. The GEMMs are handed views of the whole
//! capacity (they read the routed rows only) so that a backend's bf16 cast scratch, sized by
//! the views, is fixed with it.

use anyhow::{Context, Result};
use ganymede_core::{
    in_phase, Backend, Category, DType, ParamStore, StepPhase, Tensor, View, ViewMut,
};
use ganymede_dist::{Phase, ProcessGroup};
use ganymede_model::{
    ExpertExecutor, ExpertsBwdBufs, ExpertsFwdBufs, ExpertsIo, LocalExperts, RowBufferUse,
};
use std::collections::HashMap;
use std::sync::Arc;

/// A pooled tensor that is reallocated, larger, only when asked for more than it holds.
struct Grow {
    t: Option<Tensor>,
    category: Category,
    dtype: DType,
}

impl Grow {
    fn new(category: Category) -> Self {
        Grow {
            t: None,
            category,
            dtype: DType::F32,
        }
    }
    /// Row indices.
    fn new_u32(category: Category) -> Self {
        Grow {
            t: None,
            category,
            dtype: DType::U32,
        }
    }
    /// At least `n` elements of `dtype` (the first `n` are the caller's to use): the rows'
    /// dtype, which is the same in every pass of a run.
    fn at_least_of(&mut self, be: &dyn Backend, n: usize, dtype: DType) -> &mut Tensor {
        if self.dtype != dtype {
            self.t = None;
            self.dtype = dtype;
        }
        self.at_least(be, n)
    }
    /// At least `n` elements (the first `n` are the caller's to use).
    fn at_least(&mut self, be: &dyn Backend, n: usize) -> &mut Tensor {
        if self.t.as_ref().is_none_or(|t| t.len() < n) {
            // Drop first, so the ledger's peak does not count both.
            self.t = None;
            self.t = Some(be.zeros_of(&[n], self.dtype, self.category));
        }
        self.t.as_mut().unwrap()
    }
    fn view(&self, n: usize) -> View<'_> {
        self.t.as_ref().expect("sized before use").slice(0, n)
    }
    fn view_mut(&mut self, n: usize) -> ViewMut<'_> {
        self.t.as_mut().expect("sized before use").slice_mut(0, n)
    }
}

/// The owner's copy of a layer's expert inputs and internals (expert-major rows), and the row
/// orders between the all-to-all's source-major rows and the experts' expert-major ones.
struct Kept {
    xe: Grow,
    g: Grow,
    u: Grow,
    a: Grow,
    /// `to_em[i]`: the source-major row that expert-major row `i` is; `to_sm` the inverse.
    to_em: Grow,
    to_sm: Grow,
}

impl Kept {
    fn new() -> Self {
        Kept {
            xe: Grow::new(Category::Activations),
            g: Grow::new(Category::Activations),
            u: Grow::new(Category::Activations),
            a: Grow::new(Category::Activations),
            to_em: Grow::new_u32(Category::Activations),
            to_sm: Grow::new_u32(Category::Activations),
        }
    }
}

/// What a layer's backward needs of its forward.
struct Saved {
    /// `recv[src][le]`: rows of local expert `le` received from ep rank `src`.
    recv: Vec<Vec<usize>>,
    /// Rows sent to each ep rank.
    send_rows: Vec<usize>,
    /// The capacity at the forward: the length of the views the experts get.
    cap: usize,
    bufs: Kept,
}

/// Scratch reused by every layer: all-to-all staging and the local experts' gradients.
struct Scratch {
    /// Rows as they travel (source-major): input gradients (f32), and the experts' inputs,
    /// outputs and output gradients while those are f32 too.
    wire: Grow,
    /// Expert outputs, then output gradients, while those are f32 (expert-major).
    y: Grow,
    /// Under bf16 rows (the block's dispatched inputs and output gradients in bf16, which the
    /// experts' GEMMs read as they are): those rows as they travel, and the output gradients
    /// expert-major; under bf16 GEMM outputs also the expert outputs, expert-major then as
    /// they travel. Unused with f32 rows.
    wire16: Grow,
    y16: Grow,
    da: Grow,
    dg: Grow,
    du: Grow,
    dxe: Grow,
}

pub struct EpExperts {
    ep: Arc<dyn ProcessGroup>,
    /// `parallelism.ep_capacity_factor`.
    factor: f64,
    /// Rows the buffers are sized for (0 before the first forward), and their use.
    rows: RowBufferUse,
    saved: HashMap<usize, Saved>,
    /// Buffer sets not holding any layer, for the next forward.
    free: Vec<Kept>,
    scratch: Scratch,
}

/// Counts of local experts and their offsets in expert-major order.
fn local_layout(recv: &[Vec<usize>]) -> (Vec<usize>, Vec<usize>) {
    let el = recv.first().map_or(0, |r| r.len());
    let counts: Vec<usize> = (0..el).map(|le| recv.iter().map(|r| r[le]).sum()).collect();
    let mut offsets = vec![0; el + 1];
    for le in 0..el {
        offsets[le + 1] = offsets[le] + counts[le];
    }
    (counts, offsets)
}

/// The row orders between source-major rows (as received: per source rank, its rows of each
/// local expert in order) and expert-major ones: `(to_em, to_sm)` with `to_em[i]` the
/// source-major row of expert-major row `i` and `to_sm` its inverse. Each reorder is then one
/// row gather on the backend (a kernel on a GPU, not a copy per source and expert).
fn row_orders(recv: &[Vec<usize>]) -> (Vec<u32>, Vec<u32>) {
    let (_, offsets) = local_layout(recv);
    let rows = offsets.last().copied().unwrap_or(0);
    let (mut to_em, mut to_sm) = (vec![0u32; rows], vec![0u32; rows]);
    let mut next = offsets;
    let mut pos = 0;
    for r in recv {
        for (le, &c) in r.iter().enumerate() {
            for j in 0..c {
                to_em[next[le] + j] = (pos + j) as u32;
                to_sm[pos + j] = (next[le] + j) as u32;
            }
            next[le] += c;
            pos += c;
        }
    }
    (to_em, to_sm)
}

impl EpExperts {
    pub fn new(ep: Arc<dyn ProcessGroup>, capacity_factor: f64) -> Self {
        EpExperts {
            ep,
            factor: capacity_factor,
            rows: RowBufferUse::default(),
            saved: HashMap::new(),
            free: Vec::new(),
            scratch: Scratch {
                wire: Grow::new(Category::Buffers),
                y: Grow::new(Category::Buffers),
                wire16: Grow::new(Category::Buffers),
                y16: Grow::new(Category::Buffers),
                da: Grow::new(Category::Buffers),
                dg: Grow::new(Category::Buffers),
                du: Grow::new(Category::Buffers),
                dxe: Grow::new(Category::Buffers),
            },
        }
    }
}

/// Uneven all-to-all over `ep` of rows of `w` elements, timed as communication on `be`.
#[allow(clippy::too_many_arguments)]
fn a2a(
    be: &dyn Backend,
    ep: &dyn ProcessGroup,
    send: View,
    send_rows: &[usize],
    recv: ViewMut,
    recv_rows: &[usize],
    w: usize,
    phase: Phase,
) -> Result<()> {
    let sc: Vec<usize> = send_rows.iter().map(|r| r * w).collect();
    let rc: Vec<usize> = recv_rows.iter().map(|r| r * w).collect();
    in_phase(be, StepPhase::Communication, || {
        ep.alltoallv(send, &sc, recv, &rc, phase)
    })
    .context("expert all-to-all")
}

impl ExpertExecutor for EpExperts {
    fn host_counts(&self) -> bool {
        // The all-to-all's sizes.
        true
    }
    fn forward(&mut self, be: &dyn Backend, io: &ExpertsIo, b: ExpertsFwdBufs) -> Result<()> {
        let (ep, h, f) = (self.ep.size(), io.h, io.f);
        let e = io.counts.len();
        let el = e / ep;
        // Per destination: its experts' counts (exchanged so owners know the layout). Routing
        // counts are control data the host holds anyway (they size the GEMMs).
        let cnt_send: Vec<f32> = io.counts.iter().map(|&n| n as f32).collect();
        let mut cnt_recv = vec![0f32; e];
        let per = vec![el; ep];
        in_phase(be, StepPhase::Communication, || {
            self.ep.alltoallv(
                View::Host(&cnt_send),
                &per,
                ViewMut::Host(&mut cnt_recv),
                &per,
                Phase::A2aDispatch,
            )
        })
        .context("exchanging expert counts")?;
        let recv: Vec<Vec<usize>> = cnt_recv
            .chunks(el)
            .map(|c| c.iter().map(|&x| x as usize).collect())
            .collect();
        let send_rows: Vec<usize> = io.counts.chunks(el).map(|c| c.iter().sum()).collect();
        let recv_rows: Vec<usize> = recv.iter().map(|r| r.iter().sum()).collect();
        let rows: usize = recv_rows.iter().sum();
        let sent = io.counts.iter().sum();
        let (base, most) = ganymede_config::ep_capacity_rows(ep, e, io.top_k, sent, self.factor);
        assert!(
            rows <= most,
            "expert parallelism: {rows} rows received, at most {most} possible"
        );
        let r = &mut self.rows;
        (r.capacity, r.even) = (r.capacity.max(base), sent);
        if rows > r.capacity {
            r.capacity = (rows + rows / 4).min(most);
            r.regrowths += 1;
        }
        r.peak = r.peak.max(rows);
        let cap = r.capacity;
        // A previous forward of this layer whose backward never came (an aborted step) frees
        // its set first.
        self.discard(io.layer);
        let mut k = self.free.pop().unwrap_or_else(Kept::new);
        let (xn, xc, fc) = (rows * h, cap * h, cap * f);
        let (to_em, to_sm) = row_orders(&recv);
        for (t, order) in [(&mut k.to_em, &to_em), (&mut k.to_sm, &to_sm)] {
            t.at_least(be, cap);
            be.write_u32(t.view_mut(rows), order);
        }
        // The rows travel and are kept in the block's dtype: bf16 rows stay bf16 (half the
        // all-to-all's bytes), and so do the SwiGLU products the down GEMM reads.
        let rows_dt = b.xe.dtype();
        let Scratch { wire, wire16, .. } = &mut self.scratch;
        let inbound = if rows_dt == DType::F32 { wire } else { wire16 };
        inbound.at_least_of(be, xc, rows_dt);
        let ep_g = self.ep.as_ref();
        a2a(
            be,
            ep_g,
            b.xe,
            &send_rows,
            inbound.view_mut(xn),
            &recv_rows,
            h,
            Phase::A2aDispatch,
        )?;
        k.xe.at_least_of(be, xc, rows_dt);
        be.moe_gather(k.xe.view_mut(xn), inbound.view(xn), k.to_em.view(rows), h);
        // Gate and up in the block's dtype for them: bf16 where the GEMMs write bf16 outputs.
        let out_dt = b.g.dtype();
        for g in [&mut k.g, &mut k.u] {
            g.at_least_of(be, fc, out_dt);
        }
        k.a.at_least_of(be, fc, rows_dt);
        // The outputs travel back in the block's dtype for them: bf16 where the down GEMM
        // writes bf16 (bf16 GEMM outputs), through the bf16 buffers, which the inputs have
        // left by now (they were gathered into `k.xe`).
        let ye_dt = b.ye.dtype();
        let Scratch {
            wire,
            y,
            wire16,
            y16,
            ..
        } = &mut self.scratch;
        let (out_wire, out_y) = match ye_dt {
            DType::F32 => (wire, y),
            _ => (wire16, y16),
        };
        out_wire.at_least_of(be, xc, ye_dt);
        out_y.at_least_of(be, xc, ye_dt);
        let (counts, offsets) = local_layout(&recv);
        let lio = io.on_host(&counts, &offsets);
        let Kept { xe, g, u, a, .. } = &mut k;
        LocalExperts.forward(
            be,
            &lio,
            ExpertsFwdBufs {
                xe: xe.view(xc),
                g: g.view_mut(fc),
                u: u.view_mut(fc),
                a: a.view_mut(fc),
                ye: out_y.view_mut(xc),
            },
        )?;
        be.moe_gather(out_wire.view_mut(xn), out_y.view(xn), k.to_sm.view(rows), h);
        a2a(
            be,
            ep_g,
            out_wire.view(xn),
            &recv_rows,
            b.ye,
            &send_rows,
            h,
            Phase::A2aCombine,
        )?;
        self.saved.insert(
            io.layer,
            Saved {
                recv,
                send_rows,
                cap,
                bufs: k,
            },
        );
        Ok(())
    }

    fn take_use(&mut self) -> Option<RowBufferUse> {
        let u = self.rows;
        (self.rows.peak, self.rows.regrowths) = (0, 0);
        Some(u)
    }

    fn discard(&mut self, layer: usize) {
        if let Some(s) = self.saved.remove(&layer) {
            self.free.push(s.bufs);
        }
    }

    fn backward(
        &mut self,
        be: &dyn Backend,
        io: &ExpertsIo,
        grads: &mut ParamStore,
        b: ExpertsBwdBufs,
    ) -> Result<()> {
        let (h, f) = (io.h, io.f);
        let s = self
            .saved
            .remove(&io.layer)
            .expect("expert-parallel backward without its forward");
        let recv_rows: Vec<usize> = s.recv.iter().map(|r| r.iter().sum()).collect();
        let rows: usize = recv_rows.iter().sum();
        let (xn, (xc, fc)) = (rows * h, (s.cap * h, s.cap * f));
        let ep_g = self.ep.as_ref();
        let Scratch {
            wire,
            y,
            wire16,
            y16,
            da,
            dg,
            du,
            dxe,
        } = &mut self.scratch;
        wire.at_least(be, xc);
        // Output gradients travel to the owners (the combine's backward), in the rows' dtype
        // as the inputs did.
        let rows_dt = b.dye.dtype();
        let (inbound, dy) = match rows_dt {
            DType::F32 => (&mut *wire, &mut *y),
            _ => (&mut *wire16, &mut *y16),
        };
        inbound.at_least_of(be, xc, rows_dt);
        dy.at_least_of(be, xc, rows_dt);
        a2a(
            be,
            ep_g,
            b.dye,
            &s.send_rows,
            inbound.view_mut(xn),
            &recv_rows,
            h,
            Phase::A2aCombine,
        )?;
        be.moe_gather(
            dy.view_mut(xn),
            inbound.view(xn),
            s.bufs.to_em.view(rows),
            h,
        );
        da.at_least_of(be, fc, b.da.dtype());
        for t in [&mut *dg, &mut *du] {
            t.at_least_of(be, fc, rows_dt);
        }
        dxe.at_least(be, xc);
        let (counts, offsets) = local_layout(&s.recv);
        let lio = io.on_host(&counts, &offsets);
        let k = &s.bufs;
        LocalExperts.backward(
            be,
            &lio,
            grads,
            ExpertsBwdBufs {
                xe: k.xe.view(xc),
                g: k.g.view(fc),
                u: k.u.view(fc),
                a: k.a.view(fc),
                dye: dy.view(xc),
                da: da.view_mut(fc),
                dg: dg.view_mut(fc),
                du: du.view_mut(fc),
                dxe: dxe.view_mut(xc),
            },
        )?;
        // Input gradients travel back (the dispatch's backward).
        be.moe_gather(wire.view_mut(xn), dxe.view(xn), s.bufs.to_sm.view(rows), h);
        a2a(
            be,
            ep_g,
            wire.view(xn),
            &recv_rows,
            b.dxe,
            &s.send_rows,
            h,
            Phase::A2aDispatch,
        )?;
        self.free.push(s.bufs);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::row_orders;

    /// Two sources, two local experts: source 0 sends 2 rows of expert 0 and 1 of expert 1,
    /// source 1 sends 1 of expert 0 and 2 of expert 1. Expert-major: expert 0's rows from
    /// source 0 (rows 0, 1) then source 1 (row 3), then expert 1's (rows 2, 4, 5).
    #[test]
    fn row_orders_are_a_permutation_and_its_inverse() {
        let (to_em, to_sm) = row_orders(&[vec![2, 1], vec![1, 2]]);
        assert_eq!(to_em, vec![0, 1, 3, 2, 4, 5]);
        for (i, &s) in to_em.iter().enumerate() {
            assert_eq!(to_sm[s as usize] as usize, i);
        }
        assert_eq!(row_orders(&[vec![0, 0], vec![0, 0]]), (vec![], vec![]));
    }
}
