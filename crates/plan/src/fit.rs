//! Where a CPU run's bytes live, per memory and ledger category, and the fit check before launch.
//!
//! [`predict_memory`] places the terms of [`predict_cpu_ledger`] on the two memories of the
//! CPU backend's two-memory mode (the emulated device, ledger device `gpu0`, and pinned host
//! memory, `host`); [`fit_check`] holds the device's share against `device.memory_gib` and, when
//! it does not fit, finds the smallest change of `[activation_checkpoint]` / `[optimizer]` that
//! does. `ganymede train` runs the check before it builds anything; `ganymede plan` prints it.
//!
//! # Layout rules (world size 1)
//!
//! All in [`place`]; change them there when the runtime moves bytes.
//!
//! 1. `device.kind = "cpu"`: one memory; every category on `host`.
//! 2. `device.kind = "cpu-two-memory"`: every category on the device, except:
//!    - activation offload (`activation_checkpoint.offload_fraction` f, only under
//!      `mode = "full"`): with n = `offloaded_layers(f, L)` > 0, the block inputs (residual
//!      boundaries) 0..n are in pinned host memory (`activations` on `host`, n·N·H f32); the
//!      device keeps the other L + 1 − n boundaries plus min(n, 2) pool slots of N·H f32
//!      (prefetch and write-back). Offloading one or two layers therefore saves nothing.
//!    - optimizer offload (`optimizer.offload = true`): the optimizer state is on `host`;
//!      parameters, gradients and Muon's scratch stay on the device, which gains two staging
//!      slots (`buffers`), each sized for the largest single tensor's state (numel under Muon,
//!      2·numel under AdamW, f32; a layer's routed and shared experts are one stacked tensor).
//!
//! Sharded layouts (`ranks` > 1) are not modelled yet: [`predict_memory`] returns `None`.

use crate::ledger::{predict_cpu_ledger, CpuLedger};
use crate::params::{self, Group, Handler};
use ganymede_config::{offloaded_layers, AcMode, DeviceKind, JobConfig, OptimizerName};
use serde::Serialize;

/// Bytes per ledger category.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Categories {
    pub params: f64,
    pub grads: f64,
    pub optimizer: f64,
    pub activations: f64,
    pub buffers: f64,
}

impl Categories {
    /// (ledger name, bytes), in the order the trainer allocates them at world size 1 (params,
    /// gradients, optimizer state and its scratch, then the activation workspace), which is
    /// the order [`FitCheck::overflow`] fills the device in.
    pub fn entries(&self) -> [(&'static str, f64); 5] {
        [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("buffers", self.buffers),
            ("activations", self.activations),
        ]
    }
    pub fn get(&self, name: &str) -> Option<f64> {
        self.entries()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, b)| b)
    }
    /// The sum over categories: the predicted peak of the memory, since every category is
    /// allocated up front and held for the whole run.
    pub fn total(&self) -> f64 {
        self.entries().iter().map(|(_, b)| b).sum()
    }
}

/// Predicted peak bytes of a run per memory and category.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryPrediction {
    /// The emulated device (ledger device `gpu0`); all zero in one-memory mode.
    pub device: Categories,
    /// Host memory (ledger device `host`): everything in one-memory mode, what is offloaded in
    /// two-memory mode.
    pub host: Categories,
    /// Layers whose block input is in host memory (activation offload).
    pub offloaded_layers: usize,
}

impl MemoryPrediction {
    /// (ledger device name, categories) of each memory the run has.
    pub fn memories(&self) -> Vec<(&'static str, &Categories)> {
        if self.device.total() > 0.0 {
            vec![("gpu0", &self.device), ("host", &self.host)]
        } else {
            vec![("host", &self.host)]
        }
    }
}

/// The predicted peak bytes per memory and category of `job` run with `threads` worker threads
/// on `ranks` ranks; `None` where the layout is not modelled (several ranks).
pub fn predict_memory(job: &JobConfig, threads: usize, ranks: usize) -> Option<MemoryPrediction> {
    if ranks > 1 {
        return None;
    }
    Some(place(job, &predict_cpu_ledger(job, threads)))
}

/// The layout rules of the module documentation, applied to one memory's ledger.
fn place(job: &JobConfig, one: &CpuLedger) -> MemoryPrediction {
    let all = Categories {
        params: one.params,
        grads: one.grads,
        optimizer: one.optimizer,
        activations: one.activations,
        buffers: one.buffers,
    };
    if job.device.kind == DeviceKind::Cpu {
        return MemoryPrediction {
            device: Categories::default(),
            host: all,
            offloaded_layers: 0,
        };
    }
    let (mut device, mut host) = (all, Categories::default());
    let m = &job.model;
    let n_off = match job.activation_checkpoint.mode {
        AcMode::Full => offloaded_layers(job.activation_checkpoint.offload_fraction, m.layers),
        AcMode::None => 0,
    };
    if n_off > 0 {
        let boundary = 4.0 * (job.training.batch_size * m.seq_len * m.hidden) as f64;
        host.activations = n_off as f64 * boundary;
        device.activations += (n_off.min(2) as f64 - n_off as f64) * boundary;
    }
    if job.optimizer.offload {
        host.optimizer = device.optimizer;
        device.optimizer = 0.0;
        device.buffers += 2.0 * 4.0 * largest_tensor_state(job) as f64;
    }
    MemoryPrediction {
        device,
        host,
        offloaded_layers: n_off,
    }
}

/// Elements of optimizer state of the model's largest single tensor (the runtime's tensors: a
/// layer's routed experts are one `[E, rows, cols]` tensor, its shared experts one
/// `[shared, rows, cols]`).
fn largest_tensor_state(job: &JobConfig) -> u64 {
    let m = &job.model;
    let muon = job.optimizer.name == OptimizerName::Muon;
    params::tensors(m)
        .iter()
        .map(|t| {
            let stacked = match t.group {
                Group::RoutedExperts => m.experts as u64,
                Group::SharedExperts => m.shared_experts as u64,
                _ => 1,
            };
            let per = if muon && t.handler() == Handler::Muon {
                1
            } else {
                2
            };
            per * stacked * t.numel()
        })
        .max()
        .unwrap_or(0)
}

/// Bytes of `device.memory_gib` (GiB = 2³⁰ bytes, as the backend counts it).
pub fn capacity_bytes(job: &JobConfig) -> Option<f64> {
    let d = &job.device;
    (d.kind == DeviceKind::CpuTwoMemory && d.memory_gib > 0.0)
        .then(|| (d.memory_gib * (1u64 << 30) as f64).floor())
}

/// The verdict of [`fit_check`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FitCheck {
    /// Device capacity in bytes.
    pub capacity: f64,
    pub prediction: MemoryPrediction,
    pub fits: bool,
    /// When it does not fit: the categories past the capacity when the device is filled in
    /// allocation order ([`Categories::entries`]), with their predicted bytes; the first is
    /// the one whose allocation would fail.
    pub overflow: Vec<(&'static str, f64)>,
    /// When it does not fit: the smallest change that does, if any.
    pub fix: Option<Fix>,
}

/// A change of the job configuration that makes it fit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fix {
    /// `section.key=value` overrides, as `--set` takes them.
    pub sets: Vec<String>,
    /// The predicted device peak with them.
    pub device_peak: f64,
}

impl Fix {
    /// The overrides as command-line flags to paste.
    pub fn flags(&self) -> String {
        self.sets
            .iter()
            .map(|s| format!("--set {s}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Hold `job`'s predicted device peak against its `device.memory_gib`; `None` when there is no
/// capacity (one memory, or `memory_gib = 0`) or the layout is not modelled.
pub fn fit_check(job: &JobConfig, threads: usize, ranks: usize) -> Option<FitCheck> {
    let capacity = capacity_bytes(job)?;
    let prediction = predict_memory(job, threads, ranks)?;
    let fits = prediction.device.total() <= capacity;
    let (overflow, fix) = if fits {
        (vec![], None)
    } else {
        let mut used = 0.0;
        let over = prediction
            .device
            .entries()
            .into_iter()
            .filter(|&(_, b)| {
                used += b;
                b > 0.0 && used > capacity
            })
            .collect();
        (over, smallest_fix(job, threads, ranks, capacity))
    };
    Some(FitCheck {
        capacity,
        prediction,
        fits,
        overflow,
        fix,
    })
}

/// Candidate changes, least intrusive first, as the GPU planner orders them: more activation
/// offload (whole layers, the fewest that fit); optimizer offload; both; then full
/// checkpointing (when off) with the same three. The first that fits wins.
fn smallest_fix(job: &JobConfig, threads: usize, ranks: usize, capacity: f64) -> Option<Fix> {
    let layers = job.model.layers;
    let ac = &job.activation_checkpoint;
    let mut modes = vec![ac.mode];
    if ac.mode == AcMode::None {
        modes.push(AcMode::Full);
    }
    let peak = |j: &JobConfig| predict_memory(j, threads, ranks).map(|p| p.device.total());
    for mode in modes {
        for opt_offload in [job.optimizer.offload, true] {
            let mut j = job.clone();
            let mut sets = vec![];
            if mode != ac.mode {
                j.activation_checkpoint.mode = mode;
                sets.push("activation_checkpoint.mode=full".to_string());
            }
            if opt_offload != job.optimizer.offload {
                j.optimizer.offload = true;
                sets.push("optimizer.offload=true".to_string());
            }
            let fits = |j: &JobConfig| peak(j).is_some_and(|p| p <= capacity);
            if !fits(&j) && mode == AcMode::Full {
                let current = offloaded_layers(ac.offload_fraction, layers);
                let Some(n) = (current + 1..=layers).find(|&n| {
                    let mut k = j.clone();
                    k.activation_checkpoint.offload_fraction = n as f64 / layers as f64;
                    fits(&k)
                }) else {
                    continue;
                };
                // Three decimals map back to the same whole layers (`offloaded_layers`).
                let printed = format!("{:.3}", n as f64 / layers as f64);
                j.activation_checkpoint.offload_fraction =
                    printed.parse().expect("a formatted float parses");
                debug_assert_eq!(
                    offloaded_layers(j.activation_checkpoint.offload_fraction, layers),
                    n
                );
                sets.push(format!("activation_checkpoint.offload_fraction={printed}"));
            }
            if !sets.is_empty() && fits(&j) {
                return Some(Fix {
                    sets,
                    device_peak: peak(&j)?,
                });
            }
        }
    }
    None
}

/// Bytes in GiB with four significant digits at least (tiny runs are a few MiB).
pub fn gib(bytes: f64) -> String {
    let x = bytes / (1u64 << 30) as f64;
    let decimals = if x >= 1.0 {
        3
    } else if x > 0.0 {
        (3 - x.log10().floor() as i32).clamp(3, 9) as usize
    } else {
        0
    };
    format!("{x:.decimals$} GiB")
}

impl FitCheck {
    /// One line: the verdict, and when it does not fit the overflowing categories and the
    /// smallest change that fits (or that nothing does).
    pub fn message(&self) -> String {
        let d = &self.prediction.device;
        let head = format!(
            "predicted device peak {} {} device.memory_gib = {}",
            gib(d.total()),
            if self.fits { "fits in" } else { "exceeds" },
            gib(self.capacity)
        );
        if self.fits {
            return head;
        }
        let over = self
            .overflow
            .iter()
            .map(|(c, b)| format!("{c} {}", gib(*b)))
            .collect::<Vec<_>>()
            .join(", ");
        let on_device = d
            .entries()
            .iter()
            .filter(|(_, b)| *b > 0.0)
            .map(|(c, b)| format!("{c} {}", gib(*b)))
            .collect::<Vec<_>>()
            .join(", ");
        let fix = match &self.fix {
            Some(f) => format!(
                "smallest change that fits (predicted device peak {}): {}",
                gib(f.device_peak),
                f.flags()
            ),
            None => "nothing fits: no activation offload, optimizer offload or checkpointing \
                     brings it under the capacity (raise device.memory_gib or shrink the model \
                     or training.batch_size)"
                .to_string(),
        };
        format!(
            "{head} by {}; overflowing categories (filling the device in allocation order): \
             {over}; on the device: {on_device}; {fix}",
            gib(d.total() - self.capacity)
        )
    }
}

/// Worker threads a run of `job` gets: `training.threads`, or every core (0), as rayon sizes
/// the trainer's pool.
pub fn run_threads(job: &JobConfig) -> usize {
    match job.training.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// `ganymede plan`'s section for a two-memory CPU job: the prediction per memory and
/// category, and the fit check against the job's own `device.memory_gib`.
pub fn render(job: &JobConfig, threads: usize, ranks: usize) -> String {
    let mut s = format!(
        "\nThis job on its own device (device.kind = cpu-two-memory, device.memory_gib = {}, \
         {threads} threads, {ranks} rank{})\n",
        job.device.memory_gib,
        if ranks == 1 { "" } else { "s" }
    );
    let Some(p) = predict_memory(job, threads, ranks) else {
        s.push_str("  not modelled: the prediction covers one rank only (sharded layouts later)\n");
        return s;
    };
    s.push_str(&format!("  {:<14}{:>18}{:>18}\n", "", "gpu0", "host"));
    let row = |name: &str, d: f64, h: f64| format!("  {name:<14}{:>18}{:>18}\n", gib(d), gib(h));
    for ((name, d), (_, h)) in p.device.entries().into_iter().zip(p.host.entries()) {
        s.push_str(&row(name, d, h));
    }
    s.push_str(&row("total", p.device.total(), p.host.total()));
    match fit_check(job, threads, ranks) {
        Some(c) => s.push_str(&format!(
            "  verdict: {}: {}\n",
            if c.fits { "fits" } else { "does not fit" },
            c.message()
        )),
        None => s.push_str("  verdict: no capacity set (device.memory_gib = 0)\n"),
    }
    s
}
