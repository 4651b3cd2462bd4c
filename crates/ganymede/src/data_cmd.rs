//! `ganymede data ...`: preparing a corpus into token shards before any run.

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use ganymede_data::{prepare, EodSpec, PrepareOptions};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenise text (files of any name, folders, JSONL, parquet; .gz/.zst) into token shards
    /// with document indexes, in parallel and restartable, for `data.path` or
    /// `[[data.sources]]`.
    Prepare(PrepareArgs),
}

#[derive(Args)]
pub struct PrepareArgs {
    /// An input (file or folder) as one source, named after it; repeatable.
    #[arg(value_name = "PATH")]
    inputs: Vec<PathBuf>,
    /// A named source, NAME=PATH (repeatable): its shards go to OUT/NAME.
    #[arg(long = "source", value_name = "NAME=PATH")]
    sources: Vec<String>,
    /// Each subfolder of PATH as a source named after it (one folder per language, say).
    #[arg(long = "sources-in", value_name = "PATH")]
    sources_in: Option<PathBuf>,
    /// `byte`, or a Hugging Face tokenizer.json.
    #[arg(long, default_value = "byte")]
    tokenizer: String,
    /// Folder to write (must be new or empty; an interrupted one with the same inputs resumes).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Tokenising threads [default: all cores].
    #[arg(long)]
    workers: Option<usize>,
    /// JSONL field holding the text.
    #[arg(long, default_value = "text")]
    field: String,
    /// Parquet column holding the text.
    #[arg(long, default_value = "text")]
    column: String,
    /// Tokens per shard (a shard closes after the document that reaches it).
    #[arg(long, default_value_t = 1 << 27)]
    shard_tokens: u64,
    /// End-of-document token appended to every document: `auto` (the tokenizer's
    /// <|endoftext|>, </s>, ... if it has one), `none`, a token, or `id:N`.
    #[arg(long, default_value = "auto")]
    eod: String,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
    /// Refuse a document that is not valid UTF-8, naming its file (default: count it, and let
    /// a text tokenizer read its bad bytes as U+FFFD).
    #[arg(long)]
    refuse_invalid_utf8: bool,
}

fn source_name(p: &std::path::Path) -> String {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // "en.jsonl.gz" -> "en"
    name.split('.').next().unwrap_or("").to_string()
}

pub fn run(cmd: DataCommand) -> Result<()> {
    let DataCommand::Prepare(a) = cmd;
    let mut sources: Vec<(String, PathBuf)> = a
        .inputs
        .iter()
        .map(|p| (source_name(p), p.clone()))
        .collect();
    for s in &a.sources {
        let Some((n, p)) = s.split_once('=') else {
            bail!("--source {s}: expected NAME=PATH");
        };
        sources.push((n.to_string(), PathBuf::from(p)));
    }
    if let Some(dir) = &a.sources_in {
        let mut subs: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| anyhow::anyhow!("--sources-in {}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir() && !source_name(p).is_empty())
            .collect();
        subs.sort();
        if subs.is_empty() {
            bail!("--sources-in {}: holds no subfolders", dir.display());
        }
        sources.extend(subs.into_iter().map(|p| (source_name(&p), p)));
    }
    if sources.is_empty() {
        bail!("data prepare: give an input PATH, --source NAME=PATH or --sources-in DIR");
    }
    let eod: EodSpec = a.eod.parse().map_err(|e: String| anyhow::anyhow!(e))?;
    let workers = a
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let t0 = std::time::Instant::now();
    let m = prepare(&PrepareOptions {
        sources,
        tokenizer: a.tokenizer,
        out: a.out.clone(),
        workers,
        field: a.field,
        column: a.column,
        shard_tokens: a.shard_tokens,
        eod,
        progress: !a.quiet,
        refuse_invalid_utf8: a.refuse_invalid_utf8,
        stop_after_shards: std::env::var("GANYMEDE_PREPARE_STOP_AFTER_SHARDS")
            .ok()
            .and_then(|v| v.parse().ok()),
    })?;
    let secs = t0.elapsed().as_secs_f64();
    for s in &m.sources {
        println!(
            "{}: {} documents, {} tokens in {} shard(s) from {} file(s), {} bytes{}",
            s.name,
            s.documents,
            s.tokens,
            s.shards.len(),
            s.files,
            s.input_bytes,
            if s.invalid_utf8_documents > 0 {
                format!(
                    " ({} documents were not valid UTF-8; their bad bytes became U+FFFD)",
                    s.invalid_utf8_documents
                )
            } else {
                String::new()
            }
        );
    }
    let tokens: u64 = m.sources.iter().map(|s| s.tokens).sum();
    // Linux's VmHWM: this process's own peak resident memory, for users sizing a login node.
    let peak = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .map(|v| v.trim().trim_end_matches("kB").trim().to_string())
        })
        .map_or(String::new(), |kib| format!(", peak memory {kib} KiB"));
    println!(
        "prepared {} -> {} in {secs:.1} s ({:.0} tokens/s, {workers} workers{peak}); train on it \
         with --set data.path={}",
        match m.eod {
            Some(e) => format!("{tokens} tokens, each document ended by id {e}"),
            None => format!("{tokens} tokens, no end-of-document token"),
        },
        a.out.display(),
        tokens as f64 / secs.max(1e-9),
        a.out.display()
    );
    Ok(())
}
