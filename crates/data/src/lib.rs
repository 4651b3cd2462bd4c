//! Data for ganymede: what a run trains on and how it is cut into batches.
//!
//! - [`builtin_corpus`]: English-like text generated from a grammar whose entropy rate
//!   ([`builtin_entropy_nats_per_byte`]) is known exactly, so training can be compared with the
//!   floor. The default corpus; needs no download.
//! - User data: a text file, a JSONL file (`"text"` fields), a folder of `.txt`/`.jsonl` files, or
//!   a `.bin` file of little-endian u32 tokens.
//! - [`Tokenizer`]: [`ByteTokenizer`] (ids are bytes), [`HfTokenizer`] (any Hugging Face
//!   `tokenizer.json`), and [`train_bpe`] / [`run_tokenizer_train`] for byte-level BPE.
//! - Token files ([`TokenFile`], [`write_tokens`]): flat little-endian u32, memory-mapped.
//! - [`Dataset`]: tokenised train and validation splits and stateless sampling: the batch at a
//!   step depends only on `(seed, step)`, and [`eval_windows`] cuts evaluation windows.
//! - Prepared data ([`prepare`], `ganymede data prepare`): raw text (txt, JSONL, parquet, gz,
//!   zst) tokenised in parallel into token shards ([`Shard`]) with document indexes; training
//!   maps them, with Megatron `.bin`/`.idx` and llm.c shards, as weighted sources sampled
//!   without replacement ([`Mixture`]).
//! - [`gather_debian_text`]: a real-text corpus from this Debian machine's license texts.

mod builtin;
mod corpus;
mod dataset;
mod debian;
mod fast_bpe;
mod inputs;
mod prepare;
mod rng;
mod shards;
mod sources;
mod tokenizer;
mod tokens;

#[cfg(test)]
mod test_util;

pub use builtin::{builtin_corpus, builtin_entropy_nats_per_byte, BUILTIN_SEED};
pub use dataset::{
    eval_windows, load_eval_tokens, load_run_tokenizer, num_eval_windows, Dataset, TOKENIZER_FILE,
    TRAIN_FILE, VAL_FILE,
};
pub use debian::{debian_text_files, gather_debian_text, gather_dedup, GatherReport};
pub use inputs::{input_files, write_text_parquet, DocStream};
pub use prepare::{prepare, EodSpec, Manifest, PrepareOptions, MANIFEST_FILE};
pub use shards::{Shard, ShardHeader, ShardWriter, SHARD_EXT};
pub use sources::{is_prepared, open_sources, permute, Mixture, Source};
pub use tokenizer::{
    invalid_utf8_bytes, load_tokenizer, run_tokenizer_train, train_bpe, BpeTrainReport,
    ByteTokenizer, HfTokenizer, Tokenizer,
};
pub use tokens::{check_ids, write_tokens, TokenFile};

/// Write `bytes` to `path` through a temporary file, flushed to disk and renamed, so a reader
/// (or a restart) sees the old file or the new one, never a part.
pub fn write_file_atomic(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.with_context(|| format!("cannot write {}", path.display()))
}
