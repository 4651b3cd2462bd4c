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
