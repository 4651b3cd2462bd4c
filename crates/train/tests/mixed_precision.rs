//! `training.compute_dtype = "bf16"`: bf16 × bf16 → f32 GEMMs over f32 master state. Tracks the
//! f32 run closely without being it, matches itself across ranks, allocates nothing after the
//! first step, and hands the GEMM weights to the model in bf16 (cast once per step or gather)
//! with the same losses, to the bit, as casting them in every GEMM.

use ganymede_config::JobConfig;
use ganymede_core::Category;
use ganymede_data::Dataset;
use ganymede_dist::{run_threads, ThreadsConfig};
use ganymede_parallel::RankState;

mod common;
use common::{allocs_after_first_step, max_rel, tiny};

fn losses(cfg: &JobConfig, ranks: usize, name: &str) -> Vec<f64> {
    common::losses(cfg, ranks, "gm-bf16", name)
}

const BF16: &str = "training.compute_dtype=bf16";

/// bf16 operands perturb each GEMM by ~2^-9 relative per operand; over 20 steps of `tiny` the
/// loss moves by at most 6.9e-4 of itself (measured on x86-64 with AVX2), held to 5e-3.
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

/// Across ranks only f32 summation orders differ (reduce-scatter, routing statistics), but a
/// value one ulp apart can round to a different bf16, so the bound is looser than f32's 1e-6:
/// measured 1.2e-5 (4 ranks) and 1.4e-5 (ep 2) relative over 10 steps, held to 5e-4.
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

/// Peak buffer bytes of rank 0 over two steps.
fn buffer_peak(cfg: &JobConfig, ranks: usize) -> u64 {
    let mut cfg = cfg.clone();
    cfg.parallelism.dp_shard = ranks;
    let m = &cfg.model;
    let data = Dataset::build(&cfg.data, m.vocab_size, m.seq_len, cfg.training.seed, None).unwrap();
    run_threads(ranks, &ThreadsConfig::default(), |world| {
        let mut st = RankState::new(world, &cfg).unwrap();
        st.step(&data, 0).unwrap();
        st.step(&data, 1).unwrap();
        let dev = st.be.device();
        st.be
            .ledger()
            .report()
            .peak(dev, ganymede_core::Category::Buffers)
    })
    .into_iter()
    .next()
    .unwrap()
    .unwrap()
}

/// The cast scratch is on the ledger as buffers, and the planner predicts its bytes.
#[test]
fn the_planner_predicts_the_cast_scratch() {
    for ranks in [1, 2] {
        let f = tiny(2, &[]);
        let b = tiny(2, &[BF16]);
        let mut local = b.clone();
        local.training.batch_size /= ranks;
        let measured = buffer_peak(&b, ranks) as f64 - buffer_peak(&f, ranks) as f64;
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
        out.push(st.validate(&data).unwrap());
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
