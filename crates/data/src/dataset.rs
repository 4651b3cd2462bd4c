//! The dataset a run trains on: a tokenised train split and a held-out validation split, kept as
//! token files in the run's data folder, and stateless batch sampling.

use crate::builtin::{builtin_corpus, BUILTIN_SEED};
use crate::corpus::{is_token_file, join_docs, read_text_source, source_files};
use crate::rng::{below, keyed};
use crate::sources::{is_prepared, open_sources, Mixture, Source, SourceFile};
use crate::tokenizer::{train_bpe, ByteTokenizer, HfTokenizer, Tokenizer};
use crate::tokens::{check_ids, write_tokens, TokenFile};
use anyhow::{bail, Context, Result};
use ganymede_config::DataConfig;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// File names inside a run's data folder.
pub const TRAIN_FILE: &str = "train.bin";
pub const VAL_FILE: &str = "val.bin";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
const META_FILE: &str = "meta.json";

enum Tokens {
    Owned(Vec<u32>),
    Mapped(TokenFile),
}

impl Tokens {
    fn as_slice(&self) -> &[u32] {
        match self {
            Tokens::Owned(v) => v,
            Tokens::Mapped(f) => f.tokens(),
        }
    }
}

/// What the data folder was built from; a folder whose meta differs is rebuilt.
#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
struct Meta {
    /// Bump when the built-in corpus or tokenising changes, so older data folders are rebuilt.
    format: u32,
    data: DataConfig,
    vocab_size: usize,
    /// (path, bytes, modification time in ns) of every input file, the tokenizer file included.
    inputs: Vec<(String, u64, u128)>,
    /// "byte" or "hf": what `tokenizer.json` holds, if anything.
    tokenizer: String,
    /// Tokens in train.bin and val.bin as written (absent in folders of older builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    split_tokens: Option<(u64, u64)>,
}

impl Meta {
    /// Equal but for what only the written folder knows.
    fn same_inputs(&self, other: &Meta) -> bool {
        (
            self.format,
            &self.data,
            self.vocab_size,
            &self.inputs,
            &self.tokenizer,
        ) == (
            other.format,
            &other.data,
            other.vocab_size,
            &other.inputs,
            &other.tokenizer,
        )
    }
}

/// Whether the run owning data folder `dir` has saved a checkpoint: its data is then what the
/// checkpoints were trained on, and may not silently change.
fn run_has_checkpoints(dir: &Path) -> bool {
    dir.parent()
        .is_some_and(|run| run.join("checkpoints").join("latest").exists())
}

fn fingerprint(paths: &[PathBuf]) -> Result<Vec<(String, u64, u128)>> {
    paths
        .iter()
        .map(|p| {
            let m = std::fs::metadata(p).with_context(|| format!("cannot stat {}", p.display()))?;
            let t = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            Ok((p.display().to_string(), m.len(), t))
        })
        .collect()
}

/// Tokenised train and validation splits, the tokenizer, and the sampling seed.
pub struct Dataset {
    train: Tokens,
    val: Tokens,
    /// Prepared token files (shards, Megatron, llm.c), memory-mapped: when set, batches and
    /// validation come from it and `train`/`val` are empty.
    mixture: Option<Mixture>,
    tokenizer: Arc<dyn Tokenizer>,
    seed: u64,
    source: String,
    /// Bytes of the validation text, for the built-in corpus (whose entropy per byte is known).
    builtin_val_bytes: Option<usize>,
    /// `data.document_mask`: batches carry their document starts.
    document_mask: bool,
}

/// Where the held-out split starts in a text of `len` bytes: the last `val_fraction` of it,
/// moved forward to a UTF-8 character boundary.
fn split_point(text: &[u8], val_fraction: f64) -> usize {
    let mut cut = ((text.len() as f64) * (1.0 - val_fraction)).round() as usize;
    while cut < text.len() && (text[cut] & 0xC0) == 0x80 {
        cut += 1;
    }
    cut.min(text.len())
}

impl Dataset {
    /// Build the dataset of a run from `data`: read the corpus (`data.path`, or the built-in one),
    /// make the tokenizer (`data.tokenizer`; `bpe` is trained on the training split with
    /// `vocab_size` ids), tokenise, and hold out the last `data.val_fraction` for validation.
    ///
    /// With `dir` (a run's `data/` folder) the splits are written there as `train.bin` and
    /// `val.bin`, the tokenizer as `tokenizer.json` (unless it is `byte`), and a later call with
    /// the same inputs maps those files instead of rebuilding. `seed` drives only sampling.
    /// `seq_len` is the model's sequence length: each split must hold one sequence plus one token.
    pub fn build(
        data: &DataConfig,
        vocab_size: usize,
        seq_len: usize,
        seed: u64,
        dir: Option<&Path>,
    ) -> Result<Dataset> {
        Self::build_with(data, vocab_size, seq_len, seed, dir, false)
    }

    /// [`Dataset::build`]; `allow_change`: a run with checkpoints may resume on prepared files
    /// that differ from those it started with (`train --allow-data-change`), else it is refused.
    /// (Text a run tokenised itself is held by the checkpoint's fingerprint of its tokens.)
    pub fn build_with(
        data: &DataConfig,
        vocab_size: usize,
        seq_len: usize,
        seed: u64,
        dir: Option<&Path>,
        allow_change: bool,
    ) -> Result<Dataset> {
        if !(data.val_fraction > 0.0 && data.val_fraction < 1.0) {
            bail!(
                "data.val_fraction = {}: must be between 0 and 1",
                data.val_fraction
            );
        }
        if seq_len == 0 {
            bail!("model.seq_len = 0: must be at least 1");
        }
        if !data.sources.is_empty() || (!data.path.is_empty() && is_prepared(Path::new(&data.path)))
        {
            let ds = Self::build_prepared(data, vocab_size, seq_len, seed, dir, allow_change)?;
            return Ok(Dataset {
                document_mask: data.document_mask,
                ..ds
            });
        }
        if data.document_mask {
            // Text is joined without end-of-document tokens and a bare token file has no
            // index: neither knows where its documents end.
            bail!(
                "data.document_mask = true needs document boundaries, and {} has none (text \
                 the run tokenises is joined without end-of-document tokens; a .bin of tokens \
                 has no document index); prepare it with `ganymede data prepare` and train on \
                 the prepared folder, or set data.document_mask = false",
                if data.path.is_empty() {
                    "the built-in corpus".to_string()
                } else {
                    format!("data.path = {}", data.path)
                }
            );
        }
        let source_path = (!data.path.is_empty()).then(|| PathBuf::from(&data.path));
        let source = match &source_path {
            None => format!("the built-in corpus ({} bytes)", data.builtin_bytes),
            Some(p) => format!("data.path = {}", p.display()),
        };
        let mut inputs = match &source_path {
            None => Vec::new(),
            Some(p) => source_files(p).with_context(|| format!("data.path = {}", p.display()))?,
        };
        let hf_path = match data.tokenizer.as_str() {
            "byte" | "bpe" => None,
            p => Some(PathBuf::from(p)),
        };
        if let Some(p) = &hf_path {
            if !p.exists() {
                bail!("data.tokenizer = {}: no such file", p.display());
            }
            inputs.push(p.clone());
        }
        let meta = Meta {
            format: 1,
            // The planner's assumption changes nothing here: not a reason to tokenise again.
            data: DataConfig {
                mean_document_tokens: DataConfig::default().mean_document_tokens,
                ..data.clone()
            },
            vocab_size,
            inputs: fingerprint(&inputs)?,
            split_tokens: None,
            tokenizer: if data.tokenizer == "byte" {
                "byte"
            } else {
                "hf"
            }
            .into(),
        };

        let ds = match dir.and_then(|d| Self::open_cached(d, &meta, seed, &source)) {
            Some(ds) => ds,
            None => {
                let ds = Self::tokenise(data, vocab_size, seed, source_path.as_deref(), &source)?;
                if let Some(d) = dir {
                    ds.save(d, &meta)?;
                }
                ds
            }
        };
        ds.check_lengths(seq_len, data.val_fraction)?;
        let builtin_val_bytes = source_path.is_none().then(|| {
            // The built-in corpus is ASCII, so the split is exactly where `split_point` puts it.
            data.builtin_bytes
                - ((data.builtin_bytes as f64) * (1.0 - data.val_fraction)).round() as usize
        });
        Ok(Dataset {
            builtin_val_bytes,
            ..ds
        })
    }

    /// Train on prepared token files: map them, check them against the model and (when `dir`
    /// already holds this run's record of them) against what the run started with, and write
    /// that record and the tokenizer to `dir`. Nothing is copied or tokenised.
    fn build_prepared(
        data: &DataConfig,
        vocab_size: usize,
        seq_len: usize,
        seed: u64,
        dir: Option<&Path>,
        allow_change: bool,
    ) -> Result<Dataset> {
        let entries: Vec<(String, Option<f64>)> = if data.sources.is_empty() {
            vec![(data.path.clone(), None)]
        } else {
            data.sources
                .iter()
                .map(|s| (s.path.clone(), s.weight))
                .collect()
        };
        let mut groups = Vec::new();
        for (i, (path, weight)) in entries.iter().enumerate() {
            let key = if data.sources.is_empty() {
                format!("data.path = {path}")
            } else {
                format!("data.sources[{i}].path = {path}")
            };
            let srcs = open_sources(Path::new(path)).with_context(|| key.clone())?;
            groups.push((srcs, *weight));
        }
        let tokenizer = prepared_tokenizer(data, &entries, &groups)?;
        if tokenizer.vocab_size() > vocab_size {
            bail!(
                "the data's tokenizer ({}) has {} ids, more than model.vocab_size = {vocab_size}",
                tokenizer.describe(),
                tokenizer.vocab_size()
            );
        }
        for s in groups.iter().flat_map(|g| g.0.iter()) {
            check_source_ids(s, vocab_size)?;
        }
        let mixture = Mixture::new(groups, data.temperature, data.val_fraction, seq_len, seed)?;
        let record = SourcesRecord {
            format: 1,
            sources: mixture
                .sources
                .iter()
                .map(|s| (s.name.clone(), s.files.clone()))
                .collect(),
            tokenizer: tokenizer.describe(),
        };
        if let Some(d) = dir {
            let check = run_has_checkpoints(d) && !allow_change;
            record.check_or_write(d, &*tokenizer, check)?;
        }
        let source = format!(
            "{} source(s): {}",
            mixture.sources.len(),
            mixture
                .sources
                .iter()
                .zip(&mixture.weights)
                .map(|(s, w)| format!("{} ({} tokens, weight {w:.3})", s.name, s.tokens()))
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(Dataset {
            train: Tokens::Owned(Vec::new()),
            val: Tokens::Owned(Vec::new()),
            mixture: Some(mixture),
            tokenizer,
            seed,
            source,
            builtin_val_bytes: None,
            document_mask: false,
        })
    }

    /// Map a data folder built earlier from the same inputs; None if anything differs or is missing.
    fn open_cached(dir: &Path, meta: &Meta, seed: u64, source: &str) -> Option<Dataset> {
        let text = std::fs::read_to_string(dir.join(META_FILE)).ok()?;
        let old: Meta = serde_json::from_str(&text).ok()?;
        if !old.same_inputs(meta) {
            return None;
        }
        let train = TokenFile::open(&dir.join(TRAIN_FILE)).ok()?;
        let val = TokenFile::open(&dir.join(VAL_FILE)).ok()?;
        // A split cut short (or grown) after it was written is rebuilt, not trained on.
        if old
            .split_tokens
            .is_some_and(|n| n != (train.len() as u64, val.len() as u64))
        {
            return None;
        }
        let tokenizer: Arc<dyn Tokenizer> = if meta.tokenizer == "byte" {
            Arc::new(ByteTokenizer)
        } else {
            Arc::new(HfTokenizer::from_file(&dir.join(TOKENIZER_FILE)).ok()?)
        };
        Some(Dataset {
            train: Tokens::Mapped(train),
            val: Tokens::Mapped(val),
            mixture: None,
            tokenizer,
            seed,
            source: source.to_string(),
            builtin_val_bytes: None,
            document_mask: false,
        })
    }

    fn tokenise(
        data: &DataConfig,
        vocab_size: usize,
        seed: u64,
        path: Option<&Path>,
        source: &str,
    ) -> Result<Dataset> {
        // Token files are used as they are: split by tokens.
        if let Some(p) = path.filter(|p| is_token_file(p)) {
            if data.tokenizer == "bpe" {
                bail!(
                    "data.tokenizer = bpe trains on text, but data.path = {} is a token file; \
                     give its tokenizer.json or use byte",
                    p.display()
                );
            }
            let tokenizer = make_tokenizer(&data.tokenizer, None, vocab_size)?;
            let file =
                TokenFile::open(p).with_context(|| format!("data.path = {}", p.display()))?;
            let all = file.tokens();
            if all.is_empty() {
                bail!("data.path = {}: the token file is empty", p.display());
            }
            check_ids(all, vocab_size, &format!("data.path = {}", p.display()))?;
            let cut = ((all.len() as f64) * (1.0 - data.val_fraction)).round() as usize;
            return Ok(Dataset {
                train: Tokens::Owned(all[..cut].to_vec()),
                val: Tokens::Owned(all[cut..].to_vec()),
                mixture: None,
                tokenizer,
                seed,
                source: source.to_string(),
                builtin_val_bytes: None,
                document_mask: false,
            });
        }

        let text = match path {
            None => builtin_corpus(data.builtin_bytes, BUILTIN_SEED),
            Some(p) => join_docs(
                &read_text_source(p)
                    .with_context(|| format!("data.path = {}", p.display()))?
                    .docs,
            ),
        };
        if text.is_empty() {
            bail!("{source}: the corpus is empty");
        }
        if data.tokenizer != "byte" {
            let bad = crate::tokenizer::invalid_utf8_bytes(&text);
            if bad > 0 && data.refuse_invalid_utf8 {
                let at = std::str::from_utf8(&text)
                    .err()
                    .map_or(0, |e| e.valid_up_to());
                bail!(
                    "{source}: {bad} bytes are not valid UTF-8 (the first at byte {at} of the \
                     joined text) and data.refuse_invalid_utf8 = true"
                );
            }
            if bad > 0 {
                // Bytes tokenise anything; text tokenizers see U+FFFD for what is not UTF-8.
                eprintln!(
                    "warning: {source}: {bad} of {} bytes are not valid UTF-8; data.tokenizer = \
                     {} reads each as U+FFFD",
                    text.len(),
                    data.tokenizer
                );
            }
        }
        let cut = split_point(&text, data.val_fraction);
        let (train_text, val_text) = text.split_at(cut);
        let tokenizer = make_tokenizer(&data.tokenizer, Some(train_text), vocab_size)?;
        let train = tokenizer.encode_bytes(train_text)?;
        let val = tokenizer.encode_bytes(val_text)?;
        Ok(Dataset {
            train: Tokens::Owned(train),
            val: Tokens::Owned(val),
            mixture: None,
            tokenizer,
            seed,
            source: source.to_string(),
            builtin_val_bytes: None,
            document_mask: false,
        })
    }

    fn save(&self, dir: &Path, meta: &Meta) -> Result<()> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create data folder {}", dir.display()))?;
        // Meta goes last, and first away: a folder interrupted mid-write is rebuilt next time.
        let _ = std::fs::remove_file(dir.join(META_FILE));
        write_tokens(&dir.join(TRAIN_FILE), self.train_tokens())?;
        write_tokens(&dir.join(VAL_FILE), self.val_tokens())?;
        let tok_path = dir.join(TOKENIZER_FILE);
        match self.tokenizer.as_hf() {
            Some(hf) => hf.save(&tok_path)?,
            None => {
                let _ = std::fs::remove_file(&tok_path);
            }
        }
        let meta = Meta {
            split_tokens: Some((
                self.train_tokens().len() as u64,
                self.val_tokens().len() as u64,
            )),
            ..meta.clone()
        };
        let json = serde_json::to_string_pretty(&meta).expect("meta serialises");
        std::fs::write(dir.join(META_FILE), json)
            .with_context(|| format!("cannot write {}", dir.join(META_FILE).display()))?;
        Ok(())
    }

    fn check_lengths(&self, seq_len: usize, val_fraction: f64) -> Result<()> {
        let need = seq_len + 1;
        let (nt, nv) = (self.train_tokens().len(), self.val_tokens().len());
        if nt < need {
            bail!(
                "{}: the training split has {nt} tokens, fewer than one sequence \
                 (model.seq_len + 1 = {need}); use more data or a shorter model.seq_len",
                self.source
            );
        }
        if nv < need {
            bail!(
                "{}: the validation split (data.val_fraction = {val_fraction}) has {nv} tokens, \
                 fewer than one sequence (model.seq_len + 1 = {need}); use more data or a larger \
                 data.val_fraction",
                self.source
            );
        }
        Ok(())
    }

    pub fn train_tokens(&self) -> &[u32] {
        self.train.as_slice()
    }

    /// The held-out tokens (the first source's, for prepared sources: see
    /// [`Dataset::all_val_tokens`]).
    pub fn val_tokens(&self) -> &[u32] {
        self.val.as_slice()
    }

    /// Held-out tokens of every source, concatenated in source order (whole documents each).
    pub fn all_val_tokens(&self) -> Vec<u32> {
        match &self.mixture {
            Some(m) => (0..m.sources.len()).flat_map(|s| m.val_tokens(s)).collect(),
            None => self.val_tokens().to_vec(),
        }
    }

    /// The prepared sources, when the run trains on them.
    pub fn mixture(&self) -> Option<&Mixture> {
        self.mixture.as_ref()
    }

    pub fn tokenizer(&self) -> Arc<dyn Tokenizer> {
        self.tokenizer.clone()
    }

    /// Where the data came from, for logs.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// For the built-in corpus, the lowest validation loss any model can reach, in nats per token
    /// of this dataset's tokenizer: the entropy per byte times the validation split's bytes per
    /// token (tokenising is invertible, so the text's information is the same in either unit).
    /// None for user data, whose entropy is unknown.
    pub fn entropy_floor_nats_per_token(&self) -> Option<f64> {
        let bytes = self.builtin_val_bytes?;
        Some(
            crate::builtin_entropy_nats_per_byte() * bytes as f64
                / self.val_tokens().len().max(1) as f64,
        )
    }

    /// Start of sequence `index` of the global batch at `step`: uniform over the training split,
    /// a function of `(seed, step, index)` only.
    fn offset(&self, step: u64, index: u64, seq_len: usize) -> usize {
        let n = self.train_tokens().len();
        assert!(
            n > seq_len,
            "training split has {n} tokens; a sequence needs {}",
            seq_len + 1
        );
        below(keyed(self.seed, step, index), (n - seq_len) as u64) as usize
    }

    /// The training batch at `step`: `batch_size` sequences of `seq_len` inputs and the next-token
    /// targets, each `batch_size * seq_len` long, row-major. Depends only on `(seed, step)`, so a
    /// resumed run sees exactly the batches it would have.
    pub fn batch(&self, step: u64, batch_size: usize, seq_len: usize) -> (Vec<u32>, Vec<u32>) {
        self.batch_slice(step, batch_size, seq_len, 0, 1)
    }

    /// Rank `rank`'s share of the global batch at `step`: sequences
    /// `rank * global_batch / world ..` of it. The shares of all ranks, concatenated in rank order,
    /// are exactly [`Dataset::batch`].
    pub fn batch_slice(
        &self,
        step: u64,
        global_batch: usize,
        seq_len: usize,
        rank: usize,
        world: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        assert!(
            world > 0 && rank < world && global_batch.is_multiple_of(world),
            "batch of {global_batch} cannot be split evenly over {world} ranks (rank {rank})"
        );
        let per = global_batch / world;
        if let Some(m) = &self.mixture {
            let mut inputs = Vec::with_capacity(per * seq_len);
            let mut targets = Vec::with_capacity(per * seq_len);
            for i in rank * per..(rank + 1) * per {
                m.sequence(
                    step * global_batch as u64 + i as u64,
                    &mut inputs,
                    &mut targets,
                );
            }
            return (inputs, targets);
        }
        let t = self.train_tokens();
        let mut inputs = Vec::with_capacity(per * seq_len);
        let mut targets = Vec::with_capacity(per * seq_len);
        for i in rank * per..(rank + 1) * per {
            let o = self.offset(step, i as u64, seq_len);
            inputs.extend_from_slice(&t[o..o + seq_len]);
            targets.extend_from_slice(&t[o + 1..o + seq_len + 1]);
        }
        (inputs, targets)
    }

    /// With `data.document_mask`, where each input token's document starts within its sequence
    /// (`[per-rank batch, seq_len]`, as [`Dataset::batch_slice`] cuts the batch): a token after
    /// a document boundary starts at its own position, the sequence's first document at 0.
    /// None without the mask.
    pub fn batch_doc_starts(
        &self,
        step: u64,
        global_batch: usize,
        seq_len: usize,
        rank: usize,
        world: usize,
    ) -> Option<Vec<u32>> {
        if !self.document_mask {
            return None;
        }
        let m = self
            .mixture
            .as_ref()
            .expect("document masking reads prepared sources");
        let per = global_batch / world;
        let mut out = Vec::with_capacity(per * seq_len);
        for i in rank * per..(rank + 1) * per {
            m.sequence_doc_starts(step * global_batch as u64 + i as u64, &mut out);
        }
        Some(out)
    }

    /// [`Dataset::batch_doc_starts`] of validation batch `index` of `source` (the first when
    /// None), as [`Dataset::val_batch_of`] cuts it.
    pub fn val_doc_starts(
        &self,
        source: Option<usize>,
        index: usize,
        batch_size: usize,
        seq_len: usize,
    ) -> Option<Vec<u32>> {
        if !self.document_mask {
            return None;
        }
        let m = self
            .mixture
            .as_ref()
            .expect("document masking reads prepared sources");
        let s = source.unwrap_or(0);
        let w = m.val_windows(s);
        let mut out = Vec::with_capacity(batch_size * seq_len);
        for b in 0..batch_size {
            m.val_sequence_doc_starts(s, ((index * batch_size + b) as u64) % w, &mut out);
        }
        Some(out)
    }

    /// Number of distinct validation windows of `seq_len + 1` tokens.
    pub fn num_val_windows(&self, seq_len: usize) -> usize {
        match &self.mixture {
            Some(m) => (0..m.sources.len())
                .map(|s| m.val_windows(s) as usize)
                .sum(),
            None => num_eval_windows(self.val_tokens().len(), seq_len),
        }
    }

    /// Names of the sources validated apart (`val_loss/<name>`), with their sampling weights;
    /// empty for a single corpus tokenised by the run.
    pub fn val_sources(&self) -> Vec<(String, f64)> {
        match &self.mixture {
            Some(m) => m
                .sources
                .iter()
                .zip(&m.weights)
                .map(|(s, &w)| (s.name.clone(), w))
                .collect(),
            None => Vec::new(),
        }
    }

    /// Validation batch `index` of source `source` (as [`Dataset::val_sources`] lists them):
    /// its consecutive windows `index * batch_size ..`, wrapping around.
    pub fn val_batch_of(
        &self,
        source: usize,
        index: usize,
        batch_size: usize,
        seq_len: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        let m = self
            .mixture
            .as_ref()
            .expect("val_batch_of needs prepared sources");
        let w = m.val_windows(source);
        let mut inputs = Vec::with_capacity(batch_size * seq_len);
        let mut targets = Vec::with_capacity(batch_size * seq_len);
        for b in 0..batch_size {
            let i = ((index * batch_size + b) as u64) % w;
            m.val_sequence(source, i, &mut inputs, &mut targets);
        }
        (inputs, targets)
    }

    /// Validation batch `index`: the fixed, consecutive windows `index * batch_size ..` of the
    /// validation split (as [`eval_windows`] cuts them), wrapping around when they run out. The
    /// same for every seed, so validation losses compare across runs.
    pub fn val_batch(
        &self,
        index: usize,
        batch_size: usize,
        seq_len: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        if self.mixture.is_some() {
            return self.val_batch_of(0, index, batch_size, seq_len);
        }
        let w = self.num_val_windows(seq_len);
        assert!(
            w > 0,
            "validation split has {} tokens; a window needs {}",
            self.val_tokens().len(),
            seq_len + 1
        );
        let v = self.val_tokens();
        let mut inputs = Vec::with_capacity(batch_size * seq_len);
        let mut targets = Vec::with_capacity(batch_size * seq_len);
        for b in 0..batch_size {
            let o = ((index * batch_size + b) % w) * (seq_len + 1);
            inputs.extend_from_slice(&v[o..o + seq_len]);
            targets.extend_from_slice(&v[o + 1..o + seq_len + 1]);
        }
        (inputs, targets)
    }
}

/// The tokenizer `data.tokenizer` names, checked against the model's vocabulary. `bpe` trains on
/// `train_text` with `vocab_size` ids.
fn make_tokenizer(
    spec: &str,
    train_text: Option<&[u8]>,
    vocab_size: usize,
) -> Result<Arc<dyn Tokenizer>> {
    let tokenizer: Arc<dyn Tokenizer> = match spec {
        "byte" => Arc::new(ByteTokenizer),
        "bpe" => {
            let text = String::from_utf8_lossy(train_text.unwrap_or_default());
            Arc::new(train_bpe([text], vocab_size).with_context(|| {
                format!("data.tokenizer = bpe (model.vocab_size = {vocab_size})")
            })?)
        }
        path => Arc::new(
            HfTokenizer::from_file(Path::new(path))
                .with_context(|| format!("data.tokenizer = {path}"))?,
        ),
    };
    if tokenizer.vocab_size() > vocab_size {
        bail!(
            "data.tokenizer = {spec}: its vocabulary has {} ids, more than model.vocab_size = \
             {vocab_size}",
            tokenizer.vocab_size()
        );
    }
    Ok(tokenizer)
}

/// The tokenizer of prepared sources: the one their manifests name (all must agree), checked
/// against `data.tokenizer` when that names a file; `data.tokenizer` itself for Megatron and
/// llm.c files, which do not say.
fn prepared_tokenizer(
    data: &DataConfig,
    entries: &[(String, Option<f64>)],
    groups: &[(Vec<Source>, Option<f64>)],
) -> Result<Arc<dyn Tokenizer>> {
    let mut from_shards: Option<(u64, PathBuf)> = None;
    for ((path, _), (srcs, _)) in entries.iter().zip(groups) {
        for s in srcs {
            let Some(h) = s.tokenizer_hash else { continue };
            let p = Path::new(path);
            let dir = if p.join(crate::prepare::MANIFEST_FILE).exists() {
                p.to_path_buf()
            } else {
                p.parent().map(Path::to_path_buf).unwrap_or_default()
            };
            match &from_shards {
                Some((h0, d0)) if *h0 != h => bail!(
                    "{} and {} were prepared with different tokenizers; sources of one run must share one",
                    d0.display(),
                    dir.display()
                ),
                Some(_) => {}
                None => from_shards = Some((h, dir)),
            }
        }
    }
    match from_shards {
        None => make_tokenizer(&data.tokenizer, None, usize::MAX),
        Some((0, _)) => {
            if data.tokenizer != "byte" {
                bail!(
                    "data.tokenizer = {}: the prepared data was tokenised by bytes",
                    data.tokenizer
                );
            }
            Ok(Arc::new(ByteTokenizer))
        }
        Some((h, dir)) => {
            let own = dir.join(TOKENIZER_FILE);
            if data.tokenizer != "byte" {
                let bytes = std::fs::read(&data.tokenizer)
                    .with_context(|| format!("data.tokenizer = {}", data.tokenizer))?;
                if crate::shards::fnv1a64(&bytes) != h {
                    bail!(
                        "data.tokenizer = {}: not the tokenizer {} was prepared with ({})",
                        data.tokenizer,
                        dir.display(),
                        own.display()
                    );
                }
            }
            Ok(Arc::new(
                HfTokenizer::from_file(&own).with_context(|| format!("{}", dir.display()))?,
            ))
        }
    }
}

/// Every id of `s` below the model's vocabulary: from the shards' headers where they say it,
/// else by reading the tokens (Megatron and llm.c files), in parallel.
fn check_source_ids(s: &Source, vocab_size: usize) -> Result<()> {
    if let Some(v) = s.vocab_size {
        if v as usize > vocab_size {
            bail!(
                "source {} ({}): its tokenizer has {v} ids, more than model.vocab_size = {vocab_size}",
                s.name,
                s.files[0].path
            );
        }
        return Ok(());
    }
    use rayon::prelude::*;
    const CHUNK: u64 = 1 << 22;
    let n = s.tokens();
    let bad = (0..n.div_ceil(CHUNK)).into_par_iter().find_map_first(|c| {
        let mut buf = Vec::new();
        s.extend(c * CHUNK, ((c + 1) * CHUNK).min(n), &mut buf);
        buf.iter()
            .position(|&t| t as usize >= vocab_size)
            .map(|i| (c * CHUNK + i as u64, buf[i]))
    });
    if let Some((i, t)) = bad {
        bail!(
            "source {} ({}): token {i} has id {t}, outside model.vocab_size = {vocab_size}",
            s.name,
            s.files[0].path
        );
    }
    Ok(())
}

/// What a run trains on from prepared files, kept in its data folder: a resume that finds other
/// files (or other sizes) is refused, naming the file.
#[derive(Serialize, Deserialize, PartialEq, Debug)]
struct SourcesRecord {
    format: u32,
    sources: Vec<(String, Vec<SourceFile>)>,
    tokenizer: String,
}

const SOURCES_FILE: &str = "sources.json";

impl SourcesRecord {
    /// `check`: refuse other files than the record's (a resume); otherwise (re)write it.
    fn check_or_write(&self, dir: &Path, tokenizer: &dyn Tokenizer, check: bool) -> Result<()> {
        let p = dir.join(SOURCES_FILE);
        if let Some(text) = check.then(|| std::fs::read_to_string(&p).ok()).flatten() {
            let old: SourcesRecord = serde_json::from_str(&text)
                .with_context(|| format!("{}: unreadable", p.display()))?;
            let files = |r: &SourcesRecord| -> Vec<SourceFile> {
                r.sources.iter().flat_map(|s| s.1.clone()).collect()
            };
            let (was, now) = (files(&old), files(self));
            for f in &was {
                match now.iter().find(|g| g.path == f.path) {
                    None => bail!(
                        "the data changed since this run started: {} is no longer among its sources ({}; --allow-data-change resumes on it)",
                        f.path,
                        p.display()
                    ),
                    Some(g) if g.bytes != f.bytes => bail!(
                        "the data changed since this run started: {} was {} bytes and is now {} ({}; --allow-data-change resumes on it)",
                        f.path,
                        f.bytes,
                        g.bytes,
                        p.display()
                    ),
                    Some(_) => {}
                }
            }
            if let Some(g) = now.iter().find(|g| !was.iter().any(|f| f.path == g.path)) {
                bail!(
                    "the data changed since this run started: {} was not among its sources ({}; --allow-data-change resumes on it)",
                    g.path,
                    p.display()
                );
            }
            return Ok(());
        }
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create data folder {}", dir.display()))?;
        if let Some(hf) = tokenizer.as_hf() {
            hf.save(&dir.join(TOKENIZER_FILE))?;
        }
        let json = serde_json::to_string_pretty(self).expect("record serialises");
        crate::write_file_atomic(&p, json.as_bytes())
    }
}

/// The tokenizer a run used, from its data folder: `tokenizer.json` if there is one, else bytes.
pub fn load_run_tokenizer(data_dir: &Path) -> Result<Arc<dyn Tokenizer>> {
    let p = data_dir.join(TOKENIZER_FILE);
    if p.exists() {
        Ok(Arc::new(HfTokenizer::from_file(&p)?))
    } else if data_dir.join(META_FILE).exists() || data_dir.join(SOURCES_FILE).exists() {
        Ok(Arc::new(ByteTokenizer))
    } else {
        bail!(
            "{} holds no dataset (no {META_FILE}); was it written by ganymede train?",
            data_dir.display()
        )
    }
}

/// Tokens of a file or folder for evaluation: a `.bin` token file as it is, text through
/// `tokenizer`. Every id must be below `vocab_size`.
pub fn load_eval_tokens(
    path: &Path,
    tokenizer: &dyn Tokenizer,
    vocab_size: usize,
) -> Result<Vec<u32>> {
    let tokens = if is_prepared(path) {
        // Prepared shards, Megatron or llm.c files: every source's tokens, in order.
        let mut all = Vec::new();
        for s in open_sources(path)? {
            s.extend(0, s.tokens(), &mut all);
        }
        all
    } else if is_token_file(path) {
        TokenFile::open(path)?.tokens().to_vec()
    } else {
        let text = join_docs(&read_text_source(path)?.docs);
        tokenizer.encode_bytes(&text)?
    };
    check_ids(&tokens, vocab_size, &path.display().to_string())?;
    Ok(tokens)
}

/// Number of evaluation windows of `seq_len + 1` tokens in `n_tokens` (a final partial window is
/// dropped). Each scores `seq_len` targets.
pub fn num_eval_windows(n_tokens: usize, seq_len: usize) -> usize {
    n_tokens / (seq_len + 1)
}

/// Consecutive, non-overlapping windows of `seq_len + 1` tokens: `(inputs, targets)` with inputs
/// the first `seq_len` tokens of a window and targets the last `seq_len` (the next token of each
/// input). A final partial window is dropped.
pub fn eval_windows(tokens: &[u32], seq_len: usize) -> impl Iterator<Item = (&[u32], &[u32])> {
    tokens
        .chunks_exact(seq_len + 1)
        .map(move |w| (&w[..seq_len], &w[1..]))
}

#[cfg(test)]
mod tests;
