//! Expert parallelism: the routed experts are split over the `ep` group (group rank `e` holds
//! experts `e·E/ep .. (e+1)·E/ep`, the local slice FSDP gathers over the expert-FSDP group).
//! The block hands over its rows grouped by expert; rows for another rank's experts are
//! contiguous, so one uneven all-to-all sends each rank its rows. The owner reorders what it
//! received expert-major, runs its experts with the local executor, and the outputs travel back
//! the same way. Backward mirrors it: output gradients out, input gradients back, weight
//! gradients accumulated on the owner.

use ganymede_core::{Backend, ParamStore, TMut, T};
use ganymede_dist::{Phase, ProcessGroup};
use ganymede_model::{ExpertExecutor, ExpertsBwdBufs, ExpertsFwdBufs, ExpertsIo, LocalExperts};
use std::collections::HashMap;
use std::sync::Arc;

/// What the owner keeps of a layer's forward for its backward (expert-major rows).
#[derive(Default)]
struct Saved {
    /// `recv[src][le]`: rows of local expert `le` received from ep rank `src`.
    recv: Vec<Vec<usize>>,
    /// Rows sent to each ep rank.
    send_rows: Vec<usize>,
    xe: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    a: Vec<f32>,
}

pub struct EpExperts {
    ep: Arc<dyn ProcessGroup>,
    saved: HashMap<usize, Saved>,
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    panic!("{what}: {e}")
}

impl EpExperts {
    pub fn new(ep: Arc<dyn ProcessGroup>) -> Self {
        EpExperts {
            ep,
            saved: HashMap::new(),
        }
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

    /// Source-major (as received: per src, its experts in order) to expert-major, `w` per row.
    fn to_expert_major(recv: &[Vec<usize>], x: &[f32], w: usize) -> Vec<f32> {
        let (_, offsets) = Self::local_layout(recv);
        let mut out = vec![0f32; x.len()];
        let mut next = offsets.clone();
        let mut pos = 0;
        for r in recv {
            for (le, &c) in r.iter().enumerate() {
                let n = c * w;
                out[next[le] * w..next[le] * w + n].copy_from_slice(&x[pos..pos + n]);
                next[le] += c;
                pos += n;
            }
        }
        out
    }

    fn to_source_major(recv: &[Vec<usize>], x: &[f32], w: usize) -> Vec<f32> {
        let (_, offsets) = Self::local_layout(recv);
        let mut out = vec![0f32; x.len()];
        let mut next = offsets.clone();
        let mut pos = 0;
        for r in recv {
            for (le, &c) in r.iter().enumerate() {
                let n = c * w;
                out[pos..pos + n].copy_from_slice(&x[next[le] * w..next[le] * w + n]);
                next[le] += c;
                pos += n;
            }
        }
        out
    }

    fn a2a(
        &self,
        send: &[f32],
        send_rows: &[usize],
        recv_rows: &[usize],
        w: usize,
        phase: Phase,
    ) -> Vec<f32> {
        let sc: Vec<usize> = send_rows.iter().map(|r| r * w).collect();
        let rc: Vec<usize> = recv_rows.iter().map(|r| r * w).collect();
        let mut out = vec![0f32; rc.iter().sum()];
        self.ep
            .alltoallv(T::Host(send), &sc, TMut::Host(&mut out), &rc, phase)
            .unwrap_or_else(|e| fail("expert all-to-all", e));
        out
    }
}

impl ExpertExecutor for EpExperts {
    fn forward(&mut self, be: &dyn Backend, io: &ExpertsIo, b: ExpertsFwdBufs) {
        let (ep, h, f) = (self.ep.size(), io.h, io.f);
        let e = io.counts.len();
        let el = e / ep;
        // Per destination: its experts' counts (exchanged so owners know the layout).
        let mut cnt_send = vec![0f32; e];
        for (c, &n) in cnt_send.iter_mut().zip(io.counts) {
            *c = n as f32;
        }
        let mut cnt_recv = vec![0f32; e];
        let per = vec![el; ep];
        self.ep
            .alltoallv(
                T::Host(&cnt_send),
                &per,
                TMut::Host(&mut cnt_recv),
                &per,
                Phase::A2aDispatch,
            )
            .unwrap_or_else(|err| fail("exchanging expert counts", err));
        let recv: Vec<Vec<usize>> = cnt_recv
            .chunks(el)
            .map(|c| c.iter().map(|&x| x as usize).collect())
            .collect();
        let send_rows: Vec<usize> = io.counts.chunks(el).map(|c| c.iter().sum()).collect();
        let recv_rows: Vec<usize> = recv.iter().map(|r| r.iter().sum()).collect();
        let xe_host = b.xe.host::<f32>();
        let xe_src = self.a2a(xe_host, &send_rows, &recv_rows, h, Phase::A2aDispatch);
        let xe = Self::to_expert_major(&recv, &xe_src, h);
        let rows: usize = recv_rows.iter().sum();
        let (counts, offsets) = Self::local_layout(&recv);
        let mut s = Saved {
            recv: recv.clone(),
            send_rows: send_rows.clone(),
            g: vec![0f32; rows * f],
            u: vec![0f32; rows * f],
            a: vec![0f32; rows * f],
            xe,
        };
        let mut ye = vec![0f32; rows * h];
        let lio = ExpertsIo {
            counts: &counts,
            offsets: &offsets,
            ..*io
        };
        LocalExperts.forward(
            be,
            &lio,
            ExpertsFwdBufs {
                xe: T::Host(&s.xe),
                g: TMut::Host(&mut s.g),
                u: TMut::Host(&mut s.u),
                a: TMut::Host(&mut s.a),
                ye: TMut::Host(&mut ye),
            },
        );
        let ye_src = Self::to_source_major(&recv, &ye, h);
        let back = self.a2a(&ye_src, &recv_rows, &send_rows, h, Phase::A2aCombine);
        b.ye.host::<f32>().copy_from_slice(&back);
        self.saved.insert(io.layer, s);
    }

    fn backward(
        &mut self,
        be: &dyn Backend,
        io: &ExpertsIo,
        grads: &mut ParamStore,
        b: ExpertsBwdBufs,
    ) {
        let h = io.h;
        let s = self
            .saved
            .remove(&io.layer)
            .expect("expert-parallel backward without its forward");
        let recv_rows: Vec<usize> = s.recv.iter().map(|r| r.iter().sum()).collect();
        let rows: usize = recv_rows.iter().sum();
        let f = io.f;
        // Output gradients travel to the owners (the combine's backward).
        let dye_src = self.a2a(
            b.dye.host::<f32>(),
            &s.send_rows,
            &recv_rows,
            h,
            Phase::A2aCombine,
        );
        let dye = Self::to_expert_major(&s.recv, &dye_src, h);
        let (counts, offsets) = Self::local_layout(&s.recv);
        let lio = ExpertsIo {
            counts: &counts,
            offsets: &offsets,
            ..*io
        };
        let (mut da, mut dg, mut du) = (
            vec![0f32; rows * f],
            vec![0f32; rows * f],
            vec![0f32; rows * f],
        );
        let mut dxe = vec![0f32; rows * h];
        LocalExperts.backward(
            be,
            &lio,
            grads,
            ExpertsBwdBufs {
                xe: T::Host(&s.xe),
                g: T::Host(&s.g),
                u: T::Host(&s.u),
                a: T::Host(&s.a),
                dye: T::Host(&dye),
                da: TMut::Host(&mut da),
                dg: TMut::Host(&mut dg),
                du: TMut::Host(&mut du),
                dxe: TMut::Host(&mut dxe),
            },
        );
        // Input gradients travel back (the dispatch's backward).
        let dxe_src = Self::to_source_major(&s.recv, &dxe, h);
        let back = self.a2a(&dxe_src, &recv_rows, &s.send_rows, h, Phase::A2aDispatch);
        b.dxe.host::<f32>().copy_from_slice(&back);
    }
}
