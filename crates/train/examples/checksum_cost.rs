//! The cost of checkpoint digests (BENCHMARKS.md, "Checkpoint digests"): for a preset's freshly
//! initialised state (parameters and optimizer state, one process), the median over repetitions
//! of saving a checkpoint (which computes the digests), of loading it with and without checking
//! them, and of computing the digests alone over the files' bytes in memory.
//!
//! `cargo run --release -p ganymede-train --example checksum_cost [preset] [reps]`

use ganymede_checkpoint::{self as checkpoint, FileDigest, Position};
use ganymede_config::preset;
use ganymede_dist::{threads_world, ThreadsConfig};
use ganymede_parallel::RankState;
use std::sync::Arc;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("small", String::as_str);
    let reps: usize = args.get(2).map_or(5, |r| r.parse().expect("reps"));
    let cfg = preset(name)?;
    ganymede_train::trainer::init_threads(cfg.training.threads);
    let world = threads_world(1, &ThreadsConfig::default()).pop().unwrap();
    let mut st = RankState::new(Arc::new(world), &cfg)?;
    let run = std::env::temp_dir().join(format!("ganymede-checksum-cost-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run);
    let (mut save, mut load_on, mut load_off, mut hash) = (vec![], vec![], vec![], vec![]);
    let mut bytes = 0u64;
    for rep in 0..reps {
        let at = Position {
            step: rep + 1,
            tokens_seen: 0,
            data_seed: 0,
            data: None,
        };
        let t = Instant::now();
        let dir = st.save(&run, &at, false)?.expect("rank 0 saves");
        save.push(t.elapsed().as_secs_f64());
        // The files' bytes, read once (warm in the page cache, as a load right after a save).
        let files: Vec<Vec<u8>> = checkpoint::read_manifest(&dir)?
            .files
            .keys()
            .map(|f| std::fs::read(dir.join(f)))
            .collect::<Result<_, _>>()?;
        bytes = files.iter().map(|b| b.len() as u64).sum();
        let t = Instant::now();
        let digests: Vec<FileDigest> = files.iter().map(|b| FileDigest::of(b)).collect();
        hash.push(t.elapsed().as_secs_f64());
        assert_eq!(digests.len(), files.len());
        // Verified and unverified loads in turn, the first alternating, so neither always
        // runs on the warmer cache.
        for k in 0..2 {
            let on = (rep + k) % 2 == 0;
            checkpoint::set_verify(on);
            let t = Instant::now();
            st.load_checkpoint(&dir)?;
            let dt = t.elapsed().as_secs_f64();
            if on {
                load_on.push(dt)
            } else {
                load_off.push(dt)
            }
        }
        checkpoint::set_verify(true);
    }
    let _ = std::fs::remove_dir_all(&run);
    let (s, on, off, h) = (
        median(save),
        median(load_on),
        median(load_off),
        median(hash),
    );
    println!(
        "{name}: {} parameters, checkpoint files {:.1} MiB; medians of {reps} (load average {}):",
        st.numel(),
        bytes as f64 / (1u64 << 20) as f64,
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .next()
            .unwrap_or("?")
    );
    println!(
        "  digests alone {:.1} ms ({:.2} GB/s), save {:.1} ms (digests {:.1}% of it), load verified {:.1} ms, unverified {:.1} ms (verification {:.1}% of a verified load)",
        h * 1e3,
        bytes as f64 / h / 1e9,
        s * 1e3,
        100.0 * h / s,
        on * 1e3,
        off * 1e3,
        100.0 * (on - off).max(0.0) / on
    );
    Ok(())
}
