//! The sizing rules the planner and the runtime share: offloaded layers, the head's and the
//! MoE layer's rows, the staging ring, batched Newton–Schulz memory, expert-parallel capacity.

/// Layers whose boundary activation goes to host memory at `fraction` of `layers`: the nearest
/// whole layer. The one rule the planner and the runtime share, chosen so that a fraction printed
/// with three decimals (`n / layers` rounded) maps back to the same `n` for any `layers` < 1000.
pub fn offloaded_layers(fraction: f64, layers: usize) -> usize {
    ((fraction.clamp(0.0, 1.0) * layers as f64).round() as usize).min(layers)
}

/// Rows of logits the head holds for `tokens` of a rank's tokens under
/// `training.loss_chunk_tokens` = `chunk` (0 = all). The rule the planner and the runtime share.
pub fn head_rows(tokens: usize, chunk: usize) -> usize {
    if chunk == 0 {
        tokens
    } else {
        chunk.min(tokens)
    }
}

/// Pinned slots of a GPU backend's staging ring, through which the step's small u32 and f64
/// writes reach the device without a host wait. The one rule the CUDA backend and the planner
/// share: every slot grows to [`staging_slot_bytes`] of the largest write staged so far
/// (writes above [`STAGING_MAX_BYTES`] are not staged).
pub const STAGING_SLOTS: usize = 32;
/// The largest write that is staged.
pub const STAGING_MAX_BYTES: usize = 1 << 20;
/// A staging slot's bytes once the largest write staged was `bytes`.
pub fn staging_slot_bytes(bytes: usize) -> usize {
    bytes.next_power_of_two().max(4096)
}

/// Bytes of f32 working memory a batched Newton–Schulz (a GPU's, `Blas::batches_matrices`)
/// may take for one expert stack at a time: the Nesterov output, two `s²` and one `s·l` per
/// matrix. 256 MiB holds `medium`'s 64 experts of 512 × 1,024 in two batches.
pub const NS_STACK_BYTES: usize = 256 << 20;

/// Matrices of a stack of `count` `rows × cols` ones that a batched Newton–Schulz takes at
/// once within `budget` bytes ([`NS_STACK_BYTES`] in training): as many as fit, at least one.
/// The one rule the optimizer and the planner share.
pub fn ns_stack_batch(rows: usize, cols: usize, count: usize, budget: usize) -> usize {
    let (s, l) = (rows.min(cols), rows.max(cols));
    let per = 4 * (rows * cols + 2 * s * s + s * l);
    (budget / per.max(1)).clamp(1, count.max(1))
}

/// Elements of batched Newton–Schulz's working memory over `stacks` (`rows, cols, count`; those
/// of `count > 1` in batches of [`ns_stack_batch`] within `budget` bytes): the largest batch's
/// Nesterov copies (one process makes the update there), `s²` (each of A and B) and `s·l` (the
/// ping-pong copy). The one rule the optimizers and the planner share.
pub fn ns_batch_elems(stacks: &[(usize, usize, usize)], budget: usize) -> (usize, usize, usize) {
    let (mut u, mut ss, mut sl) = (0, 0, 0);
    for &(r, c, count) in stacks.iter().filter(|s| s.2 > 1) {
        let b = ns_stack_batch(r, c, count, budget);
        let (s, l) = (r.min(c), r.max(c));
        u = u.max(b * r * c);
        ss = ss.max(b * s * s);
        sl = sl.max(b * s * l);
    }
    (u, ss, sl)
}

/// Tokens a MoE layer's routed experts take at once for `tokens` of a rank's tokens under
/// `training.moe_chunk_tokens` = `chunk` (0 = all): the same rule as the head's.
pub fn moe_rows(tokens: usize, chunk: usize) -> usize {
    head_rows(tokens, chunk)
}

/// Expert parallelism: (capacity, most) rows of one layer that a rank's `experts / ep` local
/// experts are sized for. Every rank holds as many tokens as this one, which sends `sent` rows,
/// `top_k` per token; under an even routing it receives as many. Each token picks `top_k`
/// distinct experts, so at most min(top_k, local experts) of a token's rows come here, from
/// each of the `ep` ranks: the most, up to `ep` times the even rows. The capacity is
/// `parallelism.ep_capacity_factor` = `factor` times the even rows, within the most. The rule
/// the planner and the runtime share.
pub fn ep_capacity_rows(
    ep: usize,
    experts: usize,
    top_k: usize,
    sent: usize,
    factor: f64,
) -> (usize, usize) {
    let most = ep * (sent / top_k.max(1)) * top_k.min(experts / ep.max(1));
    (((sent as f64 * factor).ceil() as usize).min(most), most)
}
