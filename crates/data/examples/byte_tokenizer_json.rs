//! Write the byte tokenizer as a Hugging Face `tokenizer.json` (ids are bytes), for using
//! byte-level models with `transformers`.
//! `cargo run --release -p ganymede-data --example byte_tokenizer_json -- OUT.json`

fn main() -> anyhow::Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tokenizer.json".into());
    ganymede_data::ByteTokenizer
        .to_hf()
        .save(std::path::Path::new(&out))?;
    println!("wrote {out}");
    Ok(())
}
