//! `training.compute_dtype = "bf16"`: bf16 × bf16 → f32 GEMMs over f32 master state. Tracks the
//! f32 run closely without being it (attention on bf16 q/k/v included), matches itself across
//! ranks, allocates nothing after the first step, keeps attention's activations in bf16 as the
//! planner says, and hands the GEMM weights to the model in bf16 (cast once per step or gather)
//! with the same losses, to the bit, as casting them in every GEMM.

use ganymede_config::JobConfig;
use ganymede_core::Category;
use ganymede_data::Dataset;
use ganymede_dist::{run_threads, ThreadsConfig};
use ganymede_model::Model;
use ganymede_parallel::RankState;

mod common;
use common::{allocs_after_first_step, max_rel, tiny};

fn losses(cfg: &JobConfig, ranks: usize, name: &str) -> Vec<f64> {
    common::losses(cfg, ranks, "gm-bf16", name)
}

const BF16: &str = "training.compute_dtype=bf16";

/// bf16 operands perturb each GEMM (and attention, on bf16 q/k/v with a bf16 output and bf16
/// gradients) by ~2^-9 relative per operand; over 20 steps of `tiny` the loss moves by at most
/// 3.4e-4 of itself with bf16 boundaries and bf16 GEMM outputs, the defaults (x86-64 with
/// AVX-512; 8.7e-4 with bf16 gate/up but f32 expert outputs; 7.3e-4 with f32 outputs, measured
/// on x86-64 with AVX2; 7.7e-4
/// with f32 boundaries after Newton–Schulz's polynomial was rewritten and row sums moved to
/// eight lanes, 5.4e-4 before, 3.9e-4 when attention ran in f32), held to 5e-3. Leaving dk in f32 staging unconverted (a stale buffer) shows as 8.8e-2.
#[test]
fn bf16_compute_tracks_f32_losses() {
    let steps = 20;
    let f = losses(&tiny(steps, &[]), 0, "f32");
    let b = losses(&tiny(steps, &[BF16]), 0, "bf16");
    let rel = max_rel(&b, &f);
    println!("bf16 vs f32 compute, {steps} steps: max relative loss gap {rel:e}");
    println!("f32  {:?}\nbf16 {:?}", f, b);
    assert_ne!(b, f, "bf16 compute must not be the f32 run");
    assert!(rel > 0.0 && rel < 5e-3, "bf16 vs f32: relative gap {rel:e}");
    // Both learn: the last loss is well below the first.
    assert!(b[steps - 1] < 0.9 * b[0], "{b:?}");
}

/// bf16 boundaries (bf16 compute's default) against f32 ones: rounding the residual stream
/// between blocks moves the losses (so it happens) by less than bf16 compute itself moves them
/// (3.4e-4, but 8.7e-4 in an earlier layout): over 20 steps of `tiny` (x86-64, AVX-512) at most
/// 4.8e-4 relative at f32 compute and 2.1e-4 at bf16 compute (8.3e-4 with f32 expert outputs,
/// 6.4e-4 with f32 GEMM outputs on AVX2), held to 5e-3.
#[test]
fn bf16_boundaries_track_f32_boundaries() {
    let steps = 20;
    for compute in ["f32", "bf16"] {
        let c = format!("training.compute_dtype={compute}");
        let f = losses(
            &tiny(steps, &[&c, "activation_checkpoint.boundary_dtype=f32"]),
            0,
            &format!("{compute}-b32"),
        );
        let b = losses(
            &tiny(steps, &[&c, "activation_checkpoint.boundary_dtype=bf16"]),
            0,
            &format!("{compute}-b16"),
        );
        let rel = max_rel(&b, &f);
        println!("{compute} compute, bf16 vs f32 boundaries, {steps} steps: max relative loss gap {rel:e}");
        assert_ne!(b, f, "{compute}: the boundaries were not rounded");
        assert!(rel > 0.0 && rel < 5e-3, "{compute}: relative gap {rel:e}");
    }
}

/// Across ranks only f32 summation orders differ (reduce-scatter, routing statistics), but a
/// value one ulp apart can round to a different bf16, so the bound is looser than f32's 1e-6:
/// measured 1.9e-5 (4 ranks) and 2.7e-5 (ep 2) relative over 10 steps with bf16 boundaries and
/// GEMM outputs (3.3e-5 and 2.5e-5 with f32 expert outputs, 1.9e-5 and 3.1e-5 with f32 outputs; 2.4e-5 and 2.0e-5 with f32 boundaries,
/// 1.2e-5 and 1.4e-5 with f32 attention too), held to 5e-4.
#[test]
fn bf16_compute_across_ranks_matches_one_process() {
    let steps = 10;
    let one = losses(&tiny(steps, &[BF16]), 0, "one");
    let fsdp = losses(&tiny(steps, &[BF16]), 4, "fsdp4");
    let rel = max_rel(&fsdp, &one);
    println!("bf16, 4 FSDP ranks vs one process: max relative loss gap {rel:e}");
    assert!(rel < 5e-4, "4 ranks: {rel:e}");
    let ep = tiny(steps, &[BF16, "parallelism.dp_shard=4", "parallelism.ep=2"]);
    let rel = max_rel(&losses(&ep, 4, "ep2"), &one);
    println!("bf16, dp_shard 4 ep 2 vs one process: max relative loss gap {rel:e}");
    assert!(rel < 5e-4, "ep 2: {rel:e}");
}

/// The cast scratch is made in the first step and reused: later steps allocate nothing, and
/// it is on the ledger as buffers (more buffer bytes than the f32 run).
#[test]
fn a_bf16_step_after_the_first_allocates_nothing() {
    for ranks in [1, 2] {
        let cfg = tiny(4, &[BF16, "parallelism.gather_dtype=bf16"]);
        assert_eq!(
            allocs_after_first_step(&cfg, ranks),
            vec![0; ranks],
            "{ranks} ranks"
        );
    }
}

/// The cast scratch is on the ledger as buffers, and the planner predicts its bytes (the
/// bf16 run with f32 weights, so that the scratch is the only difference).
#[test]
fn the_planner_predicts_the_cast_scratch() {
    for ranks in [1, 2] {
        let f = tiny(2, &[]);
        let b = tiny(2, &[BF16]);
        let mut local = b.clone();
        local.training.batch_size /= ranks;
        let peak = |cfg: &JobConfig| bf16_weight_run(cfg, ranks, false).1 as f64;
        let measured = peak(&b) - peak(&f);
        let predicted = ganymede_plan::ledger::bf16_gemm_scratch(&local);
        println!("{ranks} ranks: cast scratch {measured} bytes, predicted {predicted}");
        assert!(measured > 0.0, "no scratch on the ledger");
        assert_eq!(measured, predicted, "{ranks} ranks");
    }
}

/// Losses of `steps` steps and the validation loss after them, on `ranks` thread ranks, with
/// the GEMM weights handed to the model in bf16 (`bf16_weights`) or in f32, each GEMM casting
/// them (the reference); and rank 0's peak buffer bytes.
fn bf16_weight_run(cfg: &JobConfig, ranks: usize, bf16_weights: bool) -> (Vec<f64>, u64) {
    let mut cfg = cfg.clone();
    if cfg.parallelism.ep == 1 {
        cfg.parallelism.dp_shard = ranks;
    }
    let m = &cfg.model;
    let data = Dataset::build(&cfg.data, m.vocab_size, m.seq_len, cfg.training.seed, None).unwrap();
    run_threads(ranks, &ThreadsConfig::default(), |world| {
        let mut st = match bf16_weights {
            true => RankState::new(world, &cfg).unwrap(),
            false => RankState::new_with_f32_weights(world, &cfg).unwrap(),
        };
        let mut out: Vec<f64> = (0..cfg.training.steps)
            .map(|s| st.step(&data, s).unwrap().loss)
            .collect();
        out.push(st.validate(&data, None).unwrap());
        let dev = st.be.device();
        let peak = st.be.ledger().report().peak(dev, Category::Buffers);
        (out, peak)
    })
    .into_iter()
    .next()
    .unwrap()
    .unwrap()
}

/// bf16 weights (a bf16 compute copy at one rank, bf16 gathered weights under FSDP) give the
/// losses of casting the f32 weights in each GEMM bit for bit: bf16 → f32 is exact, and the
/// f32 → bf16 cast is the same rounding wherever it happens. At one rank, at 4 FSDP ranks with
/// f32 and bf16 gathers, and with expert parallelism 2.
#[test]
fn bf16_weights_give_the_losses_of_casting_in_every_gemm() {
    let steps = 4;
    let cases: [(usize, &[&str]); 4] = [
        (1, &[BF16]),
        (4, &[BF16]),
        (4, &[BF16, "parallelism.gather_dtype=bf16"]),
        (4, &[BF16, "parallelism.dp_shard=4", "parallelism.ep=2"]),
    ];
    for (ranks, sets) in cases {
        let cfg = tiny(steps, sets);
        let (new, _) = bf16_weight_run(&cfg, ranks, true);
        let (old, _) = bf16_weight_run(&cfg, ranks, false);
        println!("{ranks} ranks {sets:?}: losses then val loss {new:?}");
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&new),
            bits(&old),
            "{ranks} ranks {sets:?}: {new:?} vs {old:?}"
        );
    }
}

/// The bf16 weights on the ledger: at one rank a bf16 compute copy, 2 bytes per bf16-weight
/// element (the GEMM weights and the embedding) on top of the per-GEMM path. Under FSDP
/// (`tiny`'s rows all split evenly over 2 ranks) a parameter gathered in the dtype the model
/// reads is gathered straight into the tensor the model reads; the others go through a receive
/// buffer in the gather's dtype and a copy or cast. A block's parameters have a receive buffer
/// each, in each of `prefetch + 1` slots; the root's gathers, one after another, share one
/// sized for the largest, and the embedding and LM head take turns in one tensor. The difference between the two runs follows from that rule alone,
/// and the measured buffer peak equals the planner's to the byte.
#[test]
fn bf16_weights_on_the_ledger_equal_the_planner() {
    for (ranks, gather) in [(1, "f32"), (2, "f32"), (2, "bf16")] {
        let gather = format!("parallelism.gather_dtype={gather}");
        let mut cfg = tiny(2, &[BF16, &gather]);
        cfg.parallelism.dp_shard = ranks;
        let (_, new) = bf16_weight_run(&cfg, ranks, true);
        let (_, old) = bf16_weight_run(&cfg, ranks, false);
        let model = Model::new(&cfg.model).with_compute_dtype(cfg.training.compute_dtype);
        let specs = model.param_specs();
        let weights = |keep: &dyn Fn(&str) -> bool| -> i64 {
            (0..specs.len())
                .filter(|&i| model.bf16_weight(i) && keep(&specs[i].name))
                .map(|i| specs[i].numel() as i64)
                .sum()
        };
        let (delta, expected) = if ranks == 1 {
            (new as i64 - old as i64, 2 * weights(&|_| true))
        } else {
            // (unsharded bytes, receive buffer bytes) of parameter i, in bf16 or f32.
            let g16 = gather.ends_with("bf16");
            let held = |i: usize, half: bool| {
                let n = specs[i].numel() as i64;
                let model_bytes = if half { 2 } else { 4 };
                match g16 == half {
                    true => (model_bytes * n, 0),
                    false => (model_bytes * n, if g16 { 2 * n } else { 4 * n }),
                }
            };
            let bytes = |half_weights: bool| {
                let half = |i: usize| half_weights && model.bf16_weight(i);
                // The LM head takes its turn in the embedding's tensor.
                let root = (0..specs.len()).filter(|&i| {
                    !specs[i].name.starts_with("model.layers.") && specs[i].name != "lm_head.weight"
                });
                let (r_held, r_recv) = root.fold((0, 0), |(a, m), i| {
                    let (h, r) = held(i, half(i));
                    (a + h, m.max(r))
                });
                let block =
                    (0..specs.len()).filter(|&i| specs[i].name.starts_with("model.layers.0."));
                let b: i64 = block
                    .map(|i| {
                        let (h, r) = held(i, half(i));
                        h + r
                    })
                    .sum();
                r_held + r_recv + (cfg.parallelism.prefetch as i64 + 1) * b
            };
            (old as i64 - new as i64, bytes(false) - bytes(true))
        };
        let threads = rayon::current_num_threads();
        let predicted = ganymede_plan::predict_memory(&cfg, threads, ranks);
        let predicted = predicted.host.buffers;
        println!(
            "{ranks} ranks, {gather}: buffers {new} bytes (per-GEMM casts: {old}), \
             difference {delta}, planner {predicted}"
        );
        assert_eq!(delta, expected, "{ranks} ranks, {gather}");
        assert_eq!(new as f64, predicted, "{ranks} ranks, {gather}");
    }
}

/// Rank 0's peak activation bytes over 2 steps of `cfg` on `ranks` FSDP thread ranks.
fn activation_peak(cfg: &JobConfig, ranks: usize) -> u64 {
    let mut cfg = cfg.clone();
    cfg.parallelism.dp_shard = ranks;
    let m = &cfg.model;
    let data = Dataset::build(&cfg.data, m.vocab_size, m.seq_len, cfg.training.seed, None).unwrap();
    run_threads(ranks, &ThreadsConfig::default(), |world| {
        let mut st = RankState::new(world, &cfg).unwrap();
        for s in 0..cfg.training.steps {
            st.step(&data, s).unwrap();
        }
        let dev = st.be.device();
        st.be.ledger().report().peak(dev, Category::Activations)
    })
    .into_iter()
    .next()
    .unwrap()
    .unwrap()
}

/// bf16 compute's activations: without checkpointing every layer's saved v, q and k after
/// RoPE, and attention output take 2 bytes an element instead of 4, less the bf16 attention
/// gradients the scratch adds once: `(L − 1) · 2·N·(2Q + 2K)` bytes fewer than f32 (0 under
/// full checkpointing); the rows only bf16-input GEMMs read and the GEMM outputs only SwiGLU
/// reads take 2 bytes too (each set's dispatched inputs, gate, up, SwiGLU products and expert
/// outputs, the scratch's expert output, SwiGLU product, gate and up gradients:
/// `2·N·k·(S·(2H + 3F) + H + 3F)` fewer, S the sets), and so do the head's logits (`2·N·V`
/// fewer); and the L + 1 boundaries (bf16 under the default `auto`) take `2·N·H`
/// each instead of `4·N·H`, plus one f32 working copy, `4·N·H`. The measured peak equals the
/// planner's to the byte, at one rank and at two FSDP ranks.
#[test]
fn bf16_attention_activations_on_the_ledger_equal_the_planner() {
    let threads = rayon::current_num_threads();
    for mode in ["none", "full"] {
        let ac = format!("activation_checkpoint.mode={mode}");
        for ranks in [1, 2] {
            let b = tiny(2, &[BF16, &ac]);
            let f = tiny(2, &[&ac]);
            let (mb, mf) = (activation_peak(&b, ranks), activation_peak(&f, ranks));
            let mut pb = b.clone();
            pb.parallelism.dp_shard = ranks;
            let predicted = ganymede_plan::predict_memory(&pb, threads, ranks);
            let predicted = predicted.host.activations;
            let m = &b.model;
            let n = (b.training.batch_size / ranks * m.seq_len) as u64;
            let sets = if mode == "none" { m.layers as u64 } else { 1 };
            let nh = n * m.hidden as u64;
            // tiny's layers are all MoE, without shared experts: bf16 rows and outputs are
            // each set's dispatched inputs, gate, up, SwiGLU products and expert outputs, and
            // the scratch's expert output, SwiGLU product, gate and up gradients.
            let (k, h, f) = (m.top_k as u64, m.hidden as u64, m.expert_hidden as u64);
            let rows16 = n * k * (sets * (2 * h + 3 * f) + h + 3 * f);
            let saved = (sets - 1) * 2 * n * (2 * m.q_dim() + 2 * m.kv_dim()) as u64
                + 2 * rows16
                + 2 * n * m.vocab_size as u64
                + 2 * nh * (m.layers as u64 + 1)
                - 4 * nh;
            println!(
                "ac {mode}, {ranks} ranks: activations bf16 {mb} bytes, f32 {mf}, \
                 planner {predicted}; saved {}",
                mf - mb
            );
            assert_eq!(mf - mb, saved, "ac {mode}, {ranks} ranks");
            assert_eq!(mb as f64, predicted, "ac {mode}, {ranks} ranks");
        }
    }
}
