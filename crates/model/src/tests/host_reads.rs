//! What a step reads back from the device, counted by `ganymede_core::counting::CountingReads`
//! around the CPU backend: a read slipped into the step shows up as a failing count.

use crate::*;
use ganymede_config::{preset, AcMode};
use ganymede_core::counting::CountingReads;
use ganymede_core::{Category, CpuBackend, DType, ParamStore};

/// One training step of `tiny` (two MoE layers, 8 experts) on a backend whose expert GEMMs
/// read their rows' offsets in device memory reads back nothing but, at its end, the `[2 × 8]`
/// routing sums and counts and the one loss sum, and no `sumsq`, with the MoE layers' tokens
/// in one chunk or two. On a backend that takes host sizes it reads each MoE layer's `[8]`
/// counts after each dispatch too (forward, the backward's recompute under full
/// checkpointing, and a chunk's dispatch again in backward). An evaluation step does the same
/// without the backward. Both give the same losses.
#[test]
fn a_step_reads_back_only_its_metrics_where_the_expert_gemms_read_device_offsets() {
    let c = preset("tiny").unwrap().model;
    let (batch, seq) = (2, 16);
    let inputs = (0..batch * seq).map(|i| (i * 7 % c.vocab_size) as u32);
    let inputs: Vec<u32> = inputs.collect();
    let targets: Vec<u32> = inputs
        .iter()
        .map(|&t| (t + 1) % c.vocab_size as u32)
        .collect();
    let tokens = Tokens {
        inputs: &inputs,
        targets: &targets,
        doc_starts: None,
    };
    let counts = (DType::U32, c.experts);
    let end = [
        (DType::F64, 2 * c.experts),
        (DType::F64, 2 * c.experts),
        (DType::F64, 1),
    ];
    let n = batch * seq;
    for chunk in [0, n / 2] {
        let parts = if chunk == 0 { 1 } else { 2 };
        let mut losses = vec![];
        for on_device in [false, true] {
            let mut be = CountingReads::new(CpuBackend::default());
            be.experts_on_device = Some(on_device);
            let model = Model::new(&c).with_moe_chunk(chunk);
            let params = model.init_params(&be, 3);
            for (mode, recompute) in [(AcMode::Full, 1), (AcMode::None, 0)] {
                let mut ws = Workspace::new(&be, &model, batch, seq, mode);
                let mut grads = ParamStore::zeros(&be, model.param_specs(), Category::Grads);
                be.take();
                let out = forward_backward(&be, &model, &params, &mut grads, &mut ws, tokens, 1.0);
                // Per MoE layer: the forward's chunks, the recompute's, and every chunk but
                // the last again in backward.
                let reads = 2 * (parts * (1 + recompute) + parts - 1);
                let mut want = vec![counts; if on_device { 0 } else { reads }];
                want.extend(end);
                let what = format!("{mode:?}, on device {on_device}, {parts} chunk(s)");
                assert_eq!(be.take(), want, "{what}");
                let eval = forward_loss(&be, &model, &params, &mut ws, tokens);
                let want = vec![counts; if on_device { 0 } else { 2 * parts }];
                assert_eq!(be.take(), [want, end.to_vec()].concat(), "{what}");
                losses.push((out.loss, out.aux_loss, eval.loss, eval.aux_loss));
            }
            assert_eq!(be.sumsqs(), 0);
        }
        assert!(losses.windows(2).all(|w| w[0] == w[1]), "{losses:?}");
        assert!(losses[0].1 > 0.0, "an auxiliary loss to compare");
    }
}
