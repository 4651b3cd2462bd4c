//! Sequences per second that prepared shards serve to training from the page cache, at `small`'s
//! window (256 tokens, batch 8) and at the write-up's 65,536-token windows.
//! `cargo run --release -p ganymede-data --example serve_rate [MILLION_TOKENS]`

use ganymede_config::DataConfig;
use ganymede_data::{Dataset, ShardWriter};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let mtok: u64 = std::env::args().nth(1).map_or(Ok(256), |s| s.parse())?;
    let dir = std::env::temp_dir().join(format!("ganymede-serve-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(&src)?;
    // Synthetic documents of 500..4500 tokens in shards of 64M tokens (u16 ids, vocab 50k), and
    // a manifest so the folder reads as a prepared dataset.
    let per_shard = 64u64 << 20;
    let mut shards = Vec::new();
    let (mut written, mut k, mut x) = (0u64, 0usize, 1u64);
    while written < mtok << 20 {
        let name = format!("shard-{k:05}.gtok");
        let mut w = ShardWriter::create(&src.join(&name), 2, 1, Some(50_000), 50_001)?;
        while w.tokens() < per_shard && written + w.tokens() < mtok << 20 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 500 + (x >> 33) % 4000;
            let doc: Vec<u32> = (0..len)
                .map(|i| ((x >> 20).wrapping_add(i * 7919) % 50_000) as u32)
                .chain([50_000])
                .collect();
            w.push_document(&doc)?;
        }
        let h = w.finish()?;
        written += h.tokens;
        shards.push(
            serde_json::json!({"file": format!("src/{name}"), "tokens": h.tokens,
            "documents": h.documents, "bytes": std::fs::metadata(src.join(&name))?.len()}),
        );
        k += 1;
    }
    let tok_json = dir.join("tokenizer.json");
    ganymede_data::ByteTokenizer.to_hf().save(&tok_json)?;
    let manifest = serde_json::json!({"format": 1, "tokenizer": "tokenizer.json",
        "tokenizer_hash": 1, "eod": 50000, "vocab_size": 50001, "token_bytes": 2,
        "sources": [{"name": "src", "input": "synthetic", "files": 1, "input_bytes": 0,
        "documents": 0, "tokens": written, "invalid_utf8_documents": 0, "shards": shards}]});
    std::fs::write(dir.join("manifest.json"), serde_json::to_string(&manifest)?)?;
    println!(
        "{} M tokens in {k} shard(s) at {}",
        written >> 20,
        dir.display()
    );

    for (seq, batch) in [(256usize, 8usize), (65_536, 1)] {
        let cfg = DataConfig {
            path: dir.display().to_string(),
            val_fraction: 0.01,
            ..DataConfig::default()
        };
        let t = Instant::now();
        let ds = Dataset::build(&cfg, 50_001, seq, 0, None)?;
        let open = t.elapsed().as_secs_f64();
        // Warm the page cache with one pass over the windows a run of this length reads.
        let steps = if seq == 256 { 20_000 } else { 400 };
        for s in 0..steps {
            std::hint::black_box(ds.batch(s, batch, seq));
        }
        let mut rates = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            for s in 0..steps {
                std::hint::black_box(ds.batch(s, batch, seq));
            }
            rates.push((steps as usize * batch) as f64 / t.elapsed().as_secs_f64());
        }
        rates.sort_by(f64::total_cmp);
        println!(
            "seq {seq}: open {:.3} s; {:.0} sequences/s served ({:.0} M tokens/s), median of 5",
            open,
            rates[2],
            rates[2] * seq as f64 / 1e6
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
