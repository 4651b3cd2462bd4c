//! Write a trained byte-level BPE `tokenizer.json`, a sample text and our ids for it into a folder,
//! for `scripts/check_tokenizer_python.py` to compare with Python's `tokenizers` and `transformers`.
//! `cargo run --release -p ganymede-data --example bpe_python_fixture -- DIR`

use ganymede_data::{builtin_corpus, train_bpe, Tokenizer, BUILTIN_SEED};
use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "bpe-fixture".into()),
    );
    std::fs::create_dir_all(&dir)?;
    let mut text = String::from_utf8(builtin_corpus(200_000, BUILTIN_SEED))?;
    // Some text outside the grammar: Unicode, digits, contractions, whitespace runs.
    text.push_str("\nÜber café naïve — 東京 🙂 it's 1234 x  y\t\tz   \n\n  end ");
    let tk = train_bpe([&text], 1000)?;
    tk.save(&dir.join("tokenizer.json"))?;
    let sample = &text[text.len() - 3000..];
    std::fs::write(dir.join("sample.txt"), sample)?;
    let ids = tk.encode(sample);
    std::fs::write(dir.join("ids.json"), serde_json::to_string(&ids)?)?;
    println!(
        "wrote {} ({} ids, vocab {})",
        dir.display(),
        ids.len(),
        tk.vocab_size()
    );
    Ok(())
}
