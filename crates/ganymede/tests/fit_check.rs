//! The fit check before launch, through the binary: with `device.memory_gib` set, a job whose
//! predicted device peak exceeds it is refused before anything is built or written, naming the
//! overflowing categories and the smallest change that fits as `--set` flags; `ganymede plan`
//! prints the same suggestion, and the suggestion pasted back fits.

mod util;

use ganymede_config::JobConfig;
use util::{fails, ganymede, ok, TempDir};

/// Two-memory `tiny` on one thread (the prediction's Muon scratch depends on the thread count,
/// so train and plan see the same one), with extra overrides, as `--set` arguments.
fn sets(extra: &[&str]) -> Vec<String> {
    let mut v = vec![
        "device.kind=cpu-two-memory",
        "training.threads=1",
        "checkpoint.enable=false",
        "data.builtin_bytes=100000",
    ];
    v.extend(extra);
    v.iter()
        .flat_map(|s| ["--set".into(), s.to_string()])
        .collect()
}

fn train_args(run: &std::path::Path, preset: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["train", "--preset", preset, "--steps", "2", "--out"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.push(run.display().to_string());
    a.extend(sets(extra));
    a
}

fn plan_args(preset: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = vec!["plan".into(), "--preset".into(), preset.into()];
    a.extend(sets(extra));
    a
}

/// The suggestion of a refusal or a plan: the text after "smallest change that fits".
fn suggestion(text: &str) -> String {
    let i = text
        .find("smallest change that fits")
        .unwrap_or_else(|| panic!("no suggestion in: {text}"));
    text[i..].lines().next().unwrap().to_string()
}

/// The `--set` values of a suggestion's flags.
fn suggested_sets(s: &str) -> Vec<String> {
    s.split("--set ")
        .skip(1)
        .map(|x| x.trim().to_string())
        .collect()
}

#[test]
fn a_job_that_does_not_fit_is_refused_and_the_suggested_checkpointing_runs() {
    // tiny without checkpointing, one thread: about 26.2 MB on the device (the two layers'
    // activations kept); optimizer offload alone leaves 24.8 MB; full checkpointing 20.0 MB.
    // 0.02 GiB = 21.5 MB: checkpointing is the smallest change, and one that runs today.
    let tmp = TempDir::new("fit-refuse");
    let run = tmp.path().join("run");
    let job = ["activation_checkpoint.mode=none", "device.memory_gib=0.02"];
    let o = ganymede(tmp.path(), &train_args(&run, "tiny", &job), &[]);
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("step "),
        "a step ran"
    );
    let e = fails(o);
    assert!(
        e.contains("does not fit in device memory")
            && e.contains("exceeds device.memory_gib = 0.02000 GiB")
            && e.contains("overflowing categories")
            && e.contains("activations"),
        "{e}"
    );
    let fix = suggestion(&e);
    assert!(
        fix.ends_with(": --set activation_checkpoint.mode=full"),
        "{e}"
    );
    assert!(!run.exists(), "a refused run left {}", run.display());

    // `ganymede plan` prints the same verdict and suggestion for the job's own capacity.
    let p = ok(ganymede(tmp.path(), &plan_args("tiny", &job), &[]));
    assert!(p.contains("verdict: does not fit"), "{p}");
    assert_eq!(suggestion(&p), fix, "plan: {p}");
    // `--json` carries the same verdict, overflow and fix for scripts.
    let mut json_args = plan_args("tiny", &job);
    json_args.push("--json".into());
    let j: serde_json::Value = serde_json::from_str(&ok(ganymede(tmp.path(), &json_args, &[])))
        .expect("plan --json parses");
    let fit = &j["two_memory"]["fit"];
    assert_eq!(fit["fits"], false, "{j}");
    assert_eq!(
        fit["capacity"].as_f64(),
        Some((0.02f64 * (1u64 << 30) as f64).floor())
    );
    assert!(
        fit["overflow"]
            .as_array()
            .is_some_and(|o| o.iter().any(|c| c[0] == "activations")),
        "{fit}"
    );
    assert_eq!(
        fit["fix"]["sets"],
        serde_json::json!(["activation_checkpoint.mode=full"]),
        "{fit}"
    );
    assert!(
        fit["prediction"]["device_peak"].as_f64().unwrap() > fit["capacity"].as_f64().unwrap(),
        "{fit}"
    );

    // Pasted back, the suggestion fits: planned, and trained for two steps within the
    // capacity, its measured peak within 5% of the planner's.
    let mut fixed: Vec<&str> = job.to_vec();
    let fix_sets = suggested_sets(&fix);
    fixed.extend(fix_sets.iter().map(String::as_str));
    let p = ok(ganymede(tmp.path(), &plan_args("tiny", &fixed), &[]));
    assert!(p.contains("verdict: fits"), "{p}");
    ok(ganymede(tmp.path(), &train_args(&run, "tiny", &fixed), &[]));
    let mem: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("memory.json")).unwrap()).unwrap();
    let measured = mem["gpu0"]["peak_total_bytes"].as_f64().unwrap();
    let predicted = mem["gpu0"]["planner_peak_total_bytes"].as_f64().unwrap();
    assert!(measured <= 0.02 * (1u64 << 30) as f64, "{mem}");
    assert!(
        (measured - predicted).abs() <= 0.05 * predicted,
        "measured {measured}, planner {predicted}"
    );
}

#[test]
fn optimizer_offload_is_suggested_when_offloading_two_layers_saves_nothing() {
    // tiny with full checkpointing: about 20.0 MB on the device; 0.018 GiB = 19.3 MB. With two
    // layers, activation offload saves nothing (two pool slots stay), so the suggestion is
    // optimizer offload (18.5 MB), which then trains within the capacity.
    let tmp = TempDir::new("fit-optimizer");
    let run = tmp.path().join("run");
    let job = ["device.memory_gib=0.018"];
    let e = fails(ganymede(tmp.path(), &train_args(&run, "tiny", &job), &[]));
    let fix = suggestion(&e);
    assert!(fix.ends_with(": --set optimizer.offload=true"), "{e}");
    assert!(e.contains("overflowing categories") && e.contains("activations"));
    assert!(!run.exists());
    let p = ok(ganymede(tmp.path(), &plan_args("tiny", &job), &[]));
    assert_eq!(suggestion(&p), fix, "plan: {p}");
    let p = ok(ganymede(
        tmp.path(),
        &plan_args(
            "tiny",
            &["device.memory_gib=0.018", "optimizer.offload=true"],
        ),
        &[],
    ));
    assert!(p.contains("verdict: fits"), "{p}");
    let fixed = ["device.memory_gib=0.018", "optimizer.offload=true"];
    ok(ganymede(tmp.path(), &train_args(&run, "tiny", &fixed), &[]));
    let mem: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("memory.json")).unwrap()).unwrap();
    let measured = mem["gpu0"]["peak_total_bytes"].as_f64().unwrap();
    let predicted = mem["gpu0"]["planner_peak_total_bytes"].as_f64().unwrap();
    assert!(measured <= 0.018 * (1u64 << 30) as f64, "{mem}");
    assert!(
        (measured - predicted).abs() <= 0.05 * predicted,
        "measured {measured}, planner {predicted}"
    );
    assert!(
        mem["host"]["peak_bytes"]["optimizer"].as_f64().unwrap() > 0.0,
        "{mem}"
    );
    std::fs::remove_dir_all(&run).unwrap();

    // 0.004 GiB holds no layout of tiny (in microbatches of one sequence with the optimizer
    // offloaded it needs about 0.0057): the refusal says so.
    let e = fails(ganymede(
        tmp.path(),
        &train_args(&run, "tiny", &["device.memory_gib=0.004"]),
        &[],
    ));
    assert!(e.contains("nothing fits"), "{e}");
    assert!(!run.exists());
}

#[test]
fn the_fewest_offloaded_layers_are_suggested_as_a_fraction_that_round_trips() {
    // small (4 layers): a capacity just above the device peak with 3 layers offloaded. The
    // suggestion is 0.750, which plans back to 3 layers and fits; 0.5 (2 layers) does not.
    let with = |extra: &[&str]| {
        let mut o: Vec<String> = vec!["device.kind=cpu-two-memory".into()];
        o.extend(extra.iter().map(|s| s.to_string()));
        JobConfig::load(Some("small"), None, &o).unwrap()
    };
    let three = ganymede_plan::predict_memory(
        &with(&["activation_checkpoint.offload_fraction=0.75"]),
        1,
        1,
    )
    .device
    .total();
    let cap = format!("device.memory_gib={}", (three + 1.0) / (1u64 << 30) as f64);
    let tmp = TempDir::new("fit-fraction");
    let p = ok(ganymede(tmp.path(), &plan_args("small", &[&cap]), &[]));
    let fix = suggestion(&p);
    assert!(
        fix.ends_with(": --set activation_checkpoint.offload_fraction=0.750"),
        "{p}"
    );
    for (f, fits) in [("0.750", true), ("0.5", false)] {
        let set = format!("activation_checkpoint.offload_fraction={f}");
        let p = ok(ganymede(
            tmp.path(),
            &plan_args("small", &[&cap, &set]),
            &[],
        ));
        assert_eq!(p.contains("verdict: fits"), fits, "{f}: {p}");
    }
}

#[test]
fn a_sharded_job_is_checked_per_rank() {
    // tiny on 4 ranks (FSDP, bf16 gathers straight into the weights on the device, the
    // embedding and LM head in one tensor, Muon's update in the gradient shards): 0.008916 GiB
    // per rank on the device; 0.0088 GiB is short of it. The rank's optimizer state (486 KB)
    // on the host, less two staging slots of its largest shard's state (2·4·16,384 bytes),
    // fits (0.008585 GiB).
    let tmp = TempDir::new("fit-sharded");
    let run = tmp.path().join("run");
    let mut args = train_args(&run, "tiny", &["device.memory_gib=0.0088"]);
    args.extend(["--ranks".into(), "4".into()]);
    let e = fails(ganymede(tmp.path(), &args, &[]));
    let fix = suggestion(&e);
    assert!(fix.ends_with(": --set optimizer.offload=true"), "{e}");
    assert!(!run.exists());
    let p = ok(ganymede(
        tmp.path(),
        &plan_args(
            "tiny",
            &["device.memory_gib=0.0088", "parallelism.dp_shard=4"],
        ),
        &[],
    ));
    assert!(p.contains("4 ranks"), "{p}");
    assert_eq!(suggestion(&p), fix, "plan: {p}");
    // With room, four ranks run, each within the capacity.
    let mut args = train_args(&run, "tiny", &["device.memory_gib=0.0091"]);
    args.extend(["--ranks".into(), "4".into()]);
    ok(ganymede(tmp.path(), &args, &[]));
}

#[test]
fn token_chunks_are_suggested_when_no_offload_fits_and_then_run() {
    // tiny at 1,024-token sequences (8,192 tokens a step): 0.1102 GiB on the device, mostly
    // the head's logits and the MoE rows. At 0.07 GiB no offload or checkpointing change fits,
    // nor any loss chunk (4,096 to 1,024 tokens) nor the experts in chunks of 4,096; the experts
    // in chunks of 2,048 do (0.06328 GiB).
    let tmp = TempDir::new("fit-chunks");
    let run = tmp.path().join("run");
    let job = ["model.seq_len=1024", "device.memory_gib=0.07"];
    let e = fails(ganymede(tmp.path(), &train_args(&run, "tiny", &job), &[]));
    let fix = suggestion(&e);
    assert!(
        fix.ends_with(": --set training.moe_chunk_tokens=2048"),
        "{e}"
    );
    assert!(!run.exists());
    let mut fixed: Vec<&str> = job.to_vec();
    let fix_sets = suggested_sets(&fix);
    fixed.extend(fix_sets.iter().map(String::as_str));
    ok(ganymede(tmp.path(), &train_args(&run, "tiny", &fixed), &[]));
    let mem: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("memory.json")).unwrap()).unwrap();
    let measured = mem["gpu0"]["peak_total_bytes"].as_f64().unwrap();
    let predicted = mem["gpu0"]["planner_peak_total_bytes"].as_f64().unwrap();
    assert!(measured <= 0.07 * (1u64 << 30) as f64, "{mem}");
    assert_eq!(measured, predicted, "{mem}");
}

/// `ganymede plan` for a CUDA job prints this binary's own prediction beside the write-up's
/// system, held against the cluster GPU's usable memory: the write-up's layout (384 ranks,
/// ep 4, bf16, the loss and MoE passes in chunks) does not fit a GH200 as it is, and the fix
/// it proposes fits by the same prediction (JSON: `cuda`).
#[test]
fn plan_checks_a_cuda_job_against_the_gpu() {
    let tmp = TempDir::new("fit-cuda");
    let sets = [
        "device.kind=cuda",
        "training.compute_dtype=bf16",
        "parallelism.ep=4",
        "parallelism.dp_shard=384",
        "training.loss_chunk_tokens=4096",
        "training.moe_chunk_tokens=8192",
    ];
    let mut args: Vec<String> = ["plan", "--preset", "europa-1t", "--cluster", "jupiter"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(
        sets.iter()
            .flat_map(|s| ["--set".to_string(), s.to_string()]),
    );
    let text = ok(ganymede(tmp.path(), &args, &[]));
    let i = text
        .find("This job on ganymede's CUDA backend")
        .unwrap_or_else(|| panic!("{text}"));
    let fix = suggestion(&text[i..]);
    assert!(fix.contains("GiB): --set"), "{fix}");
    args.push("--json".into());
    let v: serde_json::Value = serde_json::from_str(&ok(ganymede(tmp.path(), &args, &[]))).unwrap();
    let fit = &v["cuda"]["fit"];
    let capacity = fit["capacity"].as_f64().unwrap();
    assert!(!fit["fits"].as_bool().unwrap(), "{fit}");
    assert!(v["cuda"]["prediction"]["device_peak"].as_f64().unwrap() > capacity);
    // The proposed change, applied, fits.
    let fix_sets: Vec<String> = fit["fix"]["sets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    assert!(!fix_sets.is_empty());
    let mut fixed = args.clone();
    fixed.extend(
        fix_sets
            .iter()
            .flat_map(|s| ["--set".to_string(), s.clone()]),
    );
    let w: serde_json::Value =
        serde_json::from_str(&ok(ganymede(tmp.path(), &fixed, &[]))).unwrap();
    assert!(
        w["cuda"]["fit"]["fits"].as_bool().unwrap(),
        "{}",
        w["cuda"]["fit"]
    );
    assert_eq!(
        w["cuda"]["prediction"]["device_peak"],
        fit["fix"]["device_peak"]
    );
}

#[test]
fn a_smaller_micro_batch_is_suggested_where_nothing_that_keeps_the_numbers_fits() {
    // tiny under full checkpointing on one thread, 0.0095 GiB (10.2 MB): offloading its two
    // layers saves nothing, its 1,024 tokens are below the smallest chunks proposed, and
    // optimizer offload alone is not enough. Microbatches of 2 sequences (4 a step) are, and
    // they run within the capacity.
    let tmp = TempDir::new("fit-micro");
    let run = tmp.path().join("run");
    let job = ["device.memory_gib=0.0095"];
    let e = fails(ganymede(tmp.path(), &train_args(&run, "tiny", &job), &[]));
    let fix = suggestion(&e);
    let fix_sets = suggested_sets(&fix);
    assert_eq!(fix_sets, ["training.micro_batch_size=2"], "{e}");
    let mut fixed: Vec<&str> = job.to_vec();
    fixed.extend(fix_sets.iter().map(String::as_str));
    ok(ganymede(tmp.path(), &train_args(&run, "tiny", &fixed), &[]));
    let mem: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("memory.json")).unwrap()).unwrap();
    let measured = mem["gpu0"]["peak_total_bytes"].as_f64().unwrap();
    assert!(measured <= 0.0095 * (1u64 << 30) as f64, "{mem}");
    assert_eq!(
        measured,
        mem["gpu0"]["planner_peak_total_bytes"].as_f64().unwrap()
    );
}
