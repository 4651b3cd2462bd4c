//! Cluster descriptions: presets and TOML files.
//!
//! Every rate is a nominal number times an achieved fraction; the presets say where each number
//! comes from. Bytes are bytes (not GiB) and rates are per second, per GPU, per direction.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

pub const CLUSTERS: &[&str] = &["jupiter", "dgx-h100", "dgx-h200", "local"];

const GIB: f64 = (1u64 << 30) as f64;

/// One accelerator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    pub name: String,
    /// Device memory in bytes.
    pub memory_bytes: f64,
    /// Device memory the runtime keeps for itself (CUDA context, NCCL, allocator headroom).
    pub reserved_bytes: f64,
    /// Dense bf16 peak, FLOP/s (the denominator of MFU).
    pub peak_flops: f64,
    /// f32 peak without tensor cores, FLOP/s: Newton–Schulz's rate under
    /// `optimizer.ns_dtype = "f32"` (cuBLAS's default f32 math). Absent: `peak_flops`, for a
    /// device whose peak is f32 already (the `local` CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_f32_flops: Option<f64>,
    /// Achieved fraction of peak for the model's matrix multiplies.
    pub gemm_efficiency: f64,
    /// Achieved fraction of peak for attention (fused flash-style kernels).
    pub attention_efficiency: f64,
    /// Device memory bandwidth, bytes/s (element-wise optimizer updates).
    pub memory_bytes_per_s: f64,
}

/// The host memory and CPU cores that serve one GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    /// Host memory a job can use, per GPU, in bytes.
    pub usable_bytes_per_gpu: f64,
    pub cores_per_gpu: f64,
    /// f32 peak of those cores, FLOP/s.
    pub peak_f32_flops_per_gpu: f64,
    /// Achieved fraction of that peak for Newton–Schulz matrix multiplies.
    pub gemm_efficiency: f64,
    /// Host memory bandwidth per GPU's share, bytes/s (achieved, for element-wise updates).
    pub memory_bytes_per_s: f64,
}

/// Links, per GPU and per direction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Aggregate GPU–GPU bandwidth inside a node, bytes/s per direction.
    pub nvlink_bytes_per_s: f64,
    pub nvlink_efficiency: f64,
    /// Inter-node bandwidth per GPU (its share of the node's adapters), bytes/s per direction.
    pub ib_bytes_per_s: f64,
    pub ib_efficiency: f64,
    /// Achieved device-to-host and host-to-device copy rates, bytes/s.
    pub d2h_bytes_per_s: f64,
    pub h2d_bytes_per_s: f64,
    /// Fixed cost of one collective across nodes, seconds.
    pub collective_latency_s: f64,
}

/// Measured rates of CPU cores standing in for the GPU (`ganymede calibrate`). When a cluster
/// has this section the planner times compute, element-wise work, ranks' traffic and the
/// optimizer from it (see `cpu_time`) instead of from `gpu.peak_flops` x efficiencies; without
/// it (the GPU presets) nothing changes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuSpec {
    /// Cores the ranks of one node share.
    pub cores: f64,
    /// Threads of one process's pool when calibrated (`training.threads`; ranks as threads
    /// share one pool, so 4 ranks on 2 cores divide the cores).
    pub threads: usize,
    /// GEMM rate as a function of size, whole pool: `[FLOPs of one call, FLOP/s]`, ascending
    /// in FLOPs; interpolated in log(FLOPs), flat beyond the ends.
    pub gemm: Vec<[f64; 2]>,
    /// The same on one thread: GEMMs of a stack spread whole over the threads (experts,
    /// Newton–Schulz of many matrices) each run at this rate, `threads` at once.
    pub gemm_one_thread: Vec<[f64; 2]>,
    /// The fused causal attention kernel: `[head_dim, forward FLOP/s, backward FLOP/s]`,
    /// ascending in head_dim, FLOPs counted as the causal products (forward 2·s²·head_dim per
    /// head and sequence, backward 2.5x that); linear in head_dim, flat beyond the ends. Empty:
    /// attention is timed as GEMMs.
    #[serde(default)]
    pub attention: Vec<[f64; 3]>,
    /// Streaming element-wise rate, bytes read + written per second.
    pub elementwise_bytes_per_s: f64,
    /// The optimizer's element-wise update over all parameter state (from memory, not cache),
    /// bytes per second; 0 (the default): `elementwise_bytes_per_s`.
    #[serde(default)]
    pub optimizer_bytes_per_s: f64,
    /// Fixed cost of one parallel operation (a fork/join over the pool), seconds.
    pub op_overhead_s: f64,
    /// Cost of one collective among ranks as threads (a barrier round), seconds.
    #[serde(default)]
    pub sync_s: f64,
    /// When and under what load the figures were measured.
    #[serde(default)]
    pub calibrated: String,
}

impl CpuSpec {
    /// Interpolated GEMM rate (FLOP/s) of one call of `flops` FLOPs on a curve.
    pub fn rate(curve: &[[f64; 2]], flops: f64) -> f64 {
        let first = curve[0];
        let last = curve[curve.len() - 1];
        if flops <= first[0] {
            return first[1];
        }
        if flops >= last[0] {
            return last[1];
        }
        let i = curve.partition_point(|p| p[0] <= flops);
        let (a, b) = (curve[i - 1], curve[i]);
        // Linear in log(size): the curve climbs over decades of size.
        let t = (flops.ln() - a[0].ln()) / (b[0].ln() - a[0].ln());
        a[1] + t * (b[1] - a[1])
    }

    /// The optimizer update's bytes per second.
    pub fn optimizer_rate(&self) -> f64 {
        if self.optimizer_bytes_per_s > 0.0 {
            self.optimizer_bytes_per_s
        } else {
            self.elementwise_bytes_per_s
        }
    }

    /// The attention kernel's rate at `head_dim`, forward or backward; `None` when not
    /// calibrated.
    pub fn attention_rate(&self, head_dim: f64, backward: bool) -> Option<f64> {
        let j = if backward { 2 } else { 1 };
        let a = &self.attention;
        let (first, last) = (a.first()?, a.last()?);
        if head_dim <= first[0] {
            return Some(first[j]);
        }
        if head_dim >= last[0] {
            return Some(last[j]);
        }
        let i = a.partition_point(|p| p[0] <= head_dim);
        let (x, y) = (a[i - 1], a[i]);
        Some(x[j] + (head_dim - x[0]) / (y[0] - x[0]) * (y[j] - x[j]))
    }

    fn validate(&self, bad: &dyn Fn(&str, f64, &str) -> ClusterError) -> Result<(), ClusterError> {
        if !(self.cores > 0.0 && self.cores.is_finite()) {
            return Err(bad("cpu.cores", self.cores, "must be a positive number"));
        }
        if self.threads == 0 {
            return Err(bad("cpu.threads", 0.0, "must be at least 1"));
        }
        for (key, curve) in [
            ("cpu.gemm", &self.gemm),
            ("cpu.gemm_one_thread", &self.gemm_one_thread),
        ] {
            if curve.is_empty() {
                return Err(bad(
                    key,
                    0.0,
                    "needs at least one [flops, flop_per_s] point",
                ));
            }
            for (i, p) in curve.iter().enumerate() {
                for (j, v) in p.iter().enumerate() {
                    if !(*v > 0.0 && v.is_finite()) {
                        return Err(bad(
                            &format!("{key}[{i}][{j}]"),
                            *v,
                            "must be a positive number",
                        ));
                    }
                }
                if i > 0 && p[0] <= curve[i - 1][0] {
                    return Err(bad(&format!("{key}[{i}][0]"), p[0], "sizes must ascend"));
                }
            }
        }
        for (i, p) in self.attention.iter().enumerate() {
            for (j, v) in p.iter().enumerate() {
                if !(*v > 0.0 && v.is_finite()) {
                    return Err(bad(
                        &format!("cpu.attention[{i}][{j}]"),
                        *v,
                        "must be a positive number",
                    ));
                }
            }
            if i > 0 && p[0] <= self.attention[i - 1][0] {
                return Err(bad(
                    &format!("cpu.attention[{i}][0]"),
                    p[0],
                    "head dims must ascend",
                ));
            }
        }
        if !(self.elementwise_bytes_per_s > 0.0 && self.elementwise_bytes_per_s.is_finite()) {
            return Err(bad(
                "cpu.elementwise_bytes_per_s",
                self.elementwise_bytes_per_s,
                "must be a positive number",
            ));
        }
        for (k, v) in [
            ("cpu.op_overhead_s", self.op_overhead_s),
            ("cpu.sync_s", self.sync_s),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(k, v, "must be >= 0"));
            }
        }
        Ok(())
    }
}

/// Rates of the accelerator measured through the backend seam (`ganymede calibrate --device
/// cuda`, or the CPU backends at small sizes in tests). When a cluster has this section the GPU
/// time model prices GEMMs by their size and dtype, attention by sequence and head dim,
/// Newton–Schulz by matrix size, the element-wise updates and the host copies from it, instead
/// of from `gpu.peak_flops` x efficiencies and `links.d2h/h2d_bytes_per_s`; without it nothing
/// changes. Curves are `[FLOPs of one call, FLOP/s]`, ascending, interpolated in log(FLOPs)
/// and flat beyond the ends (as [`CpuSpec::rate`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuMeasured {
    /// The device measured (the backend's name and the GPU's).
    pub device: String,
    /// GEMMs with bf16 operands (f32 accumulate), by FLOPs per call.
    pub gemm_bf16: Vec<[f64; 2]>,
    /// GEMMs with f32 operands.
    pub gemm_f32: Vec<[f64; 2]>,
    /// The routed experts' grouped GEMM (`NnOps::gemm_grouped`, f32 operands as the seam takes
    /// them) over uneven token counts per expert, by FLOPs of the whole call. Empty: the
    /// experts are priced as one GEMM of their per-expert size.
    #[serde(default)]
    pub gemm_grouped: Vec<[f64; 2]>,
    /// The fused causal attention kernel: `[sequence, head_dim, forward FLOP/s, backward
    /// FLOP/s]`, FLOPs counted as the planner counts them (forward 2·s²·head_dim per head and
    /// sequence, backward 2.5x that). Empty: attention at `gpu.attention_efficiency`.
    #[serde(default)]
    pub attention: Vec<[f64; 4]>,
    /// Newton–Schulz of one matrix: `[rows, cols, steps, seconds with bf16 products, seconds
    /// with f32 products]`. Empty: Newton–Schulz at the GEMM rates.
    #[serde(default)]
    pub newton_schulz: Vec<[f64; 5]>,
    /// Streaming element-wise rate (SwiGLU), bytes read + written per second.
    pub elementwise_bytes_per_s: f64,
    /// The optimizer's element-wise update (AdamW over state in device memory), bytes/s.
    pub optimizer_bytes_per_s: f64,
    /// Asynchronous copies between device and pinned host memory, bytes/s; 0: not measured
    /// (`links.d2h_bytes_per_s` / `h2d_bytes_per_s` stand).
    #[serde(default)]
    pub d2h_bytes_per_s: f64,
    #[serde(default)]
    pub h2d_bytes_per_s: f64,
    /// When, on what, and how long the calibration took.
    #[serde(default)]
    pub calibrated: String,
}

impl GpuMeasured {
    /// GEMM rate of a call of `flops` FLOPs with bf16 or f32 operands.
    pub fn gemm_rate(&self, flops: f64, bf16: bool) -> f64 {
        CpuSpec::rate(
            if bf16 {
                &self.gemm_bf16
            } else {
                &self.gemm_f32
            },
            flops,
        )
    }

    /// The grouped expert GEMM's rate for a call of `flops` in all; `None` when not measured.
    pub fn grouped_rate(&self, flops: f64) -> Option<f64> {
        (!self.gemm_grouped.is_empty()).then(|| CpuSpec::rate(&self.gemm_grouped, flops))
    }

    /// Attention's rate at `seq` and `head_dim`: the measured head dim nearest `head_dim`, and
    /// along its points log-linear in the sequence, flat beyond the ends. `None` when not
    /// measured.
    pub fn attention_rate(&self, seq: f64, head_dim: f64, backward: bool) -> Option<f64> {
        let near = self
            .attention
            .iter()
            .map(|p| p[1])
            .min_by(|a, b| (a - head_dim).abs().total_cmp(&(b - head_dim).abs()))?;
        let j = if backward { 3 } else { 2 };
        let curve: Vec<[f64; 2]> = self
            .attention
            .iter()
            .filter(|p| p[1] == near)
            .map(|p| [p[0], p[j]])
            .collect();
        Some(CpuSpec::rate(&curve, seq))
    }

    /// Seconds of Newton–Schulz on one `rows x cols` matrix for `steps` steps: the measured
    /// rate (GEMM-equivalent FLOPs per second) of the measured shape nearest in size,
    /// interpolated in log(FLOPs) over the measured shapes. `None` when not measured.
    pub fn newton_schulz_s(
        &self,
        rows: usize,
        cols: usize,
        steps: usize,
        bf16: bool,
    ) -> Option<f64> {
        if self.newton_schulz.is_empty() {
            return None;
        }
        let j = if bf16 { 3 } else { 4 };
        let mut curve: Vec<[f64; 2]> = self
            .newton_schulz
            .iter()
            .map(|p| {
                let f = crate::plan::ns_flops(p[0] as u64, p[1] as u64, p[2] as usize);
                [f, f / p[j]]
            })
            .collect();
        curve.sort_by(|a, b| a[0].total_cmp(&b[0]));
        curve.dedup_by(|a, b| a[0] == b[0]);
        let f = crate::plan::ns_flops(rows as u64, cols as u64, steps);
        Some(f / CpuSpec::rate(&curve, f))
    }

    fn validate(&self, bad: &dyn Fn(&str, f64, &str) -> ClusterError) -> Result<(), ClusterError> {
        let check_curve = |key: &str, curve: &[[f64; 2]], required: bool| {
            if required && curve.is_empty() {
                return Err(bad(
                    key,
                    0.0,
                    "needs at least one [flops, flop_per_s] point",
                ));
            }
            for (i, p) in curve.iter().enumerate() {
                for (j, v) in p.iter().enumerate() {
                    if !(*v > 0.0 && v.is_finite()) {
                        return Err(bad(
                            &format!("{key}[{i}][{j}]"),
                            *v,
                            "must be a positive number",
                        ));
                    }
                }
                if i > 0 && p[0] <= curve[i - 1][0] {
                    return Err(bad(&format!("{key}[{i}][0]"), p[0], "sizes must ascend"));
                }
            }
            Ok(())
        };
        check_curve("gpu_measured.gemm_bf16", &self.gemm_bf16, true)?;
        check_curve("gpu_measured.gemm_f32", &self.gemm_f32, true)?;
        check_curve("gpu_measured.gemm_grouped", &self.gemm_grouped, false)?;
        let rows = self
            .attention
            .iter()
            .map(|p| ("gpu_measured.attention", &p[..]))
            .chain(
                self.newton_schulz
                    .iter()
                    .map(|p| ("gpu_measured.newton_schulz", &p[..])),
            );
        for (i, (key, p)) in rows.enumerate() {
            for (j, v) in p.iter().enumerate() {
                if !(*v > 0.0 && v.is_finite()) {
                    return Err(bad(
                        &format!("{key}[{i}][{j}]"),
                        *v,
                        "must be a positive number",
                    ));
                }
            }
        }
        for (k, v) in [
            (
                "gpu_measured.elementwise_bytes_per_s",
                self.elementwise_bytes_per_s,
            ),
            (
                "gpu_measured.optimizer_bytes_per_s",
                self.optimizer_bytes_per_s,
            ),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(bad(k, v, "must be a positive number"));
            }
        }
        for (k, v) in [
            ("gpu_measured.d2h_bytes_per_s", self.d2h_bytes_per_s),
            ("gpu_measured.h2d_bytes_per_s", self.h2d_bytes_per_s),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(k, v, "must be >= 0 (0: not measured)"));
            }
        }
        Ok(())
    }
}

/// A cluster: nodes of identical GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Nodes a job gets when the layout does not say.
    pub nodes: usize,
    pub gpus_per_node: usize,
    pub gpu: GpuSpec,
    pub host: HostSpec,
    pub links: LinkSpec,
    /// CPU cores as the compute device, calibrated (only the `local` preset and calibrated
    /// files have it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuSpec>,
    /// The accelerator's rates, measured (`ganymede calibrate --device cuda`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_measured: Option<GpuMeasured>,
    /// Where each numeric input of `nodes`, `gpus_per_node`, `[gpu]`, `[host]` and `[links]`
    /// comes from, by dotted key: `"measured: …"` (and where), `"spec: …"` (a datasheet or the
    /// write-up) or `"assumed: …"`. Calibrated sections (`[cpu]`) need no entries: their keys
    /// are measured by construction. See [`Cluster::provenance`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sources: BTreeMap<String, String>,
}

/// What kind of number a cluster input is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    /// Measured (the note says where and on what).
    Measured,
    /// From a datasheet or the write-up.
    Spec,
    /// A guess the planner's output leans on.
    Assumed,
    /// The cluster file does not say.
    Unknown,
}

impl SourceKind {
    pub fn name(self) -> &'static str {
        match self {
            SourceKind::Measured => "measured",
            SourceKind::Spec => "spec",
            SourceKind::Assumed => "assumed",
            SourceKind::Unknown => "unknown",
        }
    }
}

/// One numeric input of a cluster and where it comes from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct InputSource {
    /// Dotted key, e.g. `gpu.gemm_efficiency`.
    pub key: String,
    /// The value as written (a curve is summarised by its point count).
    pub value: String,
    pub kind: SourceKind,
    /// Where or why, without the kind's prefix.
    pub note: String,
}

/// Split `"measured: on an H200"` into its kind and note (a bare `"assumed"` has none).
fn parse_source(text: &str) -> Option<(SourceKind, String)> {
    let (head, note) = text.split_once(':').unwrap_or((text, ""));
    let kind = match head.trim() {
        "measured" => SourceKind::Measured,
        "spec" => SourceKind::Spec,
        "assumed" => SourceKind::Assumed,
        _ => return None,
    };
    Some((kind, note.trim().to_string()))
}

/// Short form of a number for the provenance table: 989e12 → 9.89e14, 0.8 → 0.8.
fn short(v: f64) -> String {
    if v != 0.0 && (v.abs() >= 1e5 || v.abs() < 1e-3) {
        format!("{v:.3e}")
    } else {
        format!("{}", (v * 1e4).round() / 1e4)
    }
}

/// A cluster file or preset that cannot be used, naming the file and key.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("unknown cluster '{0}' (presets: {known}; or give a .toml file)", known = CLUSTERS.join(", "))]
    Unknown(String),
    #[error("cannot read cluster file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid cluster file {path}: {message}")]
    Parse { path: String, message: String },
    #[error("invalid cluster {origin}: {key} = {value}: {reason}")]
    Invalid {
        origin: String,
        key: String,
        value: String,
        reason: String,
    },
}

const JUPITER: &str = r#"
name = "jupiter"
description = """JUPITER Booster (write-up): 4 GH200 per node. HBM 96 GB; 120 GB LPDDR5X per Grace of \
which about 108 GiB usable; NVLink-C2C 900 GB/s but measured D2H 170 / H2D 415 GB/s; NVLink 4 \
150 GB/s per direction to each of the 3 other GPUs; 4 x InfiniBand NDR200, 25 GB/s per GPU; \
989 TFLOP/s dense bf16; 72 Grace cores per GPU."""
nodes = 96
gpus_per_node = 4

[gpu]
name = "GH200 (96 GB HBM3)"
memory_bytes = 102625181696     # 97,871 MiB: the 96 GB part as the driver reports it (assumption, not measured here)
reserved_bytes = 2147483648        # 2 GiB: CUDA context, NCCL buffers (assumption)
peak_flops = 989e12                # dense bf16 (H100/GH200 spec)
peak_f32_flops = 67e12             # f32 without tensor cores (H100 SXM spec, same SM)
gemm_efficiency = 0.8              # 790 of 989 TFLOP/s: large bf16 GEMM measured on an H200 (same SM)
attention_efficiency = 0.55        # flash attention forward+backward, published H100 range (assumption)
memory_bytes_per_s = 4.0e12        # HBM3 4 TB/s

[host]
usable_bytes_per_gpu = 115964116992  # 108 GiB (write-up)
cores_per_gpu = 72
peak_f32_flops_per_gpu = 6.9e12      # 72 Neoverse V2 cores x 3.0 GHz x 32 f32 FLOP/cycle
gemm_efficiency = 0.5                # assumption; one Zen 3 core reaches 0.7 on 1024^3 here
memory_bytes_per_s = 3.0e11          # 60% of ~500 GB/s LPDDR5X (assumption)

[links]
nvlink_bytes_per_s = 450e9         # 3 peer links x 150 GB/s per direction
nvlink_efficiency = 0.8            # assumption
ib_bytes_per_s = 25e9              # NDR200 adapter per GPU
ib_efficiency = 0.9                # assumption
d2h_bytes_per_s = 170e9            # measured publicly on GH200
h2d_bytes_per_s = 415e9            # measured publicly on GH200
collective_latency_s = 1e-4        # 100 us per collective across ~100 nodes (assumption)

[sources]
"nodes" = "spec: the write-up's job, 96 nodes (384 GPUs)"
"gpus_per_node" = "spec: 4 GH200 per JUPITER Booster node"
"gpu.memory_bytes" = "assumed: the 96 GB part as the driver would report it, not measured here"
"gpu.reserved_bytes" = "assumed: CUDA context and NCCL buffers"
"gpu.peak_flops" = "spec: dense bf16, H100/GH200 datasheet"
"gpu.peak_f32_flops" = "spec: f32 without tensor cores, H100 SXM datasheet (same SM)"
"gpu.gemm_efficiency" = "measured: large bf16 GEMM on an H200 in this workplace, 790 of 989 TFLOP/s (same SM)"
"gpu.attention_efficiency" = "assumed: published flash-attention range on H100"
"gpu.memory_bytes_per_s" = "spec: HBM3 4 TB/s"
"host.usable_bytes_per_gpu" = "spec: the write-up's 108 GiB of 120 GB LPDDR5X per Grace"
"host.cores_per_gpu" = "spec: 72 Grace cores per GPU"
"host.peak_f32_flops_per_gpu" = "spec: 72 Neoverse V2 cores x 3.0 GHz x 32 f32 FLOP/cycle"
"host.gemm_efficiency" = "assumed: one Zen 3 core reaches 0.7 on 1024^3 on the CPU machine"
"host.memory_bytes_per_s" = "assumed: 60% of ~500 GB/s LPDDR5X"
"links.nvlink_bytes_per_s" = "spec: 3 peer links x 150 GB/s per direction"
"links.nvlink_efficiency" = "assumed"
"links.ib_bytes_per_s" = "spec: one InfiniBand NDR200 adapter per GPU"
"links.ib_efficiency" = "assumed"
"links.d2h_bytes_per_s" = "measured: published GH200 measurement (NVLink-C2C), not in this workplace"
"links.h2d_bytes_per_s" = "measured: published GH200 measurement (NVLink-C2C), not in this workplace"
"links.collective_latency_s" = "assumed: 100 us per collective across ~100 nodes"
"#;

const DGX_H100: &str = r#"
name = "dgx-h100"
description = "DGX H100: 8 H100 SXM 80 GB per node on NVSwitch; 8 x 400 Gb/s InfiniBand; 2 TB host memory; PCIe Gen5 host links."
nodes = 1
gpus_per_node = 8

[gpu]
name = "H100 SXM (80 GB)"
memory_bytes = 85520809984         # 81,559 MiB: the 80 GB part as the driver reports it
reserved_bytes = 2147483648
peak_flops = 989e12
peak_f32_flops = 67e12
gemm_efficiency = 0.8
attention_efficiency = 0.55
memory_bytes_per_s = 3.35e12

[host]
usable_bytes_per_gpu = 214748364800  # 200 GiB of the 2 TB node
cores_per_gpu = 14                   # 2 x 56 Xeon cores / 8
peak_f32_flops_per_gpu = 1.8e12      # 14 cores x 2.0 GHz x 64 f32 FLOP/cycle (AVX-512)
gemm_efficiency = 0.5
memory_bytes_per_s = 4.0e10

[links]
nvlink_bytes_per_s = 450e9
nvlink_efficiency = 0.8
ib_bytes_per_s = 50e9
ib_efficiency = 0.9
d2h_bytes_per_s = 50e9             # PCIe Gen5 x16, achieved (assumption)
h2d_bytes_per_s = 50e9
collective_latency_s = 1e-4

[sources]
"nodes" = "assumed: one node unless the layout says"
"gpus_per_node" = "spec: 8 GPUs per DGX"
"gpu.memory_bytes" = "spec: the 80 GB part as the driver reports it"
"gpu.reserved_bytes" = "assumed: CUDA context and NCCL buffers"
"gpu.peak_flops" = "spec: dense bf16, H100 SXM datasheet"
"gpu.peak_f32_flops" = "spec: f32 without tensor cores, H100 SXM datasheet"
"gpu.gemm_efficiency" = "measured: large bf16 GEMM on an H200 in this workplace, 790 of 989 TFLOP/s (same SM)"
"gpu.attention_efficiency" = "assumed: published flash-attention range on H100"
"gpu.memory_bytes_per_s" = "spec: HBM3 3.35 TB/s"
"host.usable_bytes_per_gpu" = "assumed: 200 GiB of the node's 2 TB per GPU"
"host.cores_per_gpu" = "spec: 2 x 56 Xeon cores / 8"
"host.peak_f32_flops_per_gpu" = "spec: 14 cores x 2.0 GHz x 64 f32 FLOP/cycle (AVX-512)"
"host.gemm_efficiency" = "assumed"
"host.memory_bytes_per_s" = "assumed: a GPU's share of the node's DDR5"
"links.nvlink_bytes_per_s" = "spec: NVLink 4 through NVSwitch, 450 GB/s per direction"
"links.nvlink_efficiency" = "assumed"
"links.ib_bytes_per_s" = "spec: one 400 Gb/s InfiniBand adapter per GPU"
"links.ib_efficiency" = "assumed"
"links.d2h_bytes_per_s" = "assumed: PCIe Gen5 x16, achieved"
"links.h2d_bytes_per_s" = "assumed: PCIe Gen5 x16, achieved"
"links.collective_latency_s" = "assumed"
"#;

const DGX_H200: &str = r#"
name = "dgx-h200"
description = "DGX H200: 8 H200 SXM 141 GB per node on NVSwitch; 8 x 400 Gb/s InfiniBand; 2 TB host memory; PCIe Gen5 host links."
nodes = 1
gpus_per_node = 8

[gpu]
name = "H200 SXM (141 GB)"
memory_bytes = 150754820096        # 143,771 MiB: the 141 GB part as the driver reports it
reserved_bytes = 2147483648
peak_flops = 989e12
peak_f32_flops = 67e12
gemm_efficiency = 0.8              # 790 TFLOP/s bf16 GEMM measured in this workplace
attention_efficiency = 0.55
memory_bytes_per_s = 4.3e12        # device copy measured in this workplace

[host]
usable_bytes_per_gpu = 214748364800
cores_per_gpu = 14
peak_f32_flops_per_gpu = 1.8e12
gemm_efficiency = 0.5
memory_bytes_per_s = 4.0e10

[links]
nvlink_bytes_per_s = 450e9
nvlink_efficiency = 0.8
ib_bytes_per_s = 50e9
ib_efficiency = 0.9
d2h_bytes_per_s = 50e9
h2d_bytes_per_s = 50e9
collective_latency_s = 1e-4

[sources]
"nodes" = "assumed: one node unless the layout says"
"gpus_per_node" = "spec: 8 GPUs per DGX"
"gpu.memory_bytes" = "spec: the 141 GB part as the driver reports it"
"gpu.reserved_bytes" = "assumed: CUDA context and NCCL buffers"
"gpu.peak_flops" = "spec: dense bf16, H200 SXM datasheet (the H100's SM)"
"gpu.peak_f32_flops" = "spec: f32 without tensor cores, H100 SXM datasheet (same SM)"
"gpu.gemm_efficiency" = "measured: large bf16 GEMM on an H200 in this workplace, 790 of 989 TFLOP/s"
"gpu.attention_efficiency" = "assumed: published flash-attention range on H100"
"gpu.memory_bytes_per_s" = "measured: device-to-device copy on an H200 in this workplace"
"host.usable_bytes_per_gpu" = "assumed: 200 GiB of the node's 2 TB per GPU"
"host.cores_per_gpu" = "spec: 2 x 56 Xeon cores / 8"
"host.peak_f32_flops_per_gpu" = "spec: 14 cores x 2.0 GHz x 64 f32 FLOP/cycle (AVX-512)"
"host.gemm_efficiency" = "assumed"
"host.memory_bytes_per_s" = "assumed: a GPU's share of the node's DDR5"
"links.nvlink_bytes_per_s" = "spec: NVLink 4 through NVSwitch, 450 GB/s per direction"
"links.nvlink_efficiency" = "assumed"
"links.ib_bytes_per_s" = "spec: one 400 Gb/s InfiniBand adapter per GPU"
"links.ib_efficiency" = "assumed"
"links.d2h_bytes_per_s" = "assumed: PCIe Gen5 x16, achieved"
"links.h2d_bytes_per_s" = "assumed: PCIe Gen5 x16, achieved"
"links.collective_latency_s" = "assumed"
"#;

const LOCAL: &str = r#"
name = "local"
description = "This machine: 2 AMD EPYC cores (AVX2+FMA) and 24 GiB, no accelerator. The 'GPU' is the CPU in f32; host and device memory are one pool, so host capacity is 0. Ranks are threads of one process sharing the cores; [cpu] holds rates measured by `ganymede calibrate` (replace them with your own: `--cluster FILE`)."
nodes = 1
gpus_per_node = 8                  # up to 8 ranks as threads of one process, on the one machine

[gpu]
name = "2 x Zen 3 cores (f32)"
memory_bytes = 25769803776         # 24 GiB
reserved_bytes = 2147483648        # OS and process
peak_flops = 1.92e11               # 2 cores x 3.0 GHz x 32 f32 FLOP/cycle (AVX2 FMA)
gemm_efficiency = 0.7              # 68 GFLOP/s f32 GEMM 1024^3 measured on one core
attention_efficiency = 0.3         # assumption
memory_bytes_per_s = 2.0e10

[host]
usable_bytes_per_gpu = 0
cores_per_gpu = 2
peak_f32_flops_per_gpu = 1.92e11
gemm_efficiency = 0.7
memory_bytes_per_s = 2.0e10

[links]
nvlink_bytes_per_s = 1e10
nvlink_efficiency = 1.0
ib_bytes_per_s = 1e9
ib_efficiency = 1.0
d2h_bytes_per_s = 2e10
h2d_bytes_per_s = 2e10
collective_latency_s = 1e-5

[cpu]
cores = 2
threads = 2
# GEMM FLOP/s by FLOPs per call (2 threads; one thread), operands from memory
gemm = [[6.55e+04, 1.56e+10], [5.24e+05, 4.46e+10], [1.05e+06, 5.85e+10], [2.1e+06, 7.63e+10], [4.19e+06, 8.98e+10], [8.39e+06, 9.08e+10], [3.36e+07, 1.08e+11], [6.71e+07, 1.12e+11], [1.34e+08, 1.2e+11], [2.68e+08, 1.28e+11], [1.07e+09, 1.22e+11]]
gemm_one_thread = [[6.55e+04, 1.76e+10], [5.24e+05, 3.13e+10], [1.05e+06, 4.27e+10], [2.1e+06, 5.35e+10], [4.19e+06, 5.66e+10], [8.39e+06, 5.74e+10], [3.36e+07, 6.69e+10], [6.71e+07, 7.23e+10], [1.34e+08, 7.44e+10], [2.68e+08, 7.43e+10], [1.07e+09, 8.23e+10]]
# fused causal attention: [head_dim, forward, backward FLOP/s]
attention = [[16, 2.2e+10, 3.26e+10], [32, 3.2e+10, 4.07e+10], [64, 4.15e+10, 4.54e+10]]
elementwise_bytes_per_s = 1.59e+10
optimizer_bytes_per_s = 3.07e+10
op_overhead_s = 9.39e-09
sync_s = 2.71e-05
calibrated = "2026-12-01 08:12:52 UTC, 2 threads on 2 cores, load average 4.05 5.51 5.33 before / 4.05 5.51 5.33 after, 4.1 s (`ganymede calibrate`, this machine under other engineers' builds)"

[sources]
"nodes" = "spec: this one machine"
"gpus_per_node" = "assumed: up to 8 ranks as threads of one process"
"gpu.memory_bytes" = "spec: this machine's 24 GiB"
"gpu.reserved_bytes" = "assumed: the OS and the process"
"gpu.peak_flops" = "spec: 2 cores x 3.0 GHz x 32 f32 FLOP/cycle (AVX2 FMA)"
"gpu.gemm_efficiency" = "measured: 68 GFLOP/s f32 GEMM 1024^3 on one core of this machine"
"gpu.attention_efficiency" = "assumed"
"gpu.memory_bytes_per_s" = "assumed"
"host.usable_bytes_per_gpu" = "spec: host and device are one pool, counted on the device"
"host.cores_per_gpu" = "spec: this machine's 2 cores"
"host.peak_f32_flops_per_gpu" = "spec: 2 cores x 3.0 GHz x 32 f32 FLOP/cycle (AVX2 FMA)"
"host.gemm_efficiency" = "measured: 68 GFLOP/s f32 GEMM 1024^3 on one core of this machine"
"host.memory_bytes_per_s" = "assumed"
"links.nvlink_bytes_per_s" = "assumed: ranks as threads copy through memory"
"links.nvlink_efficiency" = "assumed"
"links.ib_bytes_per_s" = "assumed: no network; unused by one node"
"links.ib_efficiency" = "assumed"
"links.d2h_bytes_per_s" = "assumed: a memory copy"
"links.h2d_bytes_per_s" = "assumed: a memory copy"
"links.collective_latency_s" = "assumed: [cpu].sync_s replaces it when present"
"#;

impl Cluster {
    /// A named preset.
    pub fn preset(name: &str) -> Result<Self, ClusterError> {
        let text = match name {
            "jupiter" => JUPITER,
            "dgx-h100" => DGX_H100,
            "dgx-h200" => DGX_H200,
            "local" => LOCAL,
            other => return Err(ClusterError::Unknown(other.to_string())),
        };
        Self::from_toml_str(text, &format!("preset {name}"))
    }

    /// A preset name, or a path to a TOML file (anything ending in `.toml` or naming a file).
    pub fn resolve(name_or_path: &str) -> Result<Self, ClusterError> {
        if CLUSTERS.contains(&name_or_path) {
            return Self::preset(name_or_path);
        }
        let p = Path::new(name_or_path);
        if name_or_path.ends_with(".toml") || p.exists() {
            return Self::from_file(p);
        }
        Err(ClusterError::Unknown(name_or_path.to_string()))
    }

    pub fn from_file(path: &Path) -> Result<Self, ClusterError> {
        let text = std::fs::read_to_string(path).map_err(|source| ClusterError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Parse and validate; `origin` names the document in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, ClusterError> {
        let c: Cluster = toml::from_str(text).map_err(|e| ClusterError::Parse {
            path: origin.to_string(),
            message: e.to_string(),
        })?;
        c.validate(origin)?;
        Ok(c)
    }

    pub fn to_toml(&self) -> String {
        // Not pretty: the calibrated GEMM curves stay one line each.
        toml::to_string(self).expect("cluster serialises")
    }

    pub fn validate(&self, origin: &str) -> Result<(), ClusterError> {
        let bad = |key: &str, value: f64, reason: &str| ClusterError::Invalid {
            origin: origin.to_string(),
            key: key.to_string(),
            value: value.to_string(),
            reason: reason.to_string(),
        };
        if self.nodes == 0 {
            return Err(bad("nodes", 0.0, "must be at least 1"));
        }
        if self.gpus_per_node == 0 {
            return Err(bad("gpus_per_node", 0.0, "must be at least 1"));
        }
        let positive = [
            ("gpu.memory_bytes", self.gpu.memory_bytes),
            ("gpu.peak_flops", self.gpu.peak_flops),
            ("gpu.memory_bytes_per_s", self.gpu.memory_bytes_per_s),
            (
                "host.peak_f32_flops_per_gpu",
                self.host.peak_f32_flops_per_gpu,
            ),
            ("host.memory_bytes_per_s", self.host.memory_bytes_per_s),
            ("links.nvlink_bytes_per_s", self.links.nvlink_bytes_per_s),
            ("links.ib_bytes_per_s", self.links.ib_bytes_per_s),
            ("links.d2h_bytes_per_s", self.links.d2h_bytes_per_s),
            ("links.h2d_bytes_per_s", self.links.h2d_bytes_per_s),
        ];
        let f32_peak = self.gpu.peak_f32_flops.map(|v| ("gpu.peak_f32_flops", v));
        for (k, v) in positive.into_iter().chain(f32_peak) {
            if !(v > 0.0 && v.is_finite()) {
                return Err(bad(k, v, "must be a positive number"));
            }
        }
        let fractions = [
            ("gpu.gemm_efficiency", self.gpu.gemm_efficiency),
            ("gpu.attention_efficiency", self.gpu.attention_efficiency),
            ("host.gemm_efficiency", self.host.gemm_efficiency),
            ("links.nvlink_efficiency", self.links.nvlink_efficiency),
            ("links.ib_efficiency", self.links.ib_efficiency),
        ];
        for (k, v) in fractions {
            if !(v > 0.0 && v <= 1.0) {
                return Err(bad(k, v, "must be in (0, 1]"));
            }
        }
        let non_negative = [
            ("gpu.reserved_bytes", self.gpu.reserved_bytes),
            ("host.usable_bytes_per_gpu", self.host.usable_bytes_per_gpu),
            ("host.cores_per_gpu", self.host.cores_per_gpu),
            (
                "links.collective_latency_s",
                self.links.collective_latency_s,
            ),
        ];
        for (k, v) in non_negative {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad(k, v, "must be >= 0"));
            }
        }
        if let Some(cpu) = &self.cpu {
            cpu.validate(&bad)?;
        }
        if let Some(g) = &self.gpu_measured {
            g.validate(&bad)?;
        }
        self.validate_sources(origin)?;
        if self.gpu.reserved_bytes >= self.gpu.memory_bytes {
            return Err(bad(
                "gpu.reserved_bytes",
                self.gpu.reserved_bytes,
                "must be below gpu.memory_bytes",
            ));
        }
        Ok(())
    }

    /// Every numeric input of the hand-written sections, by dotted key, in file order: what
    /// [`Cluster::sources`] must cover.
    pub fn numeric_inputs(&self) -> Vec<(&'static str, f64)> {
        let (g, h, l) = (&self.gpu, &self.host, &self.links);
        let mut v = vec![
            ("nodes", self.nodes as f64),
            ("gpus_per_node", self.gpus_per_node as f64),
            ("gpu.memory_bytes", g.memory_bytes),
            ("gpu.reserved_bytes", g.reserved_bytes),
            ("gpu.peak_flops", g.peak_flops),
        ];
        if let Some(f) = g.peak_f32_flops {
            v.push(("gpu.peak_f32_flops", f));
        }
        v.extend([
            ("gpu.gemm_efficiency", g.gemm_efficiency),
            ("gpu.attention_efficiency", g.attention_efficiency),
            ("gpu.memory_bytes_per_s", g.memory_bytes_per_s),
            ("host.usable_bytes_per_gpu", h.usable_bytes_per_gpu),
            ("host.cores_per_gpu", h.cores_per_gpu),
            ("host.peak_f32_flops_per_gpu", h.peak_f32_flops_per_gpu),
            ("host.gemm_efficiency", h.gemm_efficiency),
            ("host.memory_bytes_per_s", h.memory_bytes_per_s),
            ("links.nvlink_bytes_per_s", l.nvlink_bytes_per_s),
            ("links.nvlink_efficiency", l.nvlink_efficiency),
            ("links.ib_bytes_per_s", l.ib_bytes_per_s),
            ("links.ib_efficiency", l.ib_efficiency),
            ("links.d2h_bytes_per_s", l.d2h_bytes_per_s),
            ("links.h2d_bytes_per_s", l.h2d_bytes_per_s),
            ("links.collective_latency_s", l.collective_latency_s),
        ]);
        v
    }

    /// Where every input comes from: the hand-written keys from [`Cluster::sources`] (unknown
    /// where it is silent), then each key of a calibrated section as measured, with when and
    /// on what it was calibrated.
    pub fn provenance(&self) -> Vec<InputSource> {
        let mut out: Vec<InputSource> = self
            .numeric_inputs()
            .into_iter()
            .map(|(key, v)| {
                let (kind, note) = self
                    .sources
                    .get(key)
                    .and_then(|s| parse_source(s))
                    .unwrap_or((SourceKind::Unknown, "no source given".into()));
                InputSource {
                    key: key.into(),
                    value: short(v),
                    kind,
                    note,
                }
            })
            .collect();
        if let Some(c) = &self.cpu {
            let points = |n: usize| format!("{n} points");
            let rows = [
                ("cpu.cores", short(c.cores)),
                ("cpu.threads", c.threads.to_string()),
                ("cpu.gemm", points(c.gemm.len())),
                ("cpu.gemm_one_thread", points(c.gemm_one_thread.len())),
                ("cpu.attention", points(c.attention.len())),
                (
                    "cpu.elementwise_bytes_per_s",
                    short(c.elementwise_bytes_per_s),
                ),
                ("cpu.optimizer_bytes_per_s", short(c.optimizer_bytes_per_s)),
                ("cpu.op_overhead_s", short(c.op_overhead_s)),
                ("cpu.sync_s", short(c.sync_s)),
            ];
            let note = format!("`ganymede calibrate` on the CPU backend, {}", c.calibrated);
            out.extend(rows.into_iter().map(|(key, value)| InputSource {
                key: key.into(),
                value,
                kind: SourceKind::Measured,
                note: note.clone(),
            }));
        }
        if let Some(g) = &self.gpu_measured {
            let points = |n: usize| format!("{n} points");
            let mut rows = vec![
                ("gpu_measured.gemm_bf16", points(g.gemm_bf16.len())),
                ("gpu_measured.gemm_f32", points(g.gemm_f32.len())),
                ("gpu_measured.gemm_grouped", points(g.gemm_grouped.len())),
                ("gpu_measured.attention", points(g.attention.len())),
                ("gpu_measured.newton_schulz", points(g.newton_schulz.len())),
                (
                    "gpu_measured.elementwise_bytes_per_s",
                    short(g.elementwise_bytes_per_s),
                ),
                (
                    "gpu_measured.optimizer_bytes_per_s",
                    short(g.optimizer_bytes_per_s),
                ),
            ];
            if g.d2h_bytes_per_s > 0.0 {
                rows.push(("gpu_measured.d2h_bytes_per_s", short(g.d2h_bytes_per_s)));
            }
            if g.h2d_bytes_per_s > 0.0 {
                rows.push(("gpu_measured.h2d_bytes_per_s", short(g.h2d_bytes_per_s)));
            }
            let note = format!("`ganymede calibrate` on {}, {}", g.device, g.calibrated);
            out.extend(rows.into_iter().map(|(key, value)| InputSource {
                key: key.into(),
                value,
                kind: SourceKind::Measured,
                note: note.clone(),
            }));
            // The hand-written keys the measured section replaces in the time model.
            let replaced: &[(&str, bool)] = &[
                ("gpu.gemm_efficiency", true),
                ("gpu.attention_efficiency", !g.attention.is_empty()),
                ("gpu.memory_bytes_per_s", true),
                ("links.d2h_bytes_per_s", g.d2h_bytes_per_s > 0.0),
                ("links.h2d_bytes_per_s", g.h2d_bytes_per_s > 0.0),
            ];
            for i in &mut out {
                if replaced.iter().any(|(k, on)| *on && i.key == *k) {
                    i.note = format!("{} (unused: [gpu_measured] replaces it)", i.note);
                }
            }
        }
        out
    }

    fn validate_sources(&self, origin: &str) -> Result<(), ClusterError> {
        let known: Vec<&str> = self.numeric_inputs().iter().map(|(k, _)| *k).collect();
        for (key, text) in &self.sources {
            let bad = |reason: String| ClusterError::Invalid {
                origin: origin.to_string(),
                key: format!("sources.\"{key}\""),
                value: format!("{text:?}"),
                reason,
            };
            if !known.contains(&key.as_str()) {
                return Err(bad(format!(
                    "names no numeric input of this cluster (known: {})",
                    known.join(", ")
                )));
            }
            if parse_source(text).is_none() {
                return Err(bad(
                    "must start with \"measured:\", \"spec:\" or \"assumed:\"".into(),
                ));
            }
        }
        Ok(())
    }

    pub fn gpus(&self) -> usize {
        self.nodes * self.gpus_per_node
    }

    /// HBM a job can allocate.
    pub fn gpu_usable_bytes(&self) -> f64 {
        self.gpu.memory_bytes - self.gpu.reserved_bytes
    }

    pub fn describe(&self) -> String {
        format!(
            "{}: {} node(s) x {} {}; {:.0} GiB HBM, {:.0} GiB host per GPU",
            self.name,
            self.nodes,
            self.gpus_per_node,
            self.gpu.name,
            self.gpu.memory_bytes / GIB,
            self.host.usable_bytes_per_gpu / GIB
        )
    }
}
