//! Expert parallelism's dispatch buffers: sized in the first step for
//! `parallelism.ep_capacity_factor` times an even routing's rows (at most what a rank can
//! receive), grown only when a step routes a rank more, and every growth reported.

mod common;

use common::tiny;
use ganymede_config::JobConfig;
use ganymede_core::{Category, Device};
use ganymede_data::Dataset;
use ganymede_dist::{run_threads, ThreadsConfig};
use ganymede_model::RowBufferUse;
use ganymede_parallel::RankState;

/// One rank's view of a run.
struct Rank {
    losses: Vec<f64>,
    /// Ledger allocations of each step.
    allocs: Vec<u64>,
    rows: Vec<RowBufferUse>,
    /// Regrowths of each step, summed over the ranks.
    regrowths_all: Vec<u64>,
    /// Each step's most rows over an even routing, over the ranks.
    over_even_all: Vec<f64>,
    /// Bytes held at the end.
    activations: u64,
    buffers: u64,
}

fn run(cfg: &JobConfig, ranks: usize) -> Vec<Rank> {
    let m = &cfg.model;
    let data = Dataset::build(&cfg.data, m.vocab_size, m.seq_len, cfg.training.seed, None).unwrap();
    run_threads(ranks, &ThreadsConfig::default(), |world| {
        let mut st = RankState::new(world, cfg).unwrap();
        let mut r = Rank {
            losses: vec![],
            allocs: vec![],
            rows: vec![],
            regrowths_all: vec![],
            over_even_all: vec![],
            activations: 0,
            buffers: 0,
        };
        for s in 0..cfg.training.steps {
            st.be.ledger().mark_window();
            let rep = st.step(&data, s).unwrap();
            r.allocs.push(st.be.ledger().window_alloc_count());
            r.losses.push(rep.loss);
            r.rows.push(
                rep.expert_rows
                    .expect("an expert-parallel run reports its rows"),
            );
            r.regrowths_all.push(rep.expert_regrowths);
            r.over_even_all
                .push(rep.expert_rows_over_even.expect("rows over even"));
        }
        let l = st.be.ledger().report();
        r.activations = l.current(Device::Host, Category::Activations);
        r.buffers = l.current(Device::Host, Category::Buffers);
        r
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

fn cfg(steps: usize, ranks: usize, ep: usize, factor: f64, extra: &[&str]) -> JobConfig {
    let mut o = vec![
        format!("parallelism.dp_shard={ranks}"),
        format!("parallelism.ep={ep}"),
        format!("parallelism.ep_capacity_factor={factor}"),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    tiny(steps, &o)
}

/// The capacity the module documents: `factor` × even rows, within the most a rank can receive.
fn expected_capacity(c: &JobConfig, ranks: usize) -> usize {
    let m = &c.model;
    let (ep, k) = (c.parallelism.ep, m.top_k);
    let tokens = c.training.batch_size / ranks * m.seq_len;
    let even = tokens * k;
    let most = ep * tokens * k.min(m.experts / ep);
    ((even as f64 * c.parallelism.ep_capacity_factor).ceil() as usize).min(most)
}

/// Two factors that both hold the routing: the capacity is as documented, the numbers are
/// bitwise the same, and the bytes differ by exactly the capacity's difference: per row, the
/// experts' kept input and gate/up/SwiGLU (H + 3F f32 and two u32 row orders, activations, one
/// set alive under full
/// checkpointing, one per MoE layer without) and the all-to-all and gradient scratch (3H + 3F,
/// buffers), f32.
#[test]
fn buffers_hold_the_factor_times_an_even_routing() {
    // `tiny`'s first steps route up to 1.6x even rows to a rank at ep 2 and 2.2x at ep 4 (with
    // two sequences a rank): both factors of each case hold that.
    for (ranks, ep, ac, fa, fb) in [
        (4, 2, "full", 1.75, 2.0),
        (4, 4, "full", 3.0, 4.0),
        (2, 2, "none", 1.75, 2.0),
    ] {
        let ac = format!("activation_checkpoint.mode={ac}");
        let a = cfg(3, ranks, ep, fa, &[&ac]);
        let b = cfg(3, ranks, ep, fb, &[&ac]);
        let (ra, rb) = (run(&a, ranks), run(&b, ranks));
        let m = &a.model;
        let sets = if ac.ends_with("full") { 1 } else { m.layers };
        let (h, f) = (m.hidden as u64, m.expert_hidden as u64);
        let (ca, cb) = (expected_capacity(&a, ranks), expected_capacity(&b, ranks));
        assert!(
            cb > ca,
            "{ranks} ranks, ep {ep}: the factors give different capacities"
        );
        for (r, (x, y)) in ra.iter().zip(&rb).enumerate() {
            let at = format!("{ranks} ranks, ep {ep}, {ac}, rank {r}");
            assert_eq!(x.losses, y.losses, "{at}: the capacity changed the numbers");
            for (run, want) in [(x, ca), (y, cb)] {
                for u in &run.rows {
                    assert_eq!(
                        u.regrowths, 0,
                        "{at}: the routing outgrew the capacity: {u:?}"
                    );
                    assert_eq!(u.capacity, want, "{at}: capacity");
                    assert!(u.peak <= u.capacity && u.peak > 0, "{at}: {u:?}");
                }
                assert_eq!(
                    run.allocs[1..],
                    vec![0; 2],
                    "{at}: allocations after step 1"
                );
            }
            let d = (cb - ca) as u64;
            assert_eq!(
                y.activations - x.activations,
                (4 * (h + 3 * f) + 8) * d * sets as u64,
                "{at}: activation bytes"
            );
            assert_eq!(
                y.buffers - x.buffers,
                4 * d * (3 * h + 3 * f),
                "{at}: buffer bytes"
            );
        }
    }
}

/// A factor of `ep` holds the most any routing can send a rank, so after the first step no
/// step allocates, whatever the routing does (f32 and bf16, whose GEMMs' cast scratch is sized
/// by the capacity's views).
#[test]
fn a_factor_that_holds_the_most_never_allocates_after_the_first_step() {
    let steps = 12;
    for dtype in ["f32", "bf16"] {
        for (ranks, ep) in [(2, 2), (4, 2), (4, 4)] {
            let c = cfg(
                steps,
                ranks,
                ep,
                ep as f64,
                &[&format!("training.compute_dtype={dtype}")],
            );
            for (r, rank) in run(&c, ranks).iter().enumerate() {
                assert!(rank.allocs[0] > 0, "rank {r}: the first step made nothing?");
                assert_eq!(
                    rank.allocs[1..],
                    vec![0; steps - 1],
                    "{dtype}, {ranks} ranks, ep {ep}, rank {r}: allocations per step"
                );
                assert!(rank.rows.iter().all(|u| u.regrowths == 0));
            }
        }
    }
}

/// A factor of 1 (`tiny`'s first routings are uneven): the buffers grow, each growth is
/// counted on its rank and in every rank's total, a step after the first allocates only when
/// its rank grew in that step or the one before (the pooled sets catch up when next used), and
/// the trainer writes the counts to `metrics.jsonl`.
#[test]
fn routing_past_the_capacity_grows_the_buffers_and_says_so() {
    let (ranks, ep, steps) = (4, 2, 8);
    let c = cfg(steps, ranks, ep, 1.0, &[]);
    let run = run(&c, ranks);
    let total: u64 = run.iter().flat_map(|r| &r.rows).map(|u| u.regrowths).sum();
    assert!(
        total > 0,
        "factor 1 on tiny grew nothing: the test shows nothing"
    );
    let mut uneven = false;
    for s in 0..steps {
        let sum: u64 = run.iter().map(|r| r.rows[s].regrowths).sum();
        let ratio = |u: &RowBufferUse| u.peak as f64 / u.even as f64;
        let most = run.iter().map(|r| ratio(&r.rows[s])).fold(0.0, f64::max);
        uneven |= ratio(&run[0].rows[s]) != most;
        for r in &run {
            assert_eq!(r.regrowths_all[s], sum, "step {s}: the total over ranks");
            assert_eq!(r.over_even_all[s], most, "step {s}: the most over ranks");
        }
    }
    assert!(
        uneven,
        "rank 0 held the most every step: the test shows nothing"
    );
    for (i, r) in run.iter().enumerate() {
        let mut cap = 0;
        for s in 0..steps {
            let u = r.rows[s];
            assert!(
                u.capacity >= cap && u.capacity >= u.peak,
                "rank {i} step {s}: {u:?}"
            );
            cap = u.capacity;
            if s > 0 && r.allocs[s] > 0 {
                let grew = u.regrowths > 0 || r.rows[s - 1].regrowths > 0;
                assert!(
                    grew,
                    "rank {i}, step {s}: {} allocations, no regrowth",
                    r.allocs[s]
                );
            }
        }
    }
    let mut cfg = c.clone();
    cfg.parallelism.dp_shard = ranks;
    let dir = ganymede_train::scratch::run_dir("ep-capacity", "grow");
    let opts = ganymede_train::trainer::TrainOptions {
        ranks,
        out: Some(dir.clone()),
        quiet: true,
        ..Default::default()
    };
    ganymede_train::trainer::train(&cfg, None, &opts).unwrap();
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let written: u64 = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| {
            v["ep_regrowths"]
                .as_u64()
                .expect("ep_regrowths in every line")
        })
        .sum();
    assert_eq!(
        written, total,
        "metrics.jsonl's regrowths against the ranks' counts"
    );
}

/// The planner's prediction of an expert-parallel run, per memory and ledger category, against
/// the ledger's peaks in `memory.json`, to the byte, where the capacity holds the routing (a
/// factor of `ep`): ep 2 and 4, f32 and bf16 compute, with and without checkpointing, naive
/// placement, optimizer offload, activation offload and HSDP.
#[test]
fn the_planner_predicts_an_expert_parallel_run_to_the_byte() {
    let cases: &[(usize, usize, &[&str])] = &[
        (2, 2, &[]),
        (4, 2, &[]),
        (4, 4, &["training.compute_dtype=bf16"]),
        (4, 2, &["activation_checkpoint.mode=none"]),
        (4, 4, &["parallelism.muon_placement=naive"]),
        (
            4,
            2,
            &["optimizer.offload=true", "training.compute_dtype=bf16"],
        ),
        (4, 2, &["activation_checkpoint.offload_fraction=1"]),
        (
            4,
            2,
            &["parallelism.dp_replicate=2", "optimizer.name=adamw"],
        ),
        (4, 2, &["training.moe_chunk_tokens=100"]),
        (
            4,
            4,
            &[
                "training.moe_chunk_tokens=48",
                "training.compute_dtype=bf16",
                "activation_checkpoint.mode=none",
            ],
        ),
    ];
    for &(ranks, ep, extra) in cases {
        let mut o = vec!["device.kind=cpu-two-memory"];
        o.extend(extra);
        let mut c = cfg(2, ranks, ep, ep as f64, &o);
        c.parallelism.dp_shard = ranks / c.parallelism.dp_replicate;
        let what = format!("{ranks} ranks, ep {ep}, {extra:?}");
        let dir = ganymede_train::scratch::run_dir("ep-capacity", "plan");
        let opts = ganymede_train::trainer::TrainOptions {
            ranks,
            out: Some(dir.clone()),
            quiet: true,
            ..Default::default()
        };
        ganymede_train::trainer::train(&c, None, &opts).unwrap();
        for (dev, cat, measured, planned) in common::measured_and_planned(&dir) {
            assert_eq!(measured, planned, "{what}: {dev} {cat}");
        }
    }
}

/// The MoE layers a chunk of tokens at a time (`training.moe_chunk_tokens`) under expert
/// parallelism: each chunk is its own all-to-all, so the buffers hold the capacity of one
/// chunk's rows (smaller by exactly the rows' difference), and the losses are those of the
/// unchunked run up to the weight gradients' summation order (f32; 4 ranks, ep 2 and 4, both
/// checkpointing modes, 100 of a rank's 256 tokens: chunks of 100, 100 and 56).
#[test]
fn chunked_moe_passes_send_a_chunk_at_a_time() {
    let (ranks, steps) = (4, 4);
    for (ep, ac) in [(2, "full"), (4, "none")] {
        let ac = format!("activation_checkpoint.mode={ac}");
        let whole = cfg(steps, ranks, ep, ep as f64, &[&ac]);
        let chunked = cfg(
            steps,
            ranks,
            ep,
            ep as f64,
            &[&ac, "training.moe_chunk_tokens=100"],
        );
        let tokens = whole.training.batch_size / ranks * whole.model.seq_len;
        assert_eq!(tokens, 256, "the chunks this test means");
        let (rw, rc) = (run(&whole, ranks), run(&chunked, ranks));
        let (cw, cc) = (
            expected_capacity(&whole, ranks),
            ep * 100 * whole.model.top_k,
        );
        for (r, (w, c)) in rw.iter().zip(&rc).enumerate() {
            let at = format!("ep {ep}, {ac}, rank {r}");
            assert!(c.rows.iter().all(|u| u.capacity == cc && u.regrowths == 0));
            assert!(w.rows.iter().all(|u| u.capacity == cw && u.regrowths == 0));
            let (h, f) = (whole.model.hidden as u64, whole.model.expert_hidden as u64);
            let d = (cw - cc) as u64;
            assert_eq!(
                w.buffers - c.buffers,
                4 * d * (3 * h + 3 * f),
                "{at}: buffer bytes"
            );
            for (s, (a, b)) in w.losses.iter().zip(&c.losses).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * a,
                    "{at}, step {s}: {b} chunked vs {a}"
                );
            }
        }
    }
}
