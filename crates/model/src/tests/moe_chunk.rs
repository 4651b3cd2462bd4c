//! A MoE layer's routed experts a chunk of tokens at a time (`training.moe_chunk_tokens`): the
//! gradients against finite differences, the same loss and gradients as all tokens at once up to
//! summation order, bitwise the same at one chunk, and expert buffers of one chunk's rows.

use crate::*;
use ganymede_config::{preset, AcMode, ComputeDtype};

/// Finite differences in f64 through chunked MoE layers: 10 tokens in chunks of 4, 4 and 2
/// (a short last chunk), with a dense first layer, shared experts and renormalised weights, and
/// with the selection bias; both checkpointing modes (`none` recomputes every chunk but the
/// last in backward, `full` recomputes the layer and then the same).
#[test]
fn chunked_moe_gradients_match_finite_differences() {
    for (dense, shared, renorm, bias) in [(true, true, true, false), (false, false, false, true)] {
        let cfg = super::cfg(dense, shared, renorm, bias);
        let model = Model::new(&cfg).with_moe_chunk(4);
        assert_eq!(model.moe_rows(10), 4);
        super::grad_check_of(&model, AcMode::None);
        super::grad_check_of(&model, AcMode::Full);
    }
}

#[test]
fn chunked_moe_gives_the_loss_and_gradients_of_the_whole() {
    let c = preset("tiny").unwrap().model;
    let (k, h, f) = (c.top_k, c.hidden, c.expert_hidden);
    let at = |chunk, compute| {
        Model::new(&c)
            .with_compute_dtype(compute)
            .with_moe_chunk(chunk)
    };
    for compute in [ComputeDtype::F32, ComputeDtype::Bf16] {
        for mode in [AcMode::Full, AcMode::None] {
            let (o, g, e, ws) = super::tiny_step(&at(0, compute), mode);
            let whole = ws.bytes();
            // 64 tokens: chunks that divide them, one that leaves a short last chunk, one
            // longer than the batch (the whole).
            for chunk in [16, 24, 64, 1000] {
                let (oc, gc, ec, wc) = super::tiny_step(&at(chunk, compute), mode);
                let what = format!("{compute:?}, {mode:?}, chunk {chunk}");
                let rows = chunk.min(64) * k;
                let m = wc.blocks[0].moe.as_ref().unwrap();
                assert_eq!(m.xe.len(), rows * h, "{what}: dispatched rows held");
                assert_eq!(m.g.len(), rows * f, "{what}: expert internals held");
                let dg = wc.grads.dg.as_ref().unwrap();
                assert_eq!(dg.len(), rows * f, "{what}: expert gradient scratch");
                // Per MoE set (one under `full`, one per layer under `none`) and the scratch,
                // each 2kH + 3kF per chunk token instead of per token, 4 bytes an element but
                // 2 for bf16 rows and outputs: a set's dispatched inputs, gate, up, SwiGLU
                // products and outputs (2kH + 3kF), the scratch's output, SwiGLU product, gate
                // and up gradients (kH + 3kF).
                let (set, scratch) = match compute {
                    ComputeDtype::Bf16 => (4 * h + 6 * f, 6 * h + 6 * f),
                    _ => (8 * h + 12 * f, 8 * h + 12 * f),
                };
                let per_row = wc.blocks.len() * set + scratch;
                let saved = ((64 - chunk.min(64)) * k * per_row) as u64;
                assert_eq!(whole - wc.bytes(), saved, "{what}: bytes saved");
                // The same per-token computation in a different grouping: only the weight
                // gradients' sums over tokens are ordered differently.
                assert!(
                    (oc.loss - o.loss).abs() <= 1e-9 * o.loss,
                    "{what}: {} vs {}",
                    oc.loss,
                    o.loss
                );
                assert!(
                    (ec - e).abs() <= 1e-9 * e,
                    "{what}: forward alone {ec} vs {e}"
                );
                assert_eq!(oc.expert_load, o.expert_load, "{what}: routing");
                let d = super::max_rel(&gc, &g);
                eprintln!(
                    "{what}: loss {:.1e} relative, gradients within {d:.1e} of the largest",
                    (oc.loss - o.loss).abs() / o.loss
                );
                assert!(d < 1e-6, "{what}: gradients differ by {d:e} of the largest");
                if chunk >= 64 {
                    assert_eq!(gc, g, "{what}: one chunk is the unchunked layer, bitwise");
                    assert_eq!(oc.loss, o.loss, "{what}: bitwise loss");
                }
            }
        }
    }
}
