//! A training step reads nothing back from the device before its update (issue 32): the
//! gradient norm, clipping's coefficient and the finite check's stop stay in device memory,
//! where the update kernels read them, and the step's figures come back in one read after the
//! update. A step whose gradient is not finite then leaves the weights as they were on every
//! rank, stopped by the kernels themselves.

mod common;

use common::tiny;
use ganymede_config::JobConfig;
use ganymede_core::counting::CountingReads;
use ganymede_core::{Backend, CpuBackend, DType, Ledger};
use ganymede_data::Dataset;
use ganymede_dist::{run_threads, ThreadsConfig};
use ganymede_parallel::RankState;
use std::sync::Arc;

fn data(cfg: &JobConfig) -> Dataset {
    let m = &cfg.model;
    Dataset::build(&cfg.data, m.vocab_size, m.seq_len, cfg.training.seed, None).unwrap()
}

/// Each rank on a CPU backend whose reads are counted.
fn counted() -> Arc<CountingReads<CpuBackend>> {
    Arc::new(CountingReads::new(CpuBackend::new(Arc::new(Ledger::new()))))
}

/// One process, sharded over two ranks, and two shards replicated twice (HSDP), under Muon and AdamW, two
/// microbatches a step: every update kernel of every step runs before any read (and any
/// `sumsq`), and the step then reads its figures once: the norm, each microbatch's loss and
/// routing sums and counts (`tiny`: two MoE layers of eight experts), `1 + 2·(1 + 32)` f64s.
#[test]
fn a_step_reads_nothing_before_its_update() {
    for (ranks, extra) in [
        (1, vec![]),
        (2, vec!["parallelism.dp_shard=2"]),
        (
            4,
            vec!["parallelism.dp_shard=2", "parallelism.dp_replicate=2"],
        ),
        (2, vec!["parallelism.dp_shard=2", "optimizer.name=adamw"]),
    ] {
        let micro = format!("training.micro_batch_size={}", 8 / ranks / 2);
        let mut sets = extra.clone();
        sets.push(&micro);
        let cfg = tiny(3, &sets);
        let data = data(&cfg);
        let what = format!("{ranks} ranks, {extra:?}");
        let res = run_threads(ranks, &ThreadsConfig::default(), |world| {
            let be = counted();
            let mut st = RankState::with_backend(world, &cfg, be.clone() as Arc<dyn Backend>)?;
            let mut seen = vec![];
            for s in 0..cfg.training.steps {
                be.take();
                let sumsqs = be.sumsqs();
                st.step(&data, s)?;
                seen.push((be.updates(), sumsqs, be.take()));
            }
            Ok::<_, anyhow::Error>(seen)
        });
        for (rank, r) in res.into_iter().enumerate() {
            for (step, (updates, sumsqs, reads)) in r.unwrap().unwrap().into_iter().enumerate() {
                let at = format!("{what}, rank {rank}, step {step}");
                assert!(!updates.is_empty(), "{at}: no update kernel ran");
                assert!(
                    updates.iter().all(|&u| u == (0, sumsqs)),
                    "{at}: reads before an update: {updates:?}"
                );
                assert_eq!(reads, [(DType::F64, 1 + 2 * 33)], "{at}: the step's reads");
            }
        }
    }
}

/// A gradient that overflows while the loss is still finite (`tiny` at lr 1e30: step 2's
/// norm is NaN) stops the step with the error that names it, and the update kernels, which
/// read the NaN coefficient on the device, wrote nothing: every rank's weights are step 1's,
/// bit for bit, in one process and sharded over two.
#[test]
fn a_non_finite_gradient_leaves_every_rank_as_it_was() {
    for (ranks, extra) in [(1, None), (2, Some("parallelism.dp_shard=2"))] {
        let mut sets = vec!["optimizer.lr=1e30", "optimizer.warmup_steps=0"];
        sets.extend(extra);
        let cfg = tiny(4, &sets);
        let data = data(&cfg);
        let res = run_threads(ranks, &ThreadsConfig::default(), |world| {
            let mut st = RankState::new(world, &cfg).unwrap();
            for s in 0..cfg.training.steps {
                let before = st.full_params().unwrap();
                if let Err(e) = st.step(&data, s) {
                    return (s, format!("{e:#}"), before == st.full_params().unwrap());
                }
            }
            panic!("no step failed");
        });
        for r in res {
            let (step, e, same) = r.unwrap();
            assert_eq!(step, 1, "{ranks} ranks: {e}");
            assert!(e.contains("gradient norm is NaN at step 2"), "{e}");
            assert!(same, "{ranks} ranks: the failed step changed the weights");
        }
    }
}
