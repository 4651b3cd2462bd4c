//! The head a chunk of tokens at a time (`training.loss_chunk_tokens`): the same loss and
//! gradients as all tokens at once, up to summation order, from a logits buffer of one chunk.

use crate::*;
use ganymede_config::{preset, AcMode, ComputeDtype};

/// One step of `tiny` (batch 2 × 32 = 64 tokens) with a loss chunk of `chunk` tokens: the
/// step's output, the gradients, a forward alone's loss and the logits buffer's length.
fn step(chunk: usize, compute: ComputeDtype) -> (StepOutput, Vec<Vec<f32>>, f64, usize) {
    let model = Model::new(&preset("tiny").unwrap().model)
        .with_compute_dtype(compute)
        .with_loss_chunk(chunk);
    let (o, g, e, ws) = super::tiny_step(&model, AcMode::Full);
    (o, g, e, ws.head.logits.len())
}

#[test]
fn a_chunked_head_gives_the_loss_and_gradients_of_the_whole() {
    let v = preset("tiny").unwrap().model.vocab_size;
    for compute in [ComputeDtype::F32, ComputeDtype::Bf16] {
        let (o, g, e, len) = step(0, compute);
        assert_eq!(len, 64 * v, "no chunk: every token's logits");
        // 64 tokens: chunks that divide them, one that leaves a short last chunk, one longer
        // than the batch (the whole).
        for chunk in [16, 24, 64, 1000] {
            let (oc, gc, ec, lc) = step(chunk, compute);
            assert_eq!(lc, chunk.min(64) * v, "{chunk}: logits held");
            let at = format!("{compute:?}, chunk {chunk}");
            assert!(
                (oc.loss - o.loss).abs() <= 1e-12 * o.loss,
                "{at}: {} vs {}",
                oc.loss,
                o.loss
            );
            assert!(
                (ec - e).abs() <= 1e-12 * e,
                "{at}: forward alone {ec} vs {e}"
            );
            // Only the LM head's weight gradient sums over chunks in another order.
            let d = super::max_rel(&gc, &g);
            eprintln!("{at}: gradients within {d:.1e} of the largest");
            assert!(d < 1e-5, "{at}: gradients differ by {d:e} of the largest");
            if chunk >= 64 {
                assert_eq!(gc, g, "{at}: one chunk is the unchunked head, bitwise");
            }
        }
    }
}
