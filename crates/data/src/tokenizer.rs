//! Tokenizers behind one trait: the built-in byte-level one (id = byte value), any Hugging Face
//! `tokenizer.json`, and byte-level BPE training that writes such a file.

use crate::fast_bpe::{byte_to_char, FastBpe, Pretokenizer};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{TokenizerBuilder, TokenizerImpl, Trainer};

/// What the trainer, `eval` and `generate` need from a tokenizer.
pub trait Tokenizer: Send + Sync {
    /// Token ids of raw bytes. Text tokenizers read them as UTF-8, replacing invalid sequences.
    fn encode_bytes(&self, bytes: &[u8]) -> Result<Vec<u32>>;

    /// Token ids of a string. Panics only if the underlying tokenizer fails, which byte-level
    /// tokenizers do not; use [`Tokenizer::encode_bytes`] to handle that case.
    fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_bytes(text.as_bytes())
            .unwrap_or_else(|e| panic!("tokenizer failed on {} bytes: {e:#}", text.len()))
    }

    /// Text of token ids. Invalid UTF-8 comes out as U+FFFD; ids outside the vocabulary come out
    /// as U+FFFD (bytes) or are dropped (Hugging Face tokenizers).
    fn decode(&self, ids: &[u32]) -> String;

    /// One more than the largest id this tokenizer can produce.
    fn vocab_size(&self) -> usize;

    /// A short description for logs ("byte", "tokenizer.json at PATH").
    fn describe(&self) -> String;

    /// The Hugging Face form, where there is one (to save in the run directory).
    fn as_hf(&self) -> Option<&HfTokenizer> {
        None
    }
}

/// Bytes are tokens: ids 0..256.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl Tokenizer for ByteTokenizer {
    fn encode_bytes(&self, bytes: &[u8]) -> Result<Vec<u32>> {
        Ok(bytes.iter().map(|&b| b as u32).collect())
    }

    fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len());
        for &i in ids {
            match u8::try_from(i) {
                Ok(b) => bytes.push(b),
                Err(_) => bytes.extend_from_slice("\u{FFFD}".as_bytes()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn vocab_size(&self) -> usize {
        256
    }

    fn describe(&self) -> String {
        "byte".into()
    }
}

impl ByteTokenizer {
    /// The same tokenizer as a Hugging Face `tokenizer.json` (byte-level BPE with the 256 byte
    /// symbols as ids 0..256 and no merges), so that models trained on bytes can be used with
    /// `transformers`. Encodes every text to its UTF-8 bytes.
    pub fn to_hf(&self) -> HfTokenizer {
        let chars = byte_to_char();
        let vocab: serde_json::Map<String, serde_json::Value> = (0..256)
            .map(|b| (chars[b].to_string(), serde_json::Value::from(b)))
            .collect();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {
                "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                "use_regex": true
            },
            "post_processor": {
                "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                "use_regex": true
            },
            "decoder": {
                "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                "use_regex": true
            },
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": []
            }
        });
        let inner: tokenizers::Tokenizer = json
            .to_string()
            .parse()
            .expect("the byte tokenizer's JSON is valid");
        HfTokenizer::wrap(inner, "byte (as tokenizer.json)".into())
    }
}

/// A Hugging Face tokenizer (`tokenizer.json`), run by the `tokenizers` crate.
#[derive(Clone)]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer's fast path, when it is plain GPT-2-style byte-level BPE.
    fast: Option<Arc<FastBpe>>,
    vocab_size: usize,
    origin: String,
}

/// Inputs longer than this are encoded in pieces, in parallel.
pub(crate) const PIECE_BYTES: usize = 64 << 10;

/// Split text into pieces of about `PIECE_BYTES`, cut only after a newline that has a
/// non-whitespace character on both sides. There GPT-2-style pre-tokenisation splits anyway (the
/// newline is a pre-token of its own), so byte-level BPE gives the same ids piece by piece.
/// Tokenizers that mark the start of input (SentencePiece's "▁" prefix) see one extra start per
/// piece, once per 64 KiB.
pub(crate) fn pieces(text: &str) -> Vec<&str> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    while start < b.len() {
        let mut cut = b.len();
        let mut i = start + PIECE_BYTES;
        while i < b.len() {
            if b[i - 1] == b'\n'
                && !b[i].is_ascii_whitespace()
                && text[..i - 1]
                    .chars()
                    .next_back()
                    .is_some_and(|c| !c.is_whitespace())
                && text.is_char_boundary(i)
            {
                cut = i;
                break;
            }
            i += 1;
        }
        out.push(&text[start..cut]);
        start = cut;
    }
    out
}

impl HfTokenizer {
    /// Load a `tokenizer.json`. Truncation and padding are switched off: we tokenise whole corpora.
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            bail!("tokenizer file {} does not exist", path.display());
        }
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
        Ok(Self::wrap(
            inner,
            format!("tokenizer.json at {}", path.display()),
        ))
    }

    fn wrap(mut inner: tokenizers::Tokenizer, origin: String) -> Self {
        inner.with_padding(None);
        // Clearing truncation cannot fail (only setting bad parameters can).
        let _ = inner.with_truncation(None);
        // Ids may have holes; the model needs an embedding row for the largest one.
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let fast = inner
            .to_string(false)
            .ok()
            .and_then(|j| serde_json::from_str(&j).ok())
            .and_then(|v| FastBpe::from_json(&v))
            .map(Arc::new);
        Self {
            inner,
            fast,
            vocab_size,
            origin,
        }
    }

    /// Ids from the `tokenizers` crate itself, bypassing the fast path (for comparisons).
    pub fn encode_with_tokenizers_crate(&self, text: &str) -> Result<Vec<u32>> {
        let encodings = self
            .inner
            .encode_batch_fast(pieces(text), false)
            .map_err(|e| anyhow!("{} failed to encode: {e}", self.origin))?;
        Ok(encodings
            .iter()
            .flat_map(|e| e.get_ids().iter().copied())
            .collect())
    }

    /// Whether encoding takes the fast byte-level BPE path (else the `tokenizers` crate's).
    pub fn is_fast(&self) -> bool {
        self.fast.is_some()
    }

    /// Write `tokenizer.json` (pretty-printed, as Hugging Face tools write it).
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner
            .save(path, true)
            .map_err(|e| anyhow!("cannot write tokenizer {}: {e}", path.display()))
    }

    /// The `tokenizers` crate's tokenizer, for anything this wrapper does not expose.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl Tokenizer for HfTokenizer {
    fn encode_bytes(&self, bytes: &[u8]) -> Result<Vec<u32>> {
        let text = String::from_utf8_lossy(bytes);
        match &self.fast {
            Some(f) => Ok(f.encode(&text)),
            None => self.encode_with_tokenizers_crate(&text),
        }
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.inner
            .decode(ids, false)
            .unwrap_or_else(|e| format!("\u{FFFD}<decode error: {e}>"))
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn describe(&self) -> String {
        self.origin.clone()
    }

    fn as_hf(&self) -> Option<&HfTokenizer> {
        Some(self)
    }
}

/// Train a byte-level BPE tokenizer (GPT-2 style: byte-to-unicode alphabet, GPT-2 pre-tokenising
/// regex, no prefix space) with at most `vocab_size` ids on `texts`. The 256 byte symbols are
/// always in the vocabulary, so any input encodes; the vocabulary may come out smaller than asked
/// when the text has fewer distinct pairs worth merging (a pair must occur at least twice).
pub fn train_bpe<I, S>(texts: I, vocab_size: usize) -> Result<HfTokenizer>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    if vocab_size < 256 {
        bail!(
            "BPE vocabulary size {vocab_size} is below the 256 byte symbols byte-level BPE needs"
        );
    }
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    // Count pre-tokens here (the crate's own pipeline allocates per split and is several times
    // slower), spelled in the byte-level alphabet as `ByteLevel` would hand them to the trainer.
    let texts: Vec<S> = texts.into_iter().collect();
    let pre = Pretokenizer::new();
    let mut counts: HashMap<&str, u64> = HashMap::new();
    for t in &texts {
        pre.for_each_word(t.as_ref(), |w| *counts.entry(w).or_default() += 1);
    }
    if counts.is_empty() {
        bail!("cannot train a BPE tokenizer on empty text");
    }
    let chars = byte_to_char();
    let spelled: HashMap<String, u64> = counts
        .into_iter()
        .map(|(w, c)| (w.bytes().map(|b| chars[b as usize]).collect(), c))
        .collect();
    let mut words: Vec<&String> = spelled.keys().collect();
    words.sort();
    // The trainer counts what `process` returns: each distinct word, as often as it occurs.
    trainer
        .feed(words.into_iter(), |w| {
            Ok(vec![w.to_owned(); spelled[w] as usize])
        })
        .map_err(|e| anyhow!("BPE training failed: {e}"))?;
    let mut model = BPE::default();
    trainer
        .train(&mut model)
        .map_err(|e| anyhow!("BPE training failed: {e}"))?;
    let tk = byte_level_tokenizer(model)?;
    let tk: tokenizers::Tokenizer = tk.into();
    // Round-trip through JSON so the tokenizer we hand back is exactly what a reader of the saved
    // file gets.
    let json = tk
        .to_string(false)
        .map_err(|e| anyhow!("cannot serialise BPE tokenizer: {e}"))?;
    let tk: tokenizers::Tokenizer = json
        .parse()
        .map_err(|e| anyhow!("cannot re-read trained BPE tokenizer: {e}"))?;
    Ok(HfTokenizer::wrap(
        tk,
        format!("byte-level BPE ({vocab_size} asked)"),
    ))
}

/// A GPT-2-style byte-level tokenizer around a BPE model: no normalizer, GPT-2 regex, no prefix
/// space.
fn byte_level_tokenizer(
    model: BPE,
) -> Result<TokenizerImpl<BPE, tokenizers::NormalizerWrapper, ByteLevel, ByteLevel, ByteLevelDecoder>>
{
    let byte_level = ByteLevel::default()
        .add_prefix_space(false)
        .trim_offsets(false);
    TokenizerBuilder::new()
        .with_model(model)
        .with_normalizer(None)
        .with_pre_tokenizer(Some(byte_level))
        .with_post_processor(Some(byte_level))
        .with_decoder(Some(ByteLevelDecoder::default()))
        .build()
        .map_err(|e| anyhow!("cannot build BPE tokenizer: {e}"))
}

/// What `ganymede tokenizer train` reports.
#[derive(Clone, Debug)]
pub struct BpeTrainReport {
    /// Files read (folders are expanded to their `.txt`/`.jsonl` files).
    pub files: usize,
    /// Bytes read, as they are on disk.
    pub input_bytes: usize,
    /// Of them, bytes in sequences that are not UTF-8 (trained on as U+FFFD).
    pub invalid_utf8_bytes: usize,
    /// Ids in the trained vocabulary (at most the size asked for).
    pub vocab_size: usize,
    /// Input bytes per token under the trained tokenizer.
    pub bytes_per_token: f64,
}

/// `ganymede tokenizer train --input PATH... --vocab-size N --out tokenizer.json`: read text files,
/// folders of `.txt`/`.jsonl` files or JSONL files, train byte-level BPE, write `out`.
pub fn run_tokenizer_train(
    inputs: &[PathBuf],
    vocab_size: usize,
    out: &Path,
) -> Result<BpeTrainReport> {
    if inputs.is_empty() {
        bail!("tokenizer train: give at least one --input file or folder");
    }
    let mut docs = Vec::new();
    let mut files = 0;
    for input in inputs {
        let text = crate::corpus::read_text_source(input)?;
        files += text.files;
        docs.extend(text.docs);
    }
    let texts: Vec<String> = docs
        .iter()
        .map(|d| String::from_utf8_lossy(d).into_owned())
        .collect();
    // What was read, not its lossy decoding (each bad byte becomes a 3-byte U+FFFD there).
    let input_bytes: usize = docs.iter().map(|d| d.len()).sum();
    let invalid_utf8_bytes = docs.iter().map(|d| invalid_utf8_bytes(d)).sum();
    if input_bytes == 0 {
        bail!(
            "tokenizer train: no text in {}",
            inputs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let tk = train_bpe(&texts, vocab_size)?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create folder {}", parent.display()))?;
    }
    tk.save(out)?;
    let mut tokens = 0;
    for t in &texts {
        tokens += tk.encode_bytes(t.as_bytes())?.len();
    }
    Ok(BpeTrainReport {
        files,
        input_bytes,
        invalid_utf8_bytes,
        vocab_size: tk.vocab_size(),
        bytes_per_token: input_bytes as f64 / tokens.max(1) as f64,
    })
}

/// Bytes of `b` that are not part of valid UTF-8 (what a lossy decoding replaces).
pub fn invalid_utf8_bytes(b: &[u8]) -> usize {
    b.utf8_chunks().map(|c| c.invalid().len()).sum()
}

/// A tokenizer from the `data.tokenizer` setting: `byte`, or a path to a `tokenizer.json`.
/// (`bpe` is trained on the corpus by [`crate::Dataset::build`].)
pub fn load_tokenizer(spec: &str) -> Result<Box<dyn Tokenizer>> {
    match spec {
        "byte" => Ok(Box::new(ByteTokenizer)),
        "bpe" => bail!(
            "data.tokenizer = bpe is trained from the corpus when the dataset is built; \
             load the run's data/tokenizer.json instead"
        ),
        path => Ok(Box::new(
            HfTokenizer::from_file(Path::new(path)).context("data.tokenizer")?,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::TempDir;

    const SAMPLE: &str = "The cat sat on the mat. The dog sat on the log.\n\
        A cat and a dog met on the mat; the cat ran, the dog sat.\n\
        Über café naïve — 東京 🙂 tabs\tand  double  spaces\n";

    #[test]
    fn byte_tokenizer_round_trips_any_utf8() {
        let t = ByteTokenizer;
        let ids = t.encode(SAMPLE);
        assert_eq!(ids.len(), SAMPLE.len());
        assert!(ids.iter().all(|&i| i < 256));
        assert_eq!(t.decode(&ids), SAMPLE);
        assert_eq!(t.vocab_size(), 256);
        assert_eq!(t.decode(&[104, 105, 300, 0xE2]), "hi\u{FFFD}\u{FFFD}");
    }

    #[test]
    fn byte_tokenizer_as_tokenizer_json_gives_byte_ids() {
        let hf = ByteTokenizer.to_hf();
        assert_eq!(hf.vocab_size(), 256);
        assert!(hf.is_fast());
        let ids = hf.encode_with_tokenizers_crate(SAMPLE).unwrap();
        assert_eq!(ids, ByteTokenizer.encode(SAMPLE));
        assert_eq!(hf.encode(SAMPLE), ids);
        assert_eq!(hf.decode(&ids), SAMPLE);
        let dir = TempDir::new("byte-json");
        let p = dir.path().join("tokenizer.json");
        hf.save(&p).unwrap();
        let all: Vec<u32> = (0..256).collect();
        let loaded = HfTokenizer::from_file(&p).unwrap();
        // Every byte value decodes and re-encodes to itself (through lossless byte-level text).
        let text = String::from_utf8_lossy(b"\x00\x01 \n\t~\x7f").into_owned();
        assert_eq!(loaded.encode(&text), ByteTokenizer.encode(&text));
        assert_eq!(loaded.inner().get_vocab_size(false), all.len());
    }

    #[test]
    fn pieces_cover_the_text_and_cut_only_after_newlines() {
        let line = "word ".repeat(30) + "word\n";
        // Whitespace next to a newline is never cut: "word \n" and "\n  indented" have none.
        let text = line.repeat(2000) + "  indented\n" + &"word \n".repeat(20000) + "end\n" + &line;
        let p = pieces(&text);
        assert!(p.len() > 1);
        assert_eq!(p.concat(), text);
        for w in p.windows(2) {
            assert!(w[0].ends_with("d\n"), "{:?}", &w[0][w[0].len() - 5..]);
            assert!(!w[1].starts_with(|c: char| c.is_whitespace()));
        }
        assert!(
            p.iter().any(|x| x.len() > 120_000),
            "the uncuttable stretch stays whole"
        );
    }

    #[test]
    fn trained_bpe_loads_in_the_tokenizers_crate_with_the_same_ids() {
        let text = SAMPLE.repeat(20);
        let tk = train_bpe([text.as_str()], 300).unwrap();
        assert!(
            tk.vocab_size() > 256 && tk.vocab_size() <= 300,
            "{}",
            tk.vocab_size()
        );
        let dir = TempDir::new("bpe");
        let path = dir.path().join("tokenizer.json");
        tk.save(&path).unwrap();

        let loaded = tokenizers::Tokenizer::from_file(&path).unwrap();
        let ours = tk.encode(SAMPLE);
        let theirs = loaded.encode(SAMPLE, false).unwrap().get_ids().to_vec();
        assert_eq!(ours, theirs);
        assert!(
            ours.len() < SAMPLE.len(),
            "BPE should compress repeated text"
        );
        assert_eq!(tk.decode(&ours), SAMPLE);

        let reloaded = HfTokenizer::from_file(&path).unwrap();
        assert_eq!(reloaded.encode(SAMPLE), ours);
        assert_eq!(reloaded.vocab_size(), tk.vocab_size());
        // The file is a standard byte-level BPE tokenizer.json.
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(json["model"]["type"], "BPE");
        assert_eq!(json["pre_tokenizer"]["type"], "ByteLevel");
        assert_eq!(json["decoder"]["type"], "ByteLevel");
    }

    #[test]
    fn bpe_training_matches_the_tokenizers_crate_pipeline() {
        let mut text = String::from_utf8(crate::builtin_corpus(60_000, 4)).unwrap();
        text.push_str(&SAMPLE.repeat(30));
        text.push_str("  \n\n   x\t\t y  's 12 345 \u{3000}z \u{a0} ");
        let ours = train_bpe([&text], 600).unwrap();
        // The same training through the crate's own pre-tokenising and counting.
        let mut trainer = BpeTrainerBuilder::new()
            .vocab_size(600)
            .min_frequency(2)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        let mut tk = byte_level_tokenizer(BPE::default()).unwrap();
        tk.train(&mut trainer, pieces(&text).into_iter()).unwrap();
        let theirs: tokenizers::Tokenizer = tk.into();
        assert_eq!(
            ours.inner().to_string(false).unwrap(),
            theirs.to_string(false).unwrap()
        );
    }

    #[test]
    fn bpe_training_is_deterministic() {
        let text = SAMPLE.repeat(10);
        let a = train_bpe([&text], 280).unwrap();
        let b = train_bpe([&text], 280).unwrap();
        assert_eq!(
            a.inner().to_string(false).unwrap(),
            b.inner().to_string(false).unwrap()
        );
    }

    #[test]
    fn bpe_rejects_tiny_vocabularies_and_empty_text() {
        let e = train_bpe(["abc"], 100).err().unwrap().to_string();
        assert!(e.contains("256"), "{e}");
        let e = train_bpe([""], 300).err().unwrap().to_string();
        assert!(e.contains("empty"), "{e}");
    }

    #[test]
    fn run_tokenizer_train_writes_a_loadable_file() {
        let dir = TempDir::new("tok-train");
        let input = dir.path().join("a.txt");
        std::fs::write(&input, SAMPLE.repeat(10)).unwrap();
        let out = dir.path().join("out/tokenizer.json");
        let report = run_tokenizer_train(&[input], 290, &out).unwrap();
        assert_eq!(report.files, 1);
        assert!(report.bytes_per_token > 1.0);
        let t = load_tokenizer(out.to_str().unwrap()).unwrap();
        assert_eq!(t.vocab_size(), report.vocab_size);
        assert_eq!(t.decode(&t.encode("the cat sat")), "the cat sat");
    }

    #[test]
    fn missing_tokenizer_file_is_named() {
        let e = load_tokenizer("/nonexistent/tok.json").err().unwrap();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("/nonexistent/tok.json") && msg.contains("data.tokenizer"),
            "{msg}"
        );
    }
}
