//! `ganymede`: pretrain Mixture-of-Experts language models. Thin glue over the crates: argument
//! parsing here, everything else in `ganymede-train`, `ganymede-data` and `ganymede-plan`.

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use ganymede_config::DeviceKind;
use ganymede_train::comm::Comm;
use ganymede_train::eval::{self, EvalSource, GenerateOptions};
use ganymede_train::trainer::{self, TrainOptions};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod calibrate;
mod data_cmd;

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
        /// Threads of the pool to measure (training.threads; 0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Cluster file to write.
        #[arg(long, value_name = "FILE", default_value = "cluster.toml")]
        out: PathBuf,
        /// Shorter timing batches (about a second in all; noisier).
        #[arg(long)]
        quick: bool,
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
    #[arg(long)]
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
    #[arg(long, value_name = "STEP")]
    stop_after: Option<usize>,
    /// Train on N ranks as threads of this process (FSDP and expert parallelism per
    /// `[parallelism]`; 1, the default, is one process).
    #[arg(long, value_name = "N")]
    ranks: Option<usize>,
    /// Write every rank's timeline as a Chrome trace.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
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
}

#[derive(Args)]
struct GenerateArgs {
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
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
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Largest safetensors file (bytes, or with KB/MB/GB/KiB/MiB/GiB); more tensors than fit in
    /// one are written as shards with model.safetensors.index.json.
    #[arg(long, value_name = "SIZE", default_value = "5GB")]
    max_shard_size: String,
}

#[derive(Subcommand)]
enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer.json on text files, folders or JSONL.
    Train {
        #[arg(long = "input", value_name = "PATH", required = true)]
        inputs: Vec<PathBuf>,
        #[arg(long, default_value_t = 4096)]
        vocab_size: usize,
        #[arg(long, value_name = "FILE", default_value = "tokenizer.json")]
        out: PathBuf,
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
    let cli = Cli::parse();
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
        Command::Train(a) => {
            // The world size: mpirun's processes, else --ranks threads (default one process).
            #[cfg(feature = "mpi")]
            let mpi_size: Option<usize> = std::env::var("OMPI_COMM_WORLD_SIZE")
                .ok()
                .and_then(|v| v.parse().ok());
            #[cfg(not(feature = "mpi"))]
            let mpi_size: Option<usize> = None;
            anyhow::ensure!(
                mpi_size.is_none() || a.ranks.is_none(),
                "under mpirun the processes are the ranks: drop --ranks"
            );
            let ranks = mpi_size.or(a.ranks).unwrap_or(1);
            anyhow::ensure!(ranks >= 1, "--ranks 0: give at least one rank");
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
            // Processes started by a launcher without MPI (srun, torchrun-style) are the ranks
            // of a CUDA job (one per GPU, over NCCL): fit the mesh to their number. Other jobs
            // keep --ranks (a CPU job under srun is one process's, as before).
            let launch_world = (mpi_size.is_none() && a.ranks.is_none())
                .then(|| {
                    ganymede_dist::rendezvous::LaunchEnv::from_env()
                        .ok()
                        .flatten()
                })
                .flatten()
                .map(|e| e.world_size)
                .filter(|&n| n > 1);
            let (cfg, ckpt, ranks) = match launch_world.map(|n| (n, resolve(n))) {
                Some((n, Ok((cfg, ckpt)))) if cfg.device.kind == DeviceKind::Cuda => (cfg, ckpt, n),
                _ => {
                    let (cfg, ckpt) = resolve(ranks)?;
                    (cfg, ckpt, ranks)
                }
            };
            // CUDA on several processes is NCCL's; the launcher's variables say how many.
            let launch = if cfg.device.kind == DeviceKind::Cuda {
                ganymede_dist::rendezvous::LaunchEnv::from_env()?
            } else {
                None
            };
            let comm =
                ganymede_train::comm::choose(cfg.device.kind, mpi_size, launch.as_ref(), a.ranks)?;
            if cfg.device.kind == DeviceKind::Cuda {
                if let Some(e) = cuda_training_refusal(matches!(comm, Comm::Nccl(_))) {
                    return Err(e);
                }
            }
            let name = match (&a.preset, &a.config) {
                (Some(p), _) => p.clone(),
                (None, Some(f)) => f
                    .file_stem()
                    .map_or("run".into(), |s| s.to_string_lossy().into_owned()),
                (None, None) => "tiny".into(),
            };
            let opts = TrainOptions {
                out: a.out,
                stop_after: a.stop_after,
                name,
                quiet: false,
                ranks,
                trace: a.trace,
                init_from,
                ..Default::default()
            };
            #[cfg(feature = "cuda")]
            if let Comm::Nccl(boot) = comm {
                trainer::train_nccl(&cfg, ckpt.as_deref(), &opts, boot)?;
                return Ok(());
            }
            #[cfg(feature = "mpi")]
            if mpi_size.is_some() {
                trainer::train_mpi(&cfg, ckpt.as_deref(), &opts)?;
                return Ok(());
            }
            trainer::train(&cfg, ckpt.as_deref(), &opts)?;
        }
        Command::Eval(a) => {
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
        }
        Command::Generate(a) => {
            let l = eval::load(&a.checkpoint)?;
            let o = GenerateOptions {
                max_new_tokens: a.max_new_tokens,
                temperature: a.temperature,
                top_k: a.top_k,
                seed: a.seed,
            };
            let text = eval::generate_text(&l, &a.prompt, &o)?;
            println!("{}{}", a.prompt, text);
        }
        Command::Export(a) => match a.format {
            ExportFormat::Hf => {
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
        },
        Command::Tokenizer(TokenizerCommand::Train {
            inputs,
            vocab_size,
            out,
        }) => {
            let r = ganymede_data::run_tokenizer_train(&inputs, vocab_size, &out)?;
            println!(
                "trained byte-level BPE: {} ids from {} files ({} bytes), {:.2} bytes/token -> {}",
                r.vocab_size,
                r.files,
                r.input_bytes,
                r.bytes_per_token,
                out.display()
            );
        }
        Command::Data(c) => data_cmd::run(c)?,
        Command::Plan(a) => ganymede_plan::run(a)?,
        Command::Calibrate {
            threads,
            out,
            quick,
        } => {
            let c = calibrate::run(threads, &out, quick)?;
            print!("{}", calibrate::summary(&c, &out));
        }
        Command::DeviceCheck { out } => device_check(&out)?,
        Command::Report { run, trace } => {
            let path = ganymede_report::write_with_trace(&run, trace.as_deref())?;
            println!("{}", path.display());
        }
    }
    Ok(())
}

/// The build command that gives a binary able to use a GPU.
#[cfg(not(feature = "cuda"))]
const BUILD_WITH_CUDA: &str = "cargo build --release -p ganymede --features cuda";

/// Why `train` with `device.kind = "cuda"` cannot run, as one line, before anything is built:
/// no CUDA in this binary, or none on this machine, or (`nccl`: several processes) no NCCL.
/// Never a silent run on the CPU instead.
fn cuda_training_refusal(nccl: bool) -> Option<anyhow::Error> {
    #[cfg(not(feature = "cuda"))]
    return {
        let _ = nccl;
        Some(anyhow::anyhow!(
            "device.kind = \"cuda\", but this binary was built without CUDA: build it with `{BUILD_WITH_CUDA}`"
        ))
    };
    #[cfg(feature = "cuda")]
    if nccl {
        // May start this program again with NCCL's folder on the loader's path (nothing has
        // been built yet, and MPI is not initialised).
        ganymede_cuda::nccl_lib::prepare();
        if let Err(m) = ganymede_cuda::nccl_lib::check() {
            return Some(anyhow::anyhow!(
                "device.kind = \"cuda\" on several processes needs NCCL: {m}"
            ));
        }
    }
    #[cfg(feature = "cuda")]
    ganymede_cuda::device::probe()
        .err()
        .map(|e| anyhow::anyhow!("device.kind = \"cuda\": {e}"))
}

#[cfg(not(feature = "cuda"))]
fn device_check(_out: &Path) -> Result<()> {
    anyhow::bail!("device-check needs CUDA, but this binary was built without it: build it with `{BUILD_WITH_CUDA}`")
}

#[cfg(feature = "cuda")]
fn device_check(out: &Path) -> Result<()> {
    // NCCL's library under the wheel's name too (the NCCL section needs it).
    ganymede_cuda::nccl_lib::prepare();
    let s = ganymede_cuda::device::check::run(out)?;
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
