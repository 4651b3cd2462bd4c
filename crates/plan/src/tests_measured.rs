//! Issue 37: where the cluster's inputs come from, and the measured GPU section.

use crate::cluster::{Cluster, SourceKind, CLUSTERS};
use crate::plan::{plan, Layout, MemoryPolicy, OptimizerSetup};
use ganymede_config::preset;

#[test]
fn every_numeric_input_of_every_preset_has_a_source() {
    for name in CLUSTERS {
        let c = Cluster::preset(name).unwrap();
        let prov = c.provenance();
        // One entry per numeric input, none without a source.
        for (key, _) in c.numeric_inputs() {
            let i = prov.iter().find(|i| i.key == key).unwrap();
            assert_ne!(i.kind, SourceKind::Unknown, "{name}: {key} has no source");
            assert!(
                !i.note.is_empty() || i.kind == SourceKind::Assumed,
                "{name}: {key}"
            );
        }
        // And no source names a key the cluster lacks (validation refuses it).
        assert_eq!(c.sources.len(), c.numeric_inputs().len(), "{name}");
    }
    // The GEMM efficiency of jupiter is the H200 measurement, and says so.
    let j = Cluster::preset("jupiter").unwrap().provenance();
    let g = j.iter().find(|i| i.key == "gpu.gemm_efficiency").unwrap();
    assert_eq!((g.kind, g.value.as_str()), (SourceKind::Measured, "0.8"));
    assert!(g.note.contains("H200"), "{}", g.note);
    let a = j
        .iter()
        .find(|i| i.key == "gpu.attention_efficiency")
        .unwrap();
    assert_eq!(a.kind, SourceKind::Assumed);
}

#[test]
fn a_calibrated_sections_keys_are_measured() {
    let c = Cluster::preset("local").unwrap();
    let prov = c.provenance();
    let cpu: Vec<_> = prov.iter().filter(|i| i.key.starts_with("cpu.")).collect();
    assert_eq!(cpu.len(), 9);
    for i in cpu {
        assert_eq!(i.kind, SourceKind::Measured, "{}", i.key);
        assert!(i.note.contains("ganymede calibrate"), "{}", i.note);
    }
    // Without the section, no `cpu.` keys.
    let mut bare = c.clone();
    bare.cpu = None;
    assert!(bare.provenance().iter().all(|i| !i.key.starts_with("cpu.")));
}

#[test]
fn a_file_without_sources_says_unknown_and_a_bad_source_is_named() {
    let mut c = Cluster::preset("dgx-h200").unwrap();
    c.sources.clear();
    let text = c.to_toml();
    assert!(!text.contains("[sources]"));
    let back = Cluster::from_toml_str(&text, "x.toml").unwrap();
    assert!(back
        .provenance()
        .iter()
        .all(|i| i.kind == SourceKind::Unknown));
    // The sources table round-trips.
    let full = Cluster::preset("dgx-h200").unwrap();
    assert_eq!(
        Cluster::from_toml_str(&full.to_toml(), "y.toml").unwrap(),
        full
    );
    let bad = full
        .to_toml()
        .replace("\"spec: the 141 GB", "\"datasheet: the 141 GB");
    let e = Cluster::from_toml_str(&bad, "z.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("z.toml") && e.contains("gpu.memory_bytes"),
        "{e}"
    );
    assert!(e.contains("measured:"), "{e}");
    let unknown = format!("{}\"gpu.warp_speed\" = \"assumed: fast\"\n", full.to_toml());
    let e = Cluster::from_toml_str(&unknown, "w.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("gpu.warp_speed"), "{e}");
}

#[test]
fn the_plan_table_and_json_carry_the_inputs() {
    let job = preset("europa-1t").unwrap();
    let c = Cluster::preset("jupiter").unwrap();
    let l = Layout::from_job(&job, &c);
    let p = plan(
        &job,
        &c,
        &l,
        &MemoryPolicy::from_job(&job),
        &OptimizerSetup::from_job(&job),
    )
    .unwrap();
    let t = crate::render::table(&p);
    let section = &t[t.find("Inputs of cluster jupiter").expect("section")..];
    let n = |k: SourceKind| p.inputs.iter().filter(|i| i.kind == k).count();
    assert!(section.contains(&format!(
        "{} measured, {} from specifications, {} assumed\n",
        n(SourceKind::Measured),
        n(SourceKind::Spec),
        n(SourceKind::Assumed)
    )));
    assert!(section.contains("measured gpu.gemm_efficiency"));
    assert!(section.contains("0.8: large bf16 GEMM on an H200"));
    let v = serde_json::to_value(&p).unwrap();
    let inputs = v["inputs"].as_array().unwrap();
    assert_eq!(inputs.len(), c.numeric_inputs().len());
    assert!(inputs
        .iter()
        .any(|i| i["key"] == "links.d2h_bytes_per_s" && i["kind"] == "measured"));
}

use crate::cluster::GpuMeasured;

/// `dgx-h200` with a measured section that reproduces its hand-written rates: every GEMM at
/// peak x gemm_efficiency, attention at peak x attention_efficiency (backward counted 2.5x, so
/// 1.25x the forward rate takes twice as long), the optimizer at the memory bandwidth, copies
/// at the links' rates; no Newton–Schulz shapes.
fn h200_measured_as_assumed() -> Cluster {
    let mut c = Cluster::preset("dgx-h200").unwrap();
    let gemm = c.gpu.peak_flops * c.gpu.gemm_efficiency;
    let f32_gemm = c.gpu.peak_f32_flops.unwrap() * c.gpu.gemm_efficiency;
    let attn = c.gpu.peak_flops * c.gpu.attention_efficiency;
    c.gpu_measured = Some(GpuMeasured {
        device: "test".into(),
        gemm_bf16: vec![[1e6, gemm]],
        gemm_f32: vec![[1e6, f32_gemm]],
        gemm_grouped: vec![],
        attention: vec![[4096.0, 128.0, attn, 1.25 * attn]],
        newton_schulz: vec![],
        elementwise_bytes_per_s: c.gpu.memory_bytes_per_s,
        optimizer_bytes_per_s: c.gpu.memory_bytes_per_s,
        d2h_bytes_per_s: c.links.d2h_bytes_per_s,
        h2d_bytes_per_s: c.links.h2d_bytes_per_s,
        calibrated: "by hand".into(),
    });
    c
}

fn medium_plan(c: &Cluster) -> crate::Plan {
    let mut job = preset("medium").unwrap();
    job.training.compute_dtype = ganymede_config::ComputeDtype::Bf16;
    let mut l = Layout::from_job(&job, c);
    l.nodes = 1;
    l.gpus_per_node = 1;
    l.dp_shard = 1;
    l.ep = 1;
    plan(
        &job,
        c,
        &l,
        &MemoryPolicy::from_job(&job),
        &OptimizerSetup::from_job(&job),
    )
    .unwrap()
}

#[test]
fn a_measured_section_equal_to_the_assumed_rates_predicts_the_same_step() {
    let base = medium_plan(&Cluster::preset("dgx-h200").unwrap());
    let m = medium_plan(&h200_measured_as_assumed());
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1e-12);
    for (what, a, b) in [
        ("forward", m.time.forward_s, base.time.forward_s),
        ("backward", m.time.backward_s, base.time.backward_s),
        ("compute", m.time.compute_s, base.time.compute_s),
        ("optimizer", m.time.optimizer_s, base.time.optimizer_s),
        ("step", m.step_time_s, base.step_time_s),
    ] {
        assert!(close(a, b), "{what}: measured {a} vs assumed {b}");
    }
    assert_eq!(m.time.measured.as_deref(), Some("test"));
    assert_eq!(base.time.measured, None);
    assert!(crate::render::table(&m).contains("measured on test ([gpu_measured])"));
}

#[test]
fn the_planner_prices_by_the_measured_rates() {
    let base = medium_plan(&h200_measured_as_assumed());
    // Every GEMM at half the rate: the matmul share of compute doubles, attention stays.
    let mut slow = h200_measured_as_assumed();
    let g = slow.gpu_measured.as_mut().unwrap();
    g.gemm_bf16[0][1] /= 2.0;
    let half = medium_plan(&slow);
    // compute = mf·l·(c_fwd + c_bwd) + head, c_fwd = mm + a, c_bwd = 2mm + 2a (+ c_fwd under
    // full checkpointing), so compute = mf·l·(3mm + 3a) + head (4 and 4 under full), all of mm
    // and head at the GEMM rate.
    let job = preset("medium").unwrap();
    let (seq, q, h, v) = (
        base.layout.seq_len as f64,
        job.model.q_dim() as f64,
        job.model.hidden as f64,
        job.model.vocab_size as f64,
    );
    let n = (base.layout.micro_batch * base.layout.seq_len) as f64;
    let c = Cluster::preset("dgx-h200").unwrap();
    let attn_rate = c.gpu.peak_flops * c.gpu.attention_efficiency;
    let passes = match base.policy.ac {
        ganymede_config::AcMode::Full => 4.0,
        ganymede_config::AcMode::None => 3.0,
    };
    let attn = base.microbatches as f64 * job.model.layers as f64 * passes * (2.0 * seq * q * n)
        / attn_rate;
    let gemm_part = base.time.compute_s - attn;
    assert!(
        ((half.time.compute_s - attn) / gemm_part - 2.0).abs() < 1e-9,
        "{} {} {}",
        half.time.compute_s,
        base.time.compute_s,
        attn
    );
    // The head alone is 6·V·H·N at that rate.
    assert!(gemm_part > 6.0 * v * h * n / (c.gpu.peak_flops * 0.8));
    // Measured copies replace the links' rates: 10x slower D2H, 10x the D2H time.
    let mut copies = h200_measured_as_assumed();
    copies.gpu_measured.as_mut().unwrap().d2h_bytes_per_s /= 10.0;
    let a = medium_plan(&h200_measured_as_assumed()).time.d2h_s;
    let b = medium_plan(&copies).time.d2h_s;
    assert!((b - 10.0 * a).abs() <= 1e-9 * b, "{a} {b}");
}

#[test]
fn newton_schulz_per_shape_interpolates_the_measured_rate() {
    let mut g = h200_measured_as_assumed().gpu_measured.unwrap();
    // 1024x1024, 5 steps: ns_flops = 5·(4+2)·1024³ = 32.2 GFLOP in 10 ms (bf16), 20 ms (f32).
    g.newton_schulz = vec![[1024.0, 1024.0, 5.0, 0.010, 0.020]];
    assert!((g.newton_schulz_s(1024, 1024, 5, true).unwrap() - 0.010).abs() < 1e-12);
    assert!((g.newton_schulz_s(1024, 1024, 5, false).unwrap() - 0.020).abs() < 1e-12);
    // A smaller matrix at the same (only) rate: 512x512 is 1/8 of the FLOPs.
    assert!((g.newton_schulz_s(512, 512, 5, true).unwrap() - 0.010 / 8.0).abs() < 1e-12);
    // Two shapes: between them, log-linear in FLOPs; the rate of 512² is 1/2 of 1024²'s.
    g.newton_schulz
        .insert(0, [512.0, 512.0, 5.0, 0.010 / 4.0, 0.020 / 4.0]);
    assert!((g.newton_schulz_s(512, 512, 5, true).unwrap() - 0.0025).abs() < 1e-12);
    // The plan of medium under Muon uses them: slower Newton–Schulz, a longer optimizer step.
    let mut c = h200_measured_as_assumed();
    let fast = medium_plan(&c).time.newton_schulz_s;
    c.gpu_measured.as_mut().unwrap().newton_schulz = vec![[512.0, 512.0, 5.0, 1.0, 1.0]];
    let slow = medium_plan(&c).time.newton_schulz_s;
    assert!(slow > 100.0 * fast, "{fast} {slow}");
}

#[test]
fn a_measured_section_round_trips_says_measured_and_bad_values_are_named() {
    let c = h200_measured_as_assumed();
    let back = Cluster::from_toml_str(&c.to_toml(), "m.toml").unwrap();
    assert_eq!(back, c);
    let prov = c.provenance();
    let m: Vec<_> = prov
        .iter()
        .filter(|i| i.key.starts_with("gpu_measured."))
        .collect();
    assert_eq!(m.len(), 9);
    assert!(m.iter().all(|i| i.kind == SourceKind::Measured));
    let g = prov
        .iter()
        .find(|i| i.key == "gpu.gemm_efficiency")
        .unwrap();
    assert!(
        g.note.contains("unused: [gpu_measured] replaces it"),
        "{}",
        g.note
    );
    let mut bad = c.clone();
    bad.gpu_measured.as_mut().unwrap().gemm_bf16 = vec![[1e6, 1.0], [1e5, 1.0]];
    let e = Cluster::from_toml_str(&bad.to_toml(), "b.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gpu_measured.gemm_bf16[1][0]") && e.contains("b.toml"),
        "{e}"
    );
}

/// The `europa-1t` slice: one rank's share of one layer at the write-up's shapes fits one
/// H200 (141 GB) under its policy, and its experts see as many rows as a rank of the real job.
#[test]
fn the_europa_slice_fits_one_h200() {
    let job = preset("europa-1t-slice").unwrap();
    let full = preset("europa-1t").unwrap();
    let (m, f) = (&job.model, &full.model);
    assert_eq!(
        (
            m.hidden,
            m.heads,
            m.kv_heads,
            m.head_dim,
            m.expert_hidden,
            m.top_k
        ),
        (
            f.hidden,
            f.heads,
            f.kv_heads,
            f.head_dim,
            f.expert_hidden,
            f.top_k
        )
    );
    // ep 4 leaves 384 / 4 = 96 experts on a rank.
    assert_eq!(m.experts, f.experts / full.parallelism.ep);
    assert_eq!(
        (m.layers, m.seq_len, job.training.batch_size),
        (1, 65536, 1)
    );
    let c = Cluster::preset("dgx-h200").unwrap();
    let mut l = Layout::from_job(&job, &c);
    l.nodes = 1;
    l.gpus_per_node = 1;
    let p = plan(
        &job,
        &c,
        &l,
        &MemoryPolicy::from_job(&job),
        &OptimizerSetup::from_job(&job),
    )
    .unwrap();
    assert!(p.fits, "{}", p.verdict);
    assert!(p.memory.gpu_total < 141e9, "{}", p.memory.gpu_total);
    // The boundary goes to host memory: 65,536 x 6,144 bf16 = 768 MiB.
    assert_eq!(p.memory.offloaded_layers, 1);
    assert_eq!(p.memory.host.boundary_activations, 65536.0 * 6144.0 * 2.0);
    // On the trainer's own terms (device.kind = cuda) it still fits.
    let mut cuda = job.clone();
    cuda.device.kind = ganymede_config::DeviceKind::Cuda;
    let p = plan(
        &cuda,
        &c,
        &l,
        &MemoryPolicy::from_job(&cuda),
        &OptimizerSetup::from_job(&cuda),
    )
    .unwrap();
    assert!(p.fits, "{}", p.verdict);
}

/// On ganymede's own trainer (`device.kind` = `cpu-two-memory`, one rank), the cluster
/// planner's activation categories add up to the ledger's `activations` the CPU ledger
/// prediction gives (held to measured ledgers by crates/ganymede/tests/fit_check.rs), for a
/// `medium`-like layer at a small size, under both checkpointing modes and bf16 and f32
/// compute; the write-up's bf16 model (device.kind = "cpu") reads less.
#[test]
fn the_cluster_planners_activations_are_the_trainers_ledger() {
    for (ac, bf16) in [
        (ganymede_config::AcMode::None, true),
        (ganymede_config::AcMode::Full, true),
        (ganymede_config::AcMode::Full, false),
    ] {
        let mut job = preset("medium").unwrap();
        job.model.hidden = 128;
        job.model.layers = 3;
        job.model.heads = 4;
        job.model.kv_heads = 2;
        job.model.head_dim = 32;
        job.model.experts = 16;
        job.model.expert_hidden = 64;
        job.model.vocab_size = 512;
        job.model.seq_len = 128;
        job.training.batch_size = 2;
        job.training.loss_chunk_tokens = 0;
        job.activation_checkpoint.mode = ac;
        job.training.compute_dtype = if bf16 {
            ganymede_config::ComputeDtype::Bf16
        } else {
            ganymede_config::ComputeDtype::F32
        };
        let ledger = crate::predict_cpu_ledger(&job, 1).activations;
        let c = Cluster::preset("local").unwrap();
        let acts = |job: &ganymede_config::JobConfig| {
            let mut l = Layout::from_job(job, &c);
            l.gpus_per_node = 1;
            l.dp_shard = 1;
            l.ep = 1;
            let p = plan(
                job,
                &c,
                &l,
                &MemoryPolicy::from_job(job),
                &OptimizerSetup::from_job(job),
            )
            .unwrap();
            let g = &p.memory.gpu;
            g.boundary_activations + g.layer_activations + g.dispatch_buffers + g.logits
        };
        let mut own = job.clone();
        own.device.kind = ganymede_config::DeviceKind::CpuTwoMemory;
        let got = acts(&own);
        assert!(
            (got / ledger - 1.0).abs() < 0.02,
            "{ac:?} bf16 {bf16}: planner {got} vs ledger {ledger}"
        );
        let writeup = acts(&job);
        assert!(writeup < 0.9 * ledger, "{writeup} vs {ledger}");
    }
}
