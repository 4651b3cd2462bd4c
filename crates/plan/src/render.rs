//! The human-readable table.

use crate::plan::{NsOn, Placement, Plan};
use crate::sweep::SweepEntry;
use ganymede_config::{AcMode, OptimizerName};
use std::fmt::Write;

const GIB: f64 = (1u64 << 30) as f64;
const TIB: f64 = (1u64 << 40) as f64;

/// 951.80B, 32.77B, 1.57M, 448.
pub fn count(n: f64) -> String {
    let a = n.abs();
    if a >= 1e12 {
        format!("{:.3}T", n / 1e12)
    } else if a >= 1e9 {
        format!("{:.2}B", n / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else if a >= 1e3 {
        format!("{:.1}K", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

/// Bytes as GiB (or MiB/KiB when small).
pub fn bytes(b: f64) -> String {
    let a = b.abs();
    if a >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else if a >= (1 << 20) as f64 {
        format!("{:.1} MiB", b / (1 << 20) as f64)
    } else if a >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

fn ac_name(a: AcMode) -> &'static str {
    match a {
        AcMode::Full => "full",
        AcMode::None => "none",
    }
}

/// The whole plan as a table.
pub fn table(p: &Plan) -> String {
    let mut s = String::new();
    header(&mut s, p);
    parameters(&mut s, p);
    flops(&mut s, p);
    memory(&mut s, p);
    communication(&mut s, p);
    step_time(&mut s, p);
    inputs(&mut s, p);
    s
}

/// Where the cluster's inputs come from: each measured one with where, the others by key.
fn inputs(s: &mut String, p: &Plan) {
    use crate::cluster::SourceKind;
    let of = |k: SourceKind| p.inputs.iter().filter(move |i| i.kind == k);
    let n = |k: SourceKind| of(k).count();
    let _ = writeln!(
        s,
        "\nInputs of cluster {}: {} measured, {} from specifications, {} assumed{}",
        p.cluster,
        n(SourceKind::Measured),
        n(SourceKind::Spec),
        n(SourceKind::Assumed),
        match n(SourceKind::Unknown) {
            0 => String::new(),
            u => format!(", {u} without a source"),
        }
    );
    // A calibrated section's keys share one note: print it once.
    let mut last_note = "";
    for i in of(SourceKind::Measured) {
        let note = if i.note == last_note {
            "(same)"
        } else {
            &i.note
        };
        row(
            s,
            &format!("measured {}", i.key),
            format!("{}: {note}", i.value),
        );
        last_note = &i.note;
    }
    for k in [SourceKind::Spec, SourceKind::Assumed, SourceKind::Unknown] {
        let keys: Vec<&str> = of(k).map(|i| i.key.as_str()).collect();
        if keys.is_empty() {
            continue;
        }
        // Wrapped at about 100 columns under the value column.
        let mut lines = vec![String::new()];
        for key in keys {
            let l = lines.last_mut().expect("one line");
            if !l.is_empty() && l.len() + key.len() > 62 {
                lines.push(String::new());
            }
            let l = lines.last_mut().expect("one line");
            if !l.is_empty() {
                l.push_str(", ");
            }
            l.push_str(key);
        }
        for (j, l) in lines.into_iter().enumerate() {
            row(s, if j == 0 { k.name() } else { "" }, l);
        }
    }
}

/// One `key value` row of a section.
fn row(s: &mut String, k: &str, v: String) {
    let _ = writeln!(s, "  {k:<34} {v}");
}

/// The title, layout, policy, verdict and optimizer lines.
fn header(s: &mut String, p: &Plan) {
    let l = &p.layout;
    let _ = writeln!(s, "ganymede plan: {} on {}", p.model, p.cluster);
    let _ = writeln!(
        s,
        "  layout: {} nodes x {} GPUs, {}FSDP {}, EP {}, seq {}, micro-batch {}, global batch {} ({} microbatch(es) per step)",
        l.nodes, l.gpus_per_node, if l.dp_replicate > 1 { format!("{} replicas (HSDP) x ", l.dp_replicate) } else { String::new() }, l.dp_shard, l.ep, l.seq_len, l.micro_batch, l.global_batch, p.microbatches
    );
    let pol = &p.policy;
    let _ = writeln!(
        s,
        "  policy: AC {}, activation offload {:.3} ({} layers), parameter offload {}, prefetch {}, unshard_async_op {}, gather {} B, reduce {} B, last block {}",
        ac_name(pol.ac),
        pol.offload_fraction,
        p.memory.offloaded_layers,
        if pol.param_offload { "on" } else { "off" },
        pol.prefetch,
        pol.unshard_async_op,
        pol.gather_bytes,
        pol.reduce_bytes,
        if pol.keep_last_block { "kept" } else { "resharded" }
    );
    // The verdict first: a throughput means nothing for a layout that cannot run.
    let _ = writeln!(s, "  verdict: {}", p.verdict);
    let o = &p.optimizer;
    let _ = writeln!(
        s,
        "  optimizer: {}, placement {}, Newton-Schulz on {}",
        match o.name {
            OptimizerName::Muon => "Muon + AdamW",
            OptimizerName::Adamw => "AdamW",
        },
        match o.placement {
            Placement::Naive => "naive",
            Placement::Flexshard => "FlexShard",
        },
        match o.ns_on {
            NsOn::Gpu => "GPU",
            NsOn::Cpu => "CPU",
        }
    );
}

/// Parameter counts by group.
fn parameters(s: &mut String, p: &Plan) {
    let pc = &p.params;
    let _ = writeln!(s, "\nParameters");
    row(s, "total", count(pc.total as f64));
    row(s, "active per token", count(pc.active as f64));
    let g = &pc.by_group;
    for (k, v) in [
        ("embedding", g.embedding),
        ("attention", g.attention),
        ("router", g.router),
        ("routed experts", g.routed_experts),
        ("shared experts", g.shared_experts),
        ("dense FFN", g.dense_ffn),
        ("norms", g.norms),
        ("LM head", g.lm_head),
    ] {
        row(
            s,
            &format!("  {k}"),
            format!(
                "{:>10}  {:6.2}%",
                count(v as f64),
                100.0 * v as f64 / pc.total as f64
            ),
        );
    }
    row(
        s,
        "Muon-handled",
        format!(
            "{} ({:.2}%), {} matrices",
            count(pc.muon as f64),
            100.0 * pc.muon_share,
            pc.muon_matrices
        ),
    );
}

/// FLOPs per token and per step.
fn flops(s: &mut String, p: &Plan) {
    let f = &p.flops;
    let _ = writeln!(s, "\nFLOPs per token");
    row(
        s,
        "6 x active matmul params",
        format!("{:.1} GFLOP", f.matmul_per_token / 1e9),
    );
    row(
        s,
        "attention span per token",
        format!("{:.0} keys", f.attention_span_per_token),
    );
    row(
        s,
        "attention (causal / not halved)",
        format!(
            "{:.1} / {:.1} GFLOP",
            f.attention_per_token / 1e9,
            f.attention_per_token_noncausal / 1e9
        ),
    );
    row(
        s,
        "model (no recompute)",
        format!("{:.1} GFLOP", f.model_per_token / 1e9),
    );
    row(
        s,
        "recompute (full AC)",
        format!("{:.1} GFLOP", f.recompute_per_token / 1e9),
    );
    row(
        s,
        "hardware (with recompute)",
        format!("{:.1} GFLOP", f.hardware_per_token / 1e9),
    );
    row(
        s,
        "model FLOPs per step",
        format!("{:.3e}", f.model_per_step),
    );
    row(
        s,
        "tokens per step",
        format!(
            "{} ({} per GPU)",
            p.tokens_per_step, p.tokens_per_gpu_per_step
        ),
    );
}

/// Memory by category, GPU and host.
fn memory(s: &mut String, p: &Plan) {
    let o = &p.optimizer;
    let m = &p.memory;
    let _ = writeln!(s, "\nMemory per GPU          {:>12} {:>12}", "GPU", "host");
    for ((k, gv), (_, hv)) in m.gpu.rows().into_iter().zip(m.host.rows()) {
        if gv == 0.0 && hv == 0.0 {
            continue;
        }
        let _ = writeln!(s, "  {k:<22} {:>12} {:>12}", bytes(gv), bytes(hv));
    }
    let _ = writeln!(
        s,
        "  {:<22} {:>12} {:>12}",
        "total",
        bytes(m.gpu_total),
        bytes(m.host_total)
    );
    let _ = writeln!(
        s,
        "  {:<22} {:>12} {:>12}",
        "capacity",
        bytes(m.gpu_capacity),
        bytes(m.host_capacity)
    );
    row(
        s,
        "boundary activations (all layers)",
        bytes(m.boundary_activation_bytes),
    );
    row(
        s,
        "optimizer state (whole model)",
        format!(
            "{:.3} TiB; AdamW would need {:.3} TiB (saving {} per GPU)",
            o.state_bytes / TIB,
            o.adamw_state_bytes / TIB,
            bytes(o.muon_saving_per_gpu)
        ),
    );
}

/// Bytes sent per step, by collective and by link.
fn communication(s: &mut String, p: &Plan) {
    let c = &p.communication;
    let _ = writeln!(s, "\nCommunication per GPU per step (bytes sent)");
    row(s, "FSDP all-gather, forward", bytes(c.fsdp_all_gather_fwd));
    row(s, "FSDP all-gather, backward", bytes(c.fsdp_all_gather_bwd));
    row(s, "FSDP reduce-scatter", bytes(c.fsdp_reduce_scatter));
    if p.layout.dp_replicate > 1 {
        row(
            s,
            "HSDP all-reduce across replicas",
            bytes(c.hsdp_all_reduce),
        );
    }
    row(
        s,
        "expert all-to-all",
        format!(
            "{} on {}",
            bytes(c.ep_all_to_all),
            if c.ep_on_nvlink {
                "NVLink"
            } else {
                "InfiniBand"
            }
        ),
    );
    row(
        s,
        "optimizer: naive Muon",
        format!(
            "{} in {} collectives",
            bytes(c.optimizer_naive_muon),
            c.optimizer_collectives_naive
        ),
    );
    row(
        s,
        "optimizer: FlexShard",
        format!(
            "{} in {} collectives",
            bytes(c.optimizer_flexshard),
            c.optimizer_collectives_flexshard
        ),
    );
    row(s, "optimizer: AdamW", bytes(c.optimizer_adamw));
    row(
        s,
        "by link: InfiniBand / NVLink",
        format!("{} / {}", bytes(c.ib_bytes), bytes(c.nvlink_bytes)),
    );
    row(
        s,
        "host copies: D2H / H2D",
        format!("{} / {}", bytes(c.d2h_bytes), bytes(c.h2d_bytes)),
    );
}

/// The step's time, throughput and MFU.
fn step_time(s: &mut String, p: &Plan) {
    let t = &p.time;
    let _ = writeln!(s, "\nStep time");
    if let Some(dev) = &t.measured {
        row(s, "rates", format!("measured on {dev} ([gpu_measured])"));
    }
    row(s, "compute alone", secs(t.compute_s));
    row(s, "expert all-to-all (not hidden)", secs(t.all_to_all_s));
    row(s, "FSDP traffic alone", secs(t.fsdp_comm_s));
    row(
        s,
        "per link: IB / NVLink / D2H / H2D",
        format!(
            "{} / {} / {} / {}",
            secs(t.ib_s),
            secs(t.nvlink_s),
            secs(t.d2h_s),
            secs(t.h2d_s)
        ),
    );
    row(s, "forward (overlapped)", secs(t.forward_s));
    row(s, "backward (overlapped)", secs(t.backward_s));
    row(s, "pipeline fill/drain, embedding/head", secs(t.exposed_s));
    row(
        s,
        "optimizer step",
        format!(
            "{} (Newton-Schulz {}, optimizer traffic {})",
            secs(t.optimizer_s),
            secs(t.newton_schulz_s),
            secs(t.optimizer_comm_s)
        ),
    );
    if p.layout.dp_replicate > 1 {
        row(
            s,
            "HSDP all-reduce (after backward)",
            secs(t.hsdp_all_reduce_s),
        );
    }
    row(s, "step", format!("{} ({}-bound)", secs(t.step_s), t.bound));
    row(
        s,
        "tokens/s per GPU",
        if p.fits {
            format!("{:.0}", p.tokens_per_s_per_gpu)
        } else {
            format!(
                "{:.0} if it fitted; it does not (see the verdict above)",
                p.tokens_per_s_per_gpu
            )
        },
    );
    row(
        s,
        "MFU (causal) / TorchTitan / HFU",
        format!(
            "{:.1}% / {:.1}% / {:.1}%",
            100.0 * p.mfu,
            100.0 * p.mfu_torchtitan,
            100.0 * p.hfu
        ),
    );
}

/// The sweep's ranking as a table (at most `limit` rows): one row per EP degree, sequence,
/// checkpointing mode and parameter offload, at its best (and then smallest) offload fraction.
pub fn sweep_table(entries: &[SweepEntry], limit: usize) -> String {
    let mut seen = std::collections::HashSet::new();
    let entries: Vec<&SweepEntry> = entries
        .iter()
        .filter(|e| seen.insert((e.ep, e.seq_len, ac_name(e.ac), e.param_offload)))
        .collect();
    let mut s = String::new();
    if entries.is_empty() {
        s.push_str("no layout in the sweep fits\n");
        return s;
    }
    let _ = writeln!(
        s,
        "{:>4} {:>4} {:>8} {:>4} {:>8} {:>6} {:>10} {:>9} {:>6} {:>11} {:>11}",
        "rank", "EP", "seq", "AC", "offload", "p-off", "tokens/s", "step", "MFU", "GPU", "host"
    );
    for (i, e) in entries.iter().take(limit).enumerate() {
        let _ = writeln!(
            s,
            "{:>4} {:>4} {:>8} {:>4} {:>8.3} {:>6} {:>10.0} {:>9} {:>5.1}% {:>11} {:>11}",
            i + 1,
            e.ep,
            e.seq_len,
            ac_name(e.ac),
            e.offload_fraction,
            if e.param_offload { "on" } else { "off" },
            e.tokens_per_s_per_gpu,
            secs(e.step_time_s),
            100.0 * e.mfu,
            bytes(e.gpu_bytes),
            bytes(e.host_bytes)
        );
    }
    if entries.len() > limit {
        let _ = writeln!(s, "({} more layouts fit)", entries.len() - limit);
    }
    s
}
