//! `ganymede plan`: arguments and the entry point the binary calls.

use crate::cluster::Cluster;
use crate::fit::{cuda_fit, fit_check};
use crate::plan::{plan, Layout, MemoryPolicy, NsOn, OptimizerSetup, Placement, Plan};
use crate::render;
use crate::sweep::{sweep, SweepSpace};
use anyhow::Context;
use clap::{Args, Parser, ValueEnum};
use ganymede_config::{AcMode, DeviceKind, JobConfig, OptimizerName};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AcArg {
    Full,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    Muon,
    Adamw,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlacementArg {
    Naive,
    Flexshard,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Gpu,
    Cpu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    Fp32,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GatherDtypeArg {
    Bf16,
    Fp8,
}

/// Predict memory, communication and step time of a layout before queueing it.
///
/// Layout values not given here come from the job config's `[parallelism]` and `[training]`
/// and `model.seq_len`.
#[derive(Args, Clone, Debug)]
pub struct PlanArgs {
    #[arg(long, help = format!("Model/job preset ({})", ganymede_config::PRESETS.join(", ")))]
    pub preset: Option<String>,
    /// Job config TOML file (instead of --preset).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override a config value, section.key=value (repeatable).
    #[arg(long = "set", value_name = "K=V")]
    pub set: Vec<String>,
    /// Cluster preset (jupiter, dgx-h100, dgx-h200, local) or cluster TOML file.
    #[arg(long, value_name = "NAME|FILE", default_value = "local")]
    pub cluster: String,
    /// Nodes (default: the FSDP degree over the node size, else the cluster's).
    #[arg(long)]
    pub nodes: Option<usize>,
    /// GPUs per node (default: the cluster's).
    #[arg(long)]
    pub gpus_per_node: Option<usize>,
    /// FSDP degree within one replica (dp_replicate x dp_shard must equal nodes x GPUs per
    /// node).
    #[arg(long)]
    pub dp_shard: Option<usize>,
    /// HSDP replicas of the FSDP group (default: the job's parallelism.dp_replicate).
    #[arg(long)]
    pub dp_replicate: Option<usize>,
    /// Expert-parallel degree.
    #[arg(long)]
    pub ep: Option<usize>,
    /// Tokens per sequence (default: model.seq_len).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Sequences per GPU per forward/backward (default: the job's training.micro_batch_size,
    /// else a GPU's whole share of the batch); fewer accumulate gradients over microbatches.
    #[arg(long)]
    pub micro_batch: Option<usize>,
    /// Sequences per optimizer step, all GPUs.
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Activation checkpointing.
    #[arg(long, value_enum)]
    pub ac: Option<AcArg>,
    /// Share of layers whose boundary activation goes to host memory.
    #[arg(long)]
    pub offload_fraction: Option<f64>,
    /// FSDP CPU offload of parameter shards, gradients and optimizer state.
    #[arg(long)]
    pub param_offload: bool,
    /// Muon (+ AdamW for router, embeddings, norms) or AdamW everywhere (default: the job's).
    #[arg(long, value_enum)]
    pub optimizer: Option<OptimizerArg>,
    /// Muon placement: naive gather-to-one-rank, or FlexShard.
    #[arg(long, value_enum, default_value = "flexshard")]
    pub placement: PlacementArg,
    /// Where Newton–Schulz runs.
    #[arg(long, value_enum, default_value = "gpu")]
    pub ns_on: DeviceArg,
    /// Gradient reduce-scatter precision.
    #[arg(long, value_enum, default_value = "fp32")]
    pub reduce_dtype: DtypeArg,
    /// Parameter all-gather precision (fp8: TorchTitan's float8 all-gather).
    #[arg(long, value_enum, default_value = "bf16")]
    pub gather_dtype: GatherDtypeArg,
    /// Keep the last block unsharded from forward into backward, as TorchTitan does (saves one
    /// gather per microbatch; ganymede's own trainer reshards it).
    #[arg(long)]
    pub keep_last_block: bool,
    /// Layers gathered ahead of the computing one.
    #[arg(long, default_value_t = 1)]
    pub prefetch: usize,
    /// Model the allocator without FSDP's unshard_async_op.
    #[arg(long)]
    pub no_unshard_async: bool,
    /// Tokens per LM-head/loss chunk (default: the job's `training.loss_chunk_tokens` where
    /// set, else 4096).
    #[arg(long)]
    pub loss_chunk: Option<usize>,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Enumerate layouts (EP, offload, checkpointing, sequence, parameter offload) and rank those
    /// that fit by predicted tokens/s.
    #[arg(long)]
    pub sweep: bool,
    /// A measured throughput (tokens/s per GPU) to express as MFU under both conventions.
    #[arg(long, value_name = "TOKENS_PER_S")]
    pub measured: Option<f64>,
    /// Rows of the sweep to print.
    #[arg(long, default_value_t = 20)]
    pub top: usize,
}

#[derive(Parser, Debug)]
#[command(name = "plan")]
struct Standalone {
    #[command(flatten)]
    args: PlanArgs,
}

/// Everything `plan()` needs, resolved from the arguments.
pub struct Resolved {
    pub job: JobConfig,
    pub cluster: Cluster,
    pub layout: Layout,
    pub policy: MemoryPolicy,
    pub optimizer: OptimizerSetup,
}

impl PlanArgs {
    /// Parse flags (without the program name), as `ganymede plan` would.
    pub fn parse_flags<S: AsRef<str>>(flags: &[S]) -> Result<Self, clap::Error> {
        let argv =
            std::iter::once("plan".to_string()).chain(flags.iter().map(|s| s.as_ref().to_string()));
        Ok(Standalone::try_parse_from(argv)?.args)
    }

    /// Load the job and cluster and fill the layout from flags, then the job config.
    pub fn resolve(&self) -> anyhow::Result<Resolved> {
        let mut job = JobConfig::load(self.preset.as_deref(), self.config.as_deref(), &self.set)
            .context("loading the job config")?;
        if let Some(r) = self.dp_replicate {
            // The job's too, so the memory fit check below shards over one replica.
            job.parallelism.dp_replicate = r;
        }
        let mut cluster = Cluster::resolve(&self.cluster)?;
        if let Some(g) = self.gpus_per_node {
            cluster.gpus_per_node = g;
        }
        let mut layout = Layout::from_job(&job, &cluster);
        // Node size: the flag, else the cluster's. FSDP degree: the flag, else nodes x node
        // size (over the replicas) when nodes or node size were given, else the job's
        // [parallelism] dp_shard. GPUs: dp_replicate x dp_shard.
        let gpn = cluster.gpus_per_node;
        let explicit_nodes = self.nodes.is_some() || self.gpus_per_node.is_some();
        let replicas = layout.dp_replicate.max(1);
        match (self.dp_shard, explicit_nodes) {
            (Some(dp), _) => {
                layout.dp_shard = dp;
                let gpus = replicas * dp;
                (layout.nodes, layout.gpus_per_node) = match self.nodes {
                    Some(n) => (n, gpn),
                    None if gpus < gpn && self.gpus_per_node.is_none() => (1, gpus),
                    None => (gpus.div_ceil(gpn), gpn),
                };
            }
            (None, true) => {
                layout.gpus_per_node = gpn;
                layout.nodes = self.nodes.unwrap_or(layout.nodes);
                layout.dp_shard = layout.nodes * gpn / replicas;
            }
            (None, false) => {}
        }
        if let Some(e) = self.ep {
            layout.ep = e;
        }
        if let Some(s) = self.seq_len {
            layout.seq_len = s;
        }
        if let Some(b) = self.global_batch {
            layout.global_batch = b;
        }
        // Microbatch: the flag, else the job's, else a GPU's whole share of the global batch
        // over the layout's GPUs (what the trainer runs).
        layout.micro_batch = match (self.micro_batch, job.training.micro_batch_size) {
            (Some(m), _) => {
                // The trainer-ledger prediction reads the job's.
                job.training.micro_batch_size = m;
                m
            }
            (None, 0) => (layout.global_batch / layout.world().max(1)).max(1),
            (None, m) => m,
        };
        let mut policy = MemoryPolicy::from_job(&job);
        if let Some(a) = self.ac {
            policy.ac = match a {
                AcArg::Full => AcMode::Full,
                AcArg::None => AcMode::None,
            };
        }
        if let Some(f) = self.offload_fraction {
            policy.offload_fraction = f;
        }
        policy.param_offload = self.param_offload;
        policy.prefetch = self.prefetch;
        policy.unshard_async_op = !self.no_unshard_async;
        policy.reduce_bytes = match self.reduce_dtype {
            DtypeArg::Fp32 => 4.0,
            DtypeArg::Bf16 => 2.0,
        };
        policy.gather_bytes = match self.gather_dtype {
            GatherDtypeArg::Bf16 => 2.0,
            GatherDtypeArg::Fp8 => 1.0,
        };
        policy.keep_last_block = self.keep_last_block;
        if let Some(c) = self.loss_chunk {
            policy.loss_chunk_tokens = c;
        }
        let mut optimizer = OptimizerSetup::from_job(&job);
        if let Some(o) = self.optimizer {
            optimizer.name = match o {
                OptimizerArg::Muon => OptimizerName::Muon,
                OptimizerArg::Adamw => OptimizerName::Adamw,
            };
        }
        optimizer.placement = match self.placement {
            PlacementArg::Naive => Placement::Naive,
            PlacementArg::Flexshard => Placement::Flexshard,
        };
        optimizer.ns_on = match self.ns_on {
            DeviceArg::Gpu => NsOn::Gpu,
            DeviceArg::Cpu => NsOn::Cpu,
        };
        Ok(Resolved {
            job,
            cluster,
            layout,
            policy,
            optimizer,
        })
    }

    /// The plan these arguments describe.
    pub fn plan(&self) -> anyhow::Result<Plan> {
        let r = self.resolve()?;
        Ok(plan(
            &r.job,
            &r.cluster,
            &r.layout,
            &r.policy,
            &r.optimizer,
        )?)
    }
}

/// Run `ganymede plan` with parsed arguments: print the table, JSON, or the sweep.
pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    print!("{}", output(&args)?);
    Ok(())
}

/// What `run` prints.
pub fn output(args: &PlanArgs) -> anyhow::Result<String> {
    let r = args.resolve()?;
    if args.sweep {
        crate::plan::check(&r.job, &r.layout, &r.policy)?;
        let space = SweepSpace::around(&r.job, &r.layout);
        let entries = sweep(
            &r.job,
            &r.cluster,
            &r.layout,
            &r.policy,
            &r.optimizer,
            &space,
        );
        return Ok(if args.json {
            serde_json::to_string_pretty(&entries)? + "\n"
        } else {
            format!(
                "sweep on {} ({} GPUs), ranked by predicted tokens/s per GPU\n{}",
                r.cluster.name,
                r.layout.gpus(),
                render::sweep_table(&entries, args.top)
            )
        });
    }
    let p = plan(&r.job, &r.cluster, &r.layout, &r.policy, &r.optimizer)?;
    Ok(if args.json {
        let mut v = serde_json::to_value(&p)?;
        // The same prediction and verdict the table's section prints, for scripts: this
        // binary's own layout (on a CUDA job, on the cluster's GPU, beside the write-up's system).
        let threads = crate::fit::run_threads(&r.job);
        let ranks = r.layout.world();
        let fit = match r.job.device.kind {
            DeviceKind::CpuTwoMemory => Some(("two_memory", fit_check(&r.job, threads, ranks))),
            DeviceKind::Cuda => {
                let c = cuda_fit(&r.job, threads, ranks, usable_gpu(&r.cluster));
                Some(("cuda", Some(c)))
            }
            DeviceKind::Cpu => None,
        };
        if let Some((key, fit)) = fit {
            v[key] = serde_json::json!({
                "threads": threads,
                "ranks": ranks,
                "prediction": crate::fit::predict_memory(&r.job, threads, ranks),
                "fit": fit,
            });
        }
        serde_json::to_string_pretty(&v)? + "\n"
    } else {
        let mut t = render::table(&p);
        if let Some(x) = args.measured {
            let (mfu, tt) = p.flops.mfu_at(x, r.cluster.gpu.peak_flops);
            t.push_str(&format!(
                "At a measured {x:.0} tokens/s per GPU: MFU {:.1}% (causal), {:.1}% (TorchTitan's convention)\n",
                100.0 * mfu,
                100.0 * tt
            ));
        }
        let threads = crate::fit::run_threads(&r.job);
        match r.job.device.kind {
            DeviceKind::CpuTwoMemory => {
                t.push_str(&crate::fit::render(&r.job, threads, r.layout.world()));
            }
            DeviceKind::Cuda => {
                let gpu = usable_gpu(&r.cluster);
                t.push_str(&crate::fit::render_cuda(
                    &r.job,
                    threads,
                    r.layout.world(),
                    gpu,
                ));
            }
            DeviceKind::Cpu => {}
        }
        t
    })
}

/// The cluster's GPU: its name and the memory a job can use (less what the runtime reserves).
fn usable_gpu(c: &Cluster) -> (&str, f64) {
    (&c.gpu.name, c.gpu.memory_bytes - c.gpu.reserved_bytes)
}

/// Parse `args` (without the program name) as `plan`'s flags and run.
pub fn run_cli(args: &[String]) -> anyhow::Result<()> {
    match PlanArgs::parse_flags(args) {
        Ok(a) => run(a),
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            e.print()?;
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}
