//! Write a gathered checkpoint of any preset without training it or holding it in memory: the
//! parameters are streamed into `model.safetensors` (deterministic values, a few MiB at a time),
//! so an export of a model of several GB can be measured on a machine that could not train it.
//!
//! ```sh
//! cargo run --release -p ganymede-train --example synth_checkpoint -- medium /tmp/run [--set k=v]...
//! ```
//! writes `/tmp/run/checkpoints/step_00000000` (and `latest`), which `ganymede export` reads.

use anyhow::{Context, Result};
use ganymede_train::checkpoint::{self, Manifest, Position};
use ganymede_train::st_file::StWriter;
use std::path::PathBuf;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [preset, out, rest @ ..] = args.as_slice() else {
        anyhow::bail!("usage: synth_checkpoint PRESET RUN_DIR [--set section.key=value]...");
    };
    let sets: Vec<String> = rest
        .chunks(2)
        .filter(|c| c[0] == "--set")
        .map(|c| c[1].clone())
        .collect();
    let cfg = ganymede_config::JobConfig::load(Some(preset), None, &sets)?;
    let run = PathBuf::from(out);
    let dir = checkpoint::checkpoints_root(&run).join(checkpoint::dir_name(0));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let specs = ganymede_model::param_specs(&cfg.model);
    let plan: Vec<(String, Vec<usize>)> = specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect();
    let mut w = StWriter::create(&dir.join(checkpoint::MODEL_FILE), &plan, &[])?;
    let mut bytes = 0u64;
    let mut x = 0x9E37_79B9u32;
    for s in &specs {
        let mut left = s.numel();
        while left > 0 {
            let n = left.min(1 << 20);
            // A cheap generator: the values only need to differ from tensor to tensor.
            let chunk: Vec<f32> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x as f32 / u32::MAX as f32 - 0.5) * 0.04
                })
                .collect();
            w.write(&chunk)?;
            left -= n;
        }
        bytes += s.numel() as u64 * 4;
    }
    w.finish()?;
    std::fs::write(
        dir.join(checkpoint::OPTIMIZER_FILE),
        checkpoint::to_safetensors_bytes(&[], None)?,
    )?;
    let at = Position {
        step: 0,
        tokens_seen: 0,
        data_seed: cfg.training.seed,
        data: None,
    };
    let m = Manifest::at(&cfg, &at, 0);
    std::fs::write(dir.join(checkpoint::CONFIG_FILE), &m.config)?;
    std::fs::write(
        dir.join(checkpoint::MANIFEST_FILE),
        serde_json::to_vec_pretty(&m)?,
    )?;
    std::fs::write(
        checkpoint::checkpoints_root(&run).join("latest"),
        format!("{}\n", checkpoint::dir_name(0)),
    )?;
    println!(
        "{}: {} parameters, {bytes} bytes",
        dir.display(),
        specs.iter().map(|s| s.numel()).sum::<usize>()
    );
    Ok(())
}
