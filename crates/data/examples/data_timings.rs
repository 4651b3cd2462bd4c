//! Time the data pipeline on the built-in corpus: generation, byte and BPE datasets.
//! `cargo run --release -p ganymede-data --example data_timings [BYTES] [BPE_VOCAB]`

use ganymede_config::DataConfig;
use ganymede_data::{builtin_corpus, Dataset, BUILTIN_SEED};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let bytes: usize = args.next().map_or(Ok(4 << 20), |s| s.parse())?;
    let vocab: usize = args.next().map_or(Ok(4096), |s| s.parse())?;

    let t = Instant::now();
    let text = builtin_corpus(bytes, BUILTIN_SEED);
    println!(
        "generate {} bytes: {:.3} s",
        text.len(),
        t.elapsed().as_secs_f64()
    );

    for tokenizer in ["byte", "bpe"] {
        let cfg = DataConfig {
            tokenizer: tokenizer.into(),
            builtin_bytes: bytes,
            ..DataConfig::default()
        };
        let v = if tokenizer == "byte" { 256 } else { vocab };
        let t = Instant::now();
        let ds = Dataset::build(&cfg, v, 256, 0, None)?;
        let tk = ds.tokenizer();
        println!(
            "dataset ({tokenizer}, vocab {} of {v}): {} train + {} val tokens, {:.2} bytes/token: {:.3} s",
            tk.vocab_size(),
            ds.train_tokens().len(),
            ds.val_tokens().len(),
            bytes as f64 / (ds.train_tokens().len() + ds.val_tokens().len()) as f64,
            t.elapsed().as_secs_f64()
        );
        let t = Instant::now();
        let n = 1000;
        for s in 0..n {
            std::hint::black_box(ds.batch(s, 8, 256));
        }
        println!(
            "  batch(8 x 256): {:.1} us each",
            t.elapsed().as_secs_f64() / n as f64 * 1e6
        );
    }
    Ok(())
}
