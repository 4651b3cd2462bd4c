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
//! - [`gather_debian_text`]: a real-text corpus from this Debian machine's license texts.

mod builtin;
mod corpus;
mod dataset;
mod debian;
mod fast_bpe;
mod rng;
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
pub use tokenizer::{
    load_tokenizer, run_tokenizer_train, train_bpe, BpeTrainReport, ByteTokenizer, HfTokenizer,
    Tokenizer,
};
pub use tokens::{check_ids, write_tokens, TokenFile};
