//! `ganymede`: pretrain Mixture-of-Experts language models. Thin glue over the crates: argument
//! parsing here, everything else in `ganymede-train`, `ganymede-data` and `ganymede-plan`.

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use ganymede_train::eval::{self, EvalSource, GenerateOptions};
use ganymede_train::trainer::{self, TrainOptions};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod calibrate;
mod data_cmd;
mod launch;

#[derive(Parser)]
#[command(
    name = "ganymede",
    version,
    about = "Pretrain Mixture-of-Experts language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (no arguments: the `tiny` preset on the built-in corpus).
    Train(TrainArgs),
    /// Mean cross-entropy of a checkpoint over consecutive windows of seq_len + 1 tokens.
    Eval(EvalArgs),
    /// Sample a continuation of a prompt from a checkpoint.
    Generate(GenerateArgs),
    /// Export a checkpoint to another format (`hf`: Hugging Face Qwen3-MoE, or Qwen3 if dense).
    Export(ExportArgs),
    /// Tokenizer tools.
    #[command(subcommand)]
    Tokenizer(TokenizerCommand),
    /// Data tools: `data prepare` tokenises a corpus into shards once, before any run.
    #[command(subcommand)]
    Data(data_cmd::DataCommand),
    /// Predict memory, communication and step time of a parallel layout.
    Plan(ganymede_plan::PlanArgs),
    /// Measure this machine's CPU backend and write a cluster file for `ganymede plan`.
    ///
    /// GEMM rate by size, element-wise bandwidth, per-kernel and per-collective overheads, in a
    /// few seconds; the file is the `local` preset with a measured [cpu] section, for
    /// `ganymede plan --cluster FILE`.
    Calibrate {
        /// Threads of the pool to measure (training.threads; 0 = all cores; at most the cores).
        #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
        threads: usize,
        /// Cluster file to write (refused if it exists, unless --force).
        #[arg(long, value_name = "FILE", default_value = "cluster.toml")]
        out: PathBuf,
        /// Overwrite an existing --out file.
        #[arg(long)]
        force: bool,
        /// Shorter timing batches (about a second in all; noisier).
        #[arg(long)]
        quick: bool,
        /// Measure an accelerator through the backend seam instead (cpu, cpu-two-memory, or cuda
        /// on a `--features cuda` binary): GEMMs by size and dtype, the grouped expert GEMM,
        /// attention by sequence and head dim, Newton-Schulz per shape, element-wise, optimizer
        /// and pinned copy rates, written as a [gpu_measured] section of --base.
        #[arg(long, value_name = "KIND")]
        device: Option<String>,
        /// The cluster (preset or file) a --device calibration adds its section to.
        #[arg(long, value_name = "CLUSTER", default_value = "dgx-h200")]
        base: String,
    },
    /// Check the GPU (binaries built with `--features cuda`) and write OUT/report.md.
    ///
    /// Context, memory, pinned copies, an NVRTC kernel, GEMMs against the CPU, host<->device
    /// GB/s, GEMM TFLOP/s.
    DeviceCheck {
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Write RUN/report.html: charts of a run's metrics, memory and communication, its config.
    Report {
        /// Run directory (holding metrics.jsonl).
        run: PathBuf,
        /// The run's Chrome trace (`train --trace`), for the share of communication and
        /// offload copies hidden behind compute [default: RUN/trace.json if present].
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Overwrite a RUN/report.html that `ganymede report` did not write.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Args)]
struct TrainArgs {
    #[arg(long, conflicts_with = "config", help = format!(
        "Named preset ({}); default tiny", ganymede_config::PRESETS.join(", ")))]
    preset: Option<String>,
    /// Job configuration TOML file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Override a configuration value, e.g. `--set optimizer.lr=0.02` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Total optimizer steps (training.steps).
    #[arg(long, allow_negative_numbers = true)]
    steps: Option<usize>,
    /// Run directory (default runs/<preset>-<UTC timestamp>, or the resumed run's directory).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Continue from a checkpoint directory or a run directory (its latest checkpoint).
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Start from a Hugging Face Qwen3 / Qwen3-MoE folder's weights, shape and tokenizer
    /// (`hf:DIR`); with `--stop-after 0` it only saves them as the step-0 checkpoint.
    #[arg(long, value_name = "hf:DIR", conflicts_with = "resume")]
    init_from: Option<String>,
    /// Stop after this many completed steps (checkpointing there), as if interrupted.
    #[arg(long, value_name = "STEP", allow_negative_numbers = true)]
    stop_after: Option<usize>,
    /// Train on N ranks as threads of this process (FSDP and expert parallelism per
    /// `[parallelism]`; 1, the default, is one process).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    ranks: Option<usize>,
    /// Write every rank's timeline as a Chrome trace.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    #[command(flatten)]
    safety: TrainSafety,
}

/// Reliability options of `train` (see docs/reliability.md).
#[derive(Args)]
struct TrainSafety {
    /// Also stop gracefully on this signal (e.g. USR1, for Slurm's `--signal=USR1@120`), as on
    /// SIGINT and SIGTERM: finish the step, checkpoint, exit with status 75.
    #[arg(long, value_name = "SIGNAL")]
    stop_signal: Option<String>,
    /// Resume an older checkpoint into its own run directory, deleting the run's newer
    /// checkpoints (without it that is refused: give --out for a branch instead).
    #[arg(long)]
    truncate_history: bool,
    /// Resume although the tokenised data differ from those the checkpoint's run trained on
    /// (data deliberately extended or replaced).
    #[arg(long)]
    allow_data_change: bool,
    #[command(flatten)]
    verify: Verify,
}

#[derive(Args)]
struct Verify {
    /// Read checkpoint files without checking them against the manifest's digests.
    #[arg(long)]
    no_verify: bool,
}

#[derive(Args)]
struct EvalArgs {
    /// Checkpoint directory, or a run directory (its latest checkpoint).
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// Text file, folder or JSONL to score (tokenised with the run's tokenizer).
    #[arg(long, value_name = "PATH", conflicts_with = "tokens")]
    data: Option<PathBuf>,
    /// File of little-endian u32 token ids.
    #[arg(long, value_name = "FILE")]
    tokens: Option<PathBuf>,
    /// Print one JSON object: {"loss": .., "tokens": ..}.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    verify: Verify,
}

#[derive(Args)]
struct GenerateArgs {
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 200, allow_negative_numbers = true)]
    max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40, allow_negative_numbers = true)]
    top_k: usize,
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
    #[command(flatten)]
    verify: Verify,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ExportFormat {
    /// Hugging Face transformers, Qwen3-MoE or Qwen3 (config.json + sharded safetensors).
    Hf,
}

#[derive(Args)]
struct ExportArgs {
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    #[arg(long, value_enum, default_value = "hf")]
    format: ExportFormat,
    /// Output folder: new or empty (never a checkpoint's or a run's), unless --force.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Largest safetensors file (bytes, or with KB/MB/GB/KiB/MiB/GiB); more tensors than fit in
    /// one are written as shards with model.safetensors.index.json.
    #[arg(long, value_name = "SIZE", default_value = "5GB")]
    max_shard_size: String,
    /// Overwrite the files of a non-empty --out (a previous export).
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    verify: Verify,
}

#[derive(Subcommand)]
enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer.json on text files, folders or JSONL.
    Train {
        #[arg(long = "input", value_name = "PATH", required = true)]
        inputs: Vec<PathBuf>,
        #[arg(long, default_value_t = 4096, allow_negative_numbers = true)]
        vocab_size: usize,
        /// Refused if it exists, unless --force.
        #[arg(long, value_name = "FILE", default_value = "tokenizer.json")]
        out: PathBuf,
        /// Overwrite an existing --out file.
        #[arg(long)]
        force: bool,
    },
}

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`ganymede generate ... | head`), like other command-line
    // tools, instead of panicking in println!.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => parse_error(e),
    };
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the chain of contexts, outermost first.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cmd: Command) -> Result<()> {
    match cmd {
        Command::Train(a) => train(a)?,
        Command::Eval(a) => eval_checkpoint(a)?,
        Command::Generate(a) => generate(a)?,
        Command::Export(a) => export(a)?,
        Command::Tokenizer(TokenizerCommand::Train {
            inputs,
            vocab_size,
            out,
            force,
        }) => train_tokenizer(&inputs, vocab_size, &out, force)?,
        Command::Data(c) => data_cmd::run(c)?,
        Command::Plan(a) => ganymede_plan::run(a)?,
        Command::Calibrate {
            threads,
            out,
            quick,
            force,
            device,
            base,
        } => {
            ganymede_train::guard::check_output_file(&out, "--out", force)?;
            if let Some(kind) = device {
                let c = calibrate::run_device(&kind, &base, &out, quick)?;
                print!("{}", calibrate::device_summary(&c, &out));
            } else {
                let c = calibrate::run(threads, &out, quick)?;
                print!("{}", calibrate::summary(&c, &out));
            }
        }
        Command::DeviceCheck { out } => device_check(&out)?,
        Command::Report { run, trace, force } => {
            check_report_target(&run, force)?;
            let path = ganymede_report::write_with_trace(&run, trace.as_deref())?;
            println!("{}", path.display());
        }
    }
    Ok(())
}

/// `ganymede train`: the job resolved for the launcher it runs under, then trained; exits
/// with the stop code when a signal ended the run.
fn train(a: TrainArgs) -> Result<()> {
    ganymede_train::checkpoint::set_verify(!a.safety.verify.no_verify);
    let extra = a
        .safety
        .stop_signal
        .as_deref()
        .map(ganymede_train::stop::parse_signal)
        .transpose()?;
    let launcher = launch::Launcher::detect(a.ranks)?;
    let init_from = a
        .init_from
        .as_deref()
        .map(ganymede_train::hf_import::parse_source)
        .transpose()?;
    // The folder's model shape and tokenizer come before the user's overrides.
    let set = match &init_from {
        Some(d) => ganymede_train::hf_import::init_overrides(d, &a.set)?,
        None => a.set.clone(),
    };
    let resolve = |n: usize| {
        trainer::resolve_config(
            a.preset.as_deref(),
            a.config.as_deref(),
            &set,
            a.steps,
            a.resume.as_deref(),
            n,
        )
    };
    let job = launcher.job(resolve)?;
    let opts = TrainOptions {
        name: run_name(a.preset.as_deref(), a.config.as_deref()),
        out: a.out,
        stop_after: a.stop_after,
        quiet: false,
        ranks: job.ranks,
        trace: a.trace,
        init_from,
        truncate_history: a.safety.truncate_history,
        allow_data_change: a.safety.allow_data_change,
        ..Default::default()
    };
    ganymede_train::stop::install(extra)?;
    exit_if_stopped(&launch::train(job, &opts)?);
    Ok(())
}

/// The name of the default run directory: the preset's, else the config file's stem.
fn run_name(preset: Option<&str>, config: Option<&Path>) -> String {
    match (preset, config) {
        (Some(p), _) => p.to_string(),
        (None, Some(f)) => f
            .file_stem()
            .map_or("run".into(), |s| s.to_string_lossy().into_owned()),
        (None, None) => "tiny".into(),
    }
}

/// `ganymede eval`: a checkpoint's loss over the validation split, a data folder or tokens.
fn eval_checkpoint(a: EvalArgs) -> Result<()> {
    ganymede_train::checkpoint::set_verify(!a.verify.no_verify);
    let l = eval::load(&a.checkpoint)?;
    let source = match (a.data, a.tokens) {
        (Some(p), _) => EvalSource::Data(p),
        (None, Some(p)) => EvalSource::Tokens(p),
        (None, None) => EvalSource::Validation,
    };
    let tokens = eval::eval_tokens(&l, &source)?;
    let r = eval::evaluate(&l, &tokens)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "loss {:.6} nats/token ({:.4} bits) over {} tokens, checkpoint {}",
            r.loss,
            r.loss / std::f64::consts::LN_2,
            r.tokens,
            l.dir.display()
        );
    }
    Ok(())
}

/// `ganymede generate`: the prompt, then its continuation streamed as it is drawn.
fn generate(a: GenerateArgs) -> Result<()> {
    anyhow::ensure!(
        a.temperature.is_finite() && a.temperature >= 0.0,
        "--temperature {}: give 0 (greedy) or a positive number",
        a.temperature
    );
    ganymede_train::checkpoint::set_verify(!a.verify.no_verify);
    let l = eval::load(&a.checkpoint)?;
    let o = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
    };
    // Streamed: each piece is printed (and flushed) as it is drawn.
    use std::io::Write;
    let mut stdout = std::io::stdout();
    print!("{}", a.prompt);
    let _ = stdout.flush();
    eval::generate_stream(&l, &a.prompt, &o, &mut |piece| {
        print!("{piece}");
        let _ = stdout.flush();
    })?;
    println!();
    Ok(())
}

/// `ganymede export`: a checkpoint in another format.
fn export(a: ExportArgs) -> Result<()> {
    match a.format {
        ExportFormat::Hf => {
            ganymede_train::checkpoint::set_verify(!a.verify.no_verify);
            ganymede_train::guard::check_output_dir(&a.out, "--out", a.force)?;
            let opts = ganymede_train::export::ExportOptions {
                max_shard_bytes: ganymede_train::export::parse_size(&a.max_shard_size)
                    .map_err(|e| anyhow::anyhow!("--max-shard-size: {e}"))?,
            };
            let s = ganymede_train::export::export_hf(&a.checkpoint, &a.out, &opts)?;
            println!(
                "exported {} to {} ({}: {} tensors, {} bytes in {} file(s))",
                a.checkpoint.display(),
                a.out.display(),
                s.architecture,
                s.tensors,
                s.bytes,
                s.files
            );
        }
    }
    Ok(())
}

/// `ganymede tokenizer train`: a byte-level BPE tokenizer written to `out`.
fn train_tokenizer(inputs: &[PathBuf], vocab_size: usize, out: &Path, force: bool) -> Result<()> {
    ganymede_train::guard::check_output_file(out, "--out", force)?;
    let r = ganymede_data::run_tokenizer_train(inputs, vocab_size, out)?;
    println!(
        "trained byte-level BPE: {} ids from {} files ({} bytes{}), {:.2} bytes/token -> {}",
        r.vocab_size,
        r.files,
        r.input_bytes,
        if r.invalid_utf8_bytes > 0 {
            format!(
                "; {} of them not valid UTF-8, trained on as U+FFFD",
                r.invalid_utf8_bytes
            )
        } else {
            String::new()
        },
        r.bytes_per_token,
        out.display()
    );
    Ok(())
}

/// A command-line error as one line (clap's usage hint dropped); help and version print as
/// usual.
fn parse_error(e: clap::Error) -> ! {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit()
    }
    let text = e.render().to_string();
    let first = text.lines().next().unwrap_or("invalid arguments");
    let first = first.strip_prefix("error: ").unwrap_or(first);
    eprintln!("error: {first} (see --help)");
    std::process::exit(2)
}

/// A run stopped by a signal has checkpointed and said how to resume: exit with the status
/// that says so.
fn exit_if_stopped(s: &trainer::TrainSummary) {
    if s.stopped.is_some() {
        std::process::exit(i32::from(ganymede_train::stop::EXIT_STOPPED))
    }
}

/// `report` rewrites its own page freely (it is derived from the run), but not another file
/// that happens to be called `report.html`, unless `--force`.
fn check_report_target(run: &Path, force: bool) -> Result<()> {
    let page = run.join("report.html");
    let ours = std::fs::read(&page).is_ok_and(|b| {
        let head = String::from_utf8_lossy(&b[..b.len().min(512)]).into_owned();
        head.contains("<title>ganymede report: ")
    });
    anyhow::ensure!(
        !page.exists() || ours || force,
        "{} exists and is not a ganymede report: move it, or pass --force to overwrite it",
        page.display()
    );
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn device_check(_out: &Path) -> Result<()> {
    anyhow::bail!(
        "device-check needs CUDA, but this binary was built without it: build it with `{}`",
        launch::BUILD_WITH_CUDA
    )
}

#[cfg(feature = "cuda")]
fn device_check(out: &Path) -> Result<()> {
    // NCCL's library under the wheel's name too (the NCCL section needs it).
    ganymede_dist::nccl_lib::prepare();
    let s = ganymede_device_check::run(out)?;
    println!(
        "{} ({} section(s) passed, {} failed)",
        s.report.display(),
        s.passed,
        s.failed
    );
    anyhow::ensure!(
        s.failed == 0,
        "{} device check section(s) failed: see {}",
        s.failed,
        s.report.display()
    );
    Ok(())
}
