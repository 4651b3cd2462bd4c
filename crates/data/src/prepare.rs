//! `ganymede data prepare`: raw text in, token shards out, once, before any run.
//!
//! ```text
//! sources ──► DocStream (in file order) ──► batch of documents ──► tokenise on `workers`
//!   threads (order kept) ──► append + end-of-document id ──► shard-NNNNN.gtok (closed after
//!   the document that reaches `shard_tokens`) ──► manifest.json when every source is done
//! ```
//!
//! Output depends only on the inputs and settings, never on the worker count: documents keep
//! their order and a shard closes after a fixed token count. Memory is a batch of text per
//! worker plus one document index, whatever the corpus size. An interrupted run restarts after
//! its last complete shard: the shards already written say how many documents they hold.

use crate::inputs::{input_files, DocStream};
use crate::shards::{fnv1a64, width_for, Shard, ShardWriter, SHARD_EXT};
use crate::tokenizer::{HfTokenizer, Tokenizer};
use crate::ByteTokenizer;
use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

pub const MANIFEST_FILE: &str = "manifest.json";
const PLAN_FILE: &str = "prepare.json";
const DONE_FILE: &str = "done.json";
/// Text read per worker before a batch is tokenised.
const BATCH_BYTES_PER_WORKER: usize = 4 << 20;
/// The usual names of an end-of-document token, tried in order by `--eod auto`.
const EOD_NAMES: [&str; 5] = [
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eot_id|>",
];

/// Which id ends each document.
#[derive(Clone, Debug, PartialEq)]
pub enum EodSpec {
    /// The tokenizer's own end-of-text token if it has one of the usual names, else none.
    Auto,
    /// No token; document boundaries live in the shards' index only.
    None,
    /// This token (looked up in the tokenizer).
    Token(String),
    /// This id.
    Id(u32),
}

impl std::str::FromStr for EodSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "auto" => EodSpec::Auto,
            "none" => EodSpec::None,
            _ => match s.strip_prefix("id:") {
                Some(n) => EodSpec::Id(
                    n.parse()
                        .map_err(|_| format!("--eod {s}: id:N needs a non-negative integer"))?,
                ),
                None => EodSpec::Token(s.to_string()),
            },
        })
    }
}

/// What `data prepare` is asked to do.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// (name, input path): each source's shards go to `out/<name>/`.
    pub sources: Vec<(String, PathBuf)>,
    /// `byte` or a path to a `tokenizer.json`.
    pub tokenizer: String,
    pub out: PathBuf,
    pub workers: usize,
    /// JSONL field holding the text.
    pub field: String,
    /// Parquet column holding the text.
    pub column: String,
    /// A shard closes after the document that brings it to this many tokens.
    pub shard_tokens: u64,
    pub eod: EodSpec,
    /// Print progress lines to stderr.
    pub progress: bool,
    /// Refuse a document that is not valid UTF-8 (naming its file) instead of counting it.
    pub refuse_invalid_utf8: bool,
    /// Test hook: stop (as if killed) after writing this many shards in this call.
    pub stop_after_shards: Option<usize>,
}

/// The settings a folder was prepared with; a restart must match them.
#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
struct Plan {
    format: u32,
    tokenizer: String,
    tokenizer_hash: u64,
    eod: Option<u32>,
    vocab_size: u64,
    width: u32,
    shard_tokens: u64,
    field: String,
    column: String,
    sources: Vec<PlanSource>,
}

#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
struct PlanSource {
    name: String,
    input: String,
    /// (path, bytes) of every input file.
    files: Vec<(String, u64)>,
}

/// Per-shard entry of the manifest.
#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
pub struct ShardEntry {
    pub file: String,
    pub tokens: u64,
    pub documents: u64,
    pub bytes: u64,
}

/// Per-source entry of the manifest.
#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
pub struct SourceEntry {
    pub name: String,
    pub input: String,
    pub files: usize,
    pub input_bytes: u64,
    pub documents: u64,
    pub tokens: u64,
    /// Documents that were not valid UTF-8 (replaced characters for text tokenizers).
    pub invalid_utf8_documents: u64,
    pub shards: Vec<ShardEntry>,
}

/// `manifest.json` of a prepared folder.
#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
pub struct Manifest {
    pub format: u32,
    /// `byte`, or `tokenizer.json` (a copy beside the manifest).
    pub tokenizer: String,
    pub tokenizer_hash: u64,
    pub eod: Option<u32>,
    pub vocab_size: u64,
    pub token_bytes: u32,
    pub sources: Vec<SourceEntry>,
}

impl Manifest {
    pub fn read(dir: &Path) -> Result<Self> {
        let p = dir.join(MANIFEST_FILE);
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{}: not a manifest", p.display()))
    }
}

/// `done.json` of a finished source.
#[derive(Serialize, Deserialize)]
struct Done {
    invalid_utf8_documents: u64,
}

/// The tokenizer, its hash, and its file's bytes (none for `byte`).
type Loaded = (Arc<dyn Tokenizer>, u64, Option<Vec<u8>>);

fn load_tokenizer(spec: &str) -> Result<Loaded> {
    if spec == "byte" {
        return Ok((Arc::new(ByteTokenizer), 0, None));
    }
    if spec == "bpe" {
        bail!(
            "--tokenizer bpe: train one first (ganymede tokenizer train) and give its \
             tokenizer.json; preparing needs a fixed tokenizer"
        );
    }
    let p = Path::new(spec);
    let bytes =
        std::fs::read(p).with_context(|| format!("--tokenizer {spec}: cannot read the file"))?;
    let tok = HfTokenizer::from_file(p).with_context(|| format!("--tokenizer {spec}"))?;
    Ok((Arc::new(tok), fnv1a64(&bytes), Some(bytes)))
}

fn resolve_eod(spec: &EodSpec, tok: &dyn Tokenizer) -> Result<Option<u32>> {
    let lookup = |name: &str| tok.as_hf().and_then(|h| h.inner().token_to_id(name));
    Ok(match spec {
        EodSpec::None => None,
        EodSpec::Id(i) => Some(*i),
        EodSpec::Token(t) => Some(lookup(t).ok_or_else(|| {
            anyhow!(
                "--eod {t}: the tokenizer ({}) has no such token",
                tok.describe()
            )
        })?),
        EodSpec::Auto => EOD_NAMES.iter().find_map(|n| lookup(n)),
    })
}

fn file_list(files: &[PathBuf]) -> Result<Vec<(String, u64)>> {
    files
        .iter()
        .map(|f| {
            let m = std::fs::metadata(f).with_context(|| format!("cannot stat {}", f.display()))?;
            Ok((f.display().to_string(), m.len()))
        })
        .collect()
}

fn shard_name(i: usize) -> String {
    format!("shard-{i:05}.{SHARD_EXT}")
}

/// Write or check the plan: a fresh folder gets it, a folder with the same plan is restarted,
/// anything else is refused.
fn claim_folder(out: &Path, plan: &Plan) -> Result<bool> {
    let plan_path = out.join(PLAN_FILE);
    if out.join(MANIFEST_FILE).exists() {
        bail!(
            "{} is already a prepared dataset (it has {MANIFEST_FILE}); give another --out",
            out.display()
        );
    }
    if plan_path.exists() {
        let old: Plan = serde_json::from_str(&std::fs::read_to_string(&plan_path)?)
            .with_context(|| format!("{}: unreadable", plan_path.display()))?;
        if &old != plan {
            bail!(
                "{} holds an interrupted preparation with other settings or inputs ({}); \
                 give another --out, or delete it to start again",
                out.display(),
                plan_difference(&old, plan)
            );
        }
        return Ok(true);
    }
    if out.exists()
        && std::fs::read_dir(out)
            .with_context(|| format!("cannot list {}", out.display()))?
            .next()
            .is_some()
    {
        bail!(
            "--out {} exists and is not empty; give a new folder",
            out.display()
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let json = serde_json::to_string_pretty(plan).expect("plan serialises");
    crate::write_file_atomic(&plan_path, json.as_bytes())?;
    Ok(false)
}

fn plan_difference(old: &Plan, new: &Plan) -> String {
    if old.tokenizer_hash != new.tokenizer_hash {
        return "the tokenizer differs".into();
    }
    if old.sources.len() != new.sources.len() {
        return "the sources differ".into();
    }
    for (a, b) in old.sources.iter().zip(&new.sources) {
        if a.name != b.name || a.input != b.input {
            return format!("source {} differs", b.name);
        }
        if a.files != b.files {
            let f = b
                .files
                .iter()
                .find(|f| !a.files.contains(f))
                .or(a.files.iter().find(|f| !b.files.contains(f)))
                .map_or("a file".to_string(), |f| f.0.clone());
            return format!("input {f} changed");
        }
    }
    "a setting differs (shard size, eod, field or column)".into()
}

/// Progress reporting: a line at most every second on a terminal, every ten seconds otherwise.
struct Progress {
    on: bool,
    tty: bool,
    start: Instant,
    last: Instant,
    total_bytes: u64,
}

impl Progress {
    fn line(&mut self, force: bool, source: &str, bytes: u64, docs: u64, tokens: u64) {
        if !self.on {
            return;
        }
        let every = if self.tty { 1.0 } else { 10.0 };
        if !force && self.last.elapsed().as_secs_f64() < every {
            return;
        }
        self.last = Instant::now();
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let frac = bytes as f64 / self.total_bytes.max(1) as f64;
        let eta = if frac > 0.0 {
            format!("{:.0}s", secs / frac - secs)
        } else {
            "?".into()
        };
        let msg = format!(
            "prepare: {source}: {:.1}/{:.1} MB ({:.0}%), {docs} documents, {tokens} tokens, \
             {:.0} tokens/s, ETA {eta}",
            bytes as f64 / 1e6,
            self.total_bytes as f64 / 1e6,
            100.0 * frac,
            tokens as f64 / secs
        );
        if self.tty {
            eprint!("\r{msg}\x1b[K");
            if force {
                eprintln!();
            }
        } else {
            eprintln!("{msg}");
        }
    }
}

/// Prepare every source; returns the manifest (also written to `out/manifest.json`).
pub fn prepare(opts: &PrepareOptions) -> Result<Manifest> {
    if opts.sources.is_empty() {
        bail!("data prepare: give at least one input");
    }
    if opts.shard_tokens == 0 {
        bail!("--shard-tokens 0: must be at least 1");
    }
    let max_workers = 4 * std::thread::available_parallelism().map_or(1, |n| n.get());
    if opts.workers == 0 || opts.workers > max_workers {
        bail!(
            "--workers {}: must be between 1 and {max_workers} (4x this machine's cores)",
            opts.workers
        );
    }
    let mut names = std::collections::HashSet::new();
    for (name, _) in &opts.sources {
        let ok = !name.is_empty()
            && !name.starts_with('.')
            && name
                .chars()
                .all(|c| c.is_alphanumeric() || "-_.".contains(c));
        if !ok {
            bail!("source name {name:?}: use letters, digits, '-', '_' or '.'");
        }
        if !names.insert(name.clone()) {
            bail!("source name {name} is given twice");
        }
    }
    let (tok, tokenizer_hash, tok_bytes) = load_tokenizer(&opts.tokenizer)?;
    let eod = resolve_eod(&opts.eod, &*tok)?;
    let vocab_size = (tok.vocab_size() as u64).max(eod.map_or(0, |e| e as u64 + 1));
    let width = width_for(vocab_size);
    let mut files = Vec::new();
    let mut plan_sources = Vec::new();
    for (name, input) in &opts.sources {
        let f = input_files(input).with_context(|| format!("source {name}"))?;
        plan_sources.push(PlanSource {
            name: name.clone(),
            input: input.display().to_string(),
            files: file_list(&f)?,
        });
        files.push(f);
    }
    let plan = Plan {
        format: 1,
        tokenizer: if tok_bytes.is_some() {
            "tokenizer.json".into()
        } else {
            "byte".into()
        },
        tokenizer_hash,
        eod,
        vocab_size,
        width,
        shard_tokens: opts.shard_tokens,
        field: opts.field.clone(),
        column: opts.column.clone(),
        sources: plan_sources,
    };
    let restarted = claim_folder(&opts.out, &plan)?;
    if let Some(b) = &tok_bytes {
        crate::write_file_atomic(&opts.out.join("tokenizer.json"), b)?;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.workers)
        .build()
        .map_err(|e| anyhow!("cannot start {} workers: {e}", opts.workers))?;
    let total_bytes = plan
        .sources
        .iter()
        .flat_map(|s| s.files.iter().map(|f| f.1))
        .sum();
    let mut progress = Progress {
        on: opts.progress,
        tty: std::io::stderr().is_terminal(),
        start: Instant::now(),
        last: Instant::now(),
        total_bytes,
    };
    if restarted && opts.progress {
        eprintln!(
            "prepare: {} holds an interrupted preparation with the same inputs; continuing",
            opts.out.display()
        );
    }
    let mut budget = opts.stop_after_shards;
    let mut bytes_before = 0;
    for (i, (name, _)) in opts.sources.iter().enumerate() {
        let job = SourceJob {
            dir: opts.out.join(name),
            name,
            files: files[i].clone(),
            tok: &*tok,
            eod,
            plan: &plan,
            pool: &pool,
            workers: opts.workers,
            refuse_invalid_utf8: opts.refuse_invalid_utf8,
        };
        job.run(&mut progress, &mut budget, bytes_before)?;
        bytes_before += plan.sources[i].files.iter().map(|f| f.1).sum::<u64>();
    }
    let manifest = build_manifest(&opts.out, &plan)?;
    let json = serde_json::to_string_pretty(&manifest).expect("manifest serialises");
    crate::write_file_atomic(&opts.out.join(MANIFEST_FILE), json.as_bytes())?;
    Ok(manifest)
}

struct SourceJob<'a> {
    dir: PathBuf,
    name: &'a str,
    files: Vec<PathBuf>,
    tok: &'a dyn Tokenizer,
    eod: Option<u32>,
    plan: &'a Plan,
    pool: &'a rayon::ThreadPool,
    workers: usize,
    refuse_invalid_utf8: bool,
}

impl SourceJob<'_> {
    /// Shards already complete in this source's folder: (count, documents they hold).
    fn existing(&self) -> Result<(usize, u64)> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("cannot create {}", self.dir.display()))?;
        // A shard being written when the last run died.
        for e in std::fs::read_dir(&self.dir)? {
            let p = e?.path();
            if p.extension().is_some_and(|x| x == "tmp") {
                std::fs::remove_file(&p)
                    .with_context(|| format!("cannot remove {}", p.display()))?;
            }
        }
        let (mut n, mut docs) = (0, 0);
        while self.dir.join(shard_name(n)).exists() {
            docs += Shard::open(&self.dir.join(shard_name(n)))?.header.documents;
            n += 1;
        }
        Ok((n, docs))
    }

    fn run(&self, progress: &mut Progress, budget: &mut Option<usize>, bytes0: u64) -> Result<()> {
        if self.dir.join(DONE_FILE).exists() {
            return Ok(());
        }
        let (mut shard_idx, skip) = self.existing()?;
        let mut stream = DocStream::new(self.files.clone(), &self.plan.field, &self.plan.column);
        for _ in 0..skip {
            if stream.next_doc()?.is_none() {
                bail!(
                    "source {}: its inputs now hold fewer than the {skip} documents already \
                     prepared",
                    self.name
                );
            }
        }
        let mut writer: Option<ShardWriter> = None;
        let (mut docs, mut tokens, mut invalid) = (skip, 0u64, 0u64);
        let cap = BATCH_BYTES_PER_WORKER * self.workers;
        loop {
            let mut batch = Vec::new();
            let mut bytes = 0;
            while bytes < cap {
                match stream.next_doc()? {
                    Some(d) => {
                        if self.refuse_invalid_utf8 && std::str::from_utf8(&d).is_err() {
                            bail!(
                                "{}: document {} of source {} is not valid UTF-8 \
                                 (--refuse-invalid-utf8)",
                                stream
                                    .current_file()
                                    .map_or("?".into(), |p| p.display().to_string()),
                                docs + batch.len() as u64 + 1,
                                self.name
                            );
                        }
                        bytes += d.len();
                        batch.push(d);
                    }
                    None => break,
                }
            }
            if batch.is_empty() {
                break;
            }
            let encoded: Vec<Result<(Vec<u32>, bool)>> = self.pool.install(|| {
                batch
                    .par_iter()
                    .map(|d| {
                        let bad = std::str::from_utf8(d).is_err();
                        let mut ids = self.tok.encode_bytes(d)?;
                        ids.extend(self.eod);
                        Ok((ids, bad))
                    })
                    .collect()
            });
            drop(batch);
            for r in encoded {
                let (ids, bad) = r.with_context(|| format!("source {}", self.name))?;
                invalid += bad as u64;
                let w = match &mut writer {
                    Some(w) => w,
                    None => writer.insert(ShardWriter::create(
                        &self.dir.join(shard_name(shard_idx)),
                        self.plan.width,
                        self.plan.tokenizer_hash,
                        self.eod,
                        self.plan.vocab_size,
                    )?),
                };
                w.push_document(&ids)?;
                docs += 1;
                tokens += ids.len() as u64;
                if w.tokens() >= self.plan.shard_tokens {
                    writer.take().expect("open").finish()?;
                    shard_idx += 1;
                    if let Some(b) = budget {
                        *b = b.saturating_sub(1);
                        if *b == 0 {
                            bail!("stopped after the requested number of shards (test hook)");
                        }
                    }
                }
            }
            let read = bytes0 + stream.bytes_read.load(Ordering::Relaxed);
            progress.line(false, self.name, read, docs, tokens);
        }
        if let Some(w) = writer {
            w.finish()?;
        }
        if docs == 0 {
            bail!("source {}: its inputs hold no documents", self.name);
        }
        let read = bytes0 + stream.bytes_read.load(Ordering::Relaxed);
        progress.line(true, self.name, read, docs, tokens);
        let done = Done {
            // Only this call's count: a restarted source counts from its restart point.
            invalid_utf8_documents: invalid,
        };
        crate::write_file_atomic(
            &self.dir.join(DONE_FILE),
            serde_json::to_string(&done).expect("serialises").as_bytes(),
        )
    }
}

fn build_manifest(out: &Path, plan: &Plan) -> Result<Manifest> {
    let mut sources = Vec::new();
    for s in &plan.sources {
        let dir = out.join(&s.name);
        let done: Done = serde_json::from_str(
            &std::fs::read_to_string(dir.join(DONE_FILE))
                .with_context(|| format!("source {} is not finished", s.name))?,
        )?;
        let mut shards = Vec::new();
        let mut i = 0;
        while dir.join(shard_name(i)).exists() {
            let p = dir.join(shard_name(i));
            let sh = Shard::open(&p)?;
            shards.push(ShardEntry {
                file: format!("{}/{}", s.name, shard_name(i)),
                tokens: sh.header.tokens,
                documents: sh.header.documents,
                bytes: std::fs::metadata(&p)?.len(),
            });
            i += 1;
        }
        sources.push(SourceEntry {
            name: s.name.clone(),
            input: s.input.clone(),
            files: s.files.len(),
            input_bytes: s.files.iter().map(|f| f.1).sum(),
            documents: shards.iter().map(|x| x.documents).sum(),
            tokens: shards.iter().map(|x| x.tokens).sum(),
            invalid_utf8_documents: done.invalid_utf8_documents,
            shards,
        });
    }
    Ok(Manifest {
        format: 1,
        tokenizer: plan.tokenizer.clone(),
        tokenizer_hash: plan.tokenizer_hash,
        eod: plan.eod,
        vocab_size: plan.vocab_size,
        token_bytes: plan.width,
        sources,
    })
}
