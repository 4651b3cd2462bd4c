//! Print the built-in corpus's entropy floor, its generation time, and a sample of its text;
//! with OUT, also write the whole corpus there.
//! `cargo run --release -p ganymede-data --example corpus_sample [BYTES [OUT]]`

fn main() {
    let bytes: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("BYTES must be a number"))
        .unwrap_or(4 << 20);
    let t = std::time::Instant::now();
    let text = ganymede_data::builtin_corpus(bytes, ganymede_data::BUILTIN_SEED);
    let dt = t.elapsed();
    println!(
        "generated {} bytes in {:.1} ms; entropy floor {:.4} nats/byte",
        text.len(),
        dt.as_secs_f64() * 1e3,
        ganymede_data::builtin_entropy_nats_per_byte()
    );
    println!(
        "---\n{}",
        String::from_utf8_lossy(&text[..text.len().min(1200)])
    );
    if let Some(out) = std::env::args().nth(2) {
        std::fs::write(&out, &text).expect("cannot write OUT");
        println!("\n--- wrote {out}");
    }
}
