use super::*;

#[test]
fn presets_parse_and_validate() {
    for name in PRESETS {
        let c = preset(name).unwrap();
        c.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert_eq!(preset("tiny").unwrap().model.hidden, 64);
    assert_eq!(preset("europa-1t").unwrap().model.experts, 384);
}

#[test]
fn overrides_apply_with_types() {
    let c = JobConfig::load(
        Some("tiny"),
        None,
        &[
            "optimizer.lr=0.003".into(),
            "optimizer.name=adamw".into(),
            "model.top_k=3".into(),
            "activation_checkpoint.mode=none".into(),
            "data.path=\"x y\"".into(),
        ],
    )
    .unwrap();
    assert_eq!(c.optimizer.lr, 0.003);
    assert_eq!(c.optimizer.name, OptimizerName::Adamw);
    assert_eq!(c.model.top_k, 3);
    assert_eq!(c.activation_checkpoint.mode, AcMode::None);
    assert_eq!(c.data.path, "x y");
    // An integer given for a float key is accepted.
    let c = c.with_overrides(&["optimizer.lr=1".into()]).unwrap();
    assert_eq!(c.optimizer.lr, 1.0);
}

#[test]
fn unknown_key_is_named() {
    let e = JobConfig::load(Some("tiny"), None, &["optimizer.lrr=0.1".into()]).unwrap_err();
    assert!(e.to_string().contains("lrr"), "{e}");
    let e = JobConfig::load(Some("tiny"), None, &["nosection.k=1".into()]).unwrap_err();
    assert!(e.to_string().contains("nosection"), "{e}");
    let e = JobConfig::load(Some("tiny"), None, &["optimizer.name=sgd".into()]).unwrap_err();
    assert!(e.to_string().contains("sgd"), "{e}");
    let e = JobConfig::load(Some("huge"), None, &[]).unwrap_err();
    assert!(e.to_string().contains("huge"), "{e}");
    let e = JobConfig::load(Some("tiny"), None, &["garbage".into()]).unwrap_err();
    assert!(e.to_string().contains("garbage"), "{e}");
}

#[test]
fn invalid_values_name_key_and_reason() {
    let cases = [
        ("model.top_k=9", "model.top_k", "larger than model.experts"),
        ("model.kv_heads=3", "model.kv_heads", "divide"),
        ("model.head_dim=15", "model.head_dim", "even"),
        ("optimizer.lr=0", "optimizer.lr", "positive"),
        ("parallelism.ep=3", "parallelism.ep", "divide model.experts"),
        (
            "parallelism.ep=4",
            "parallelism.ep",
            "divide parallelism.dp_shard",
        ),
        ("data.path=/no/such/file.txt", "data.path", "no such file"),
        (
            "parallelism.dp_replicate=0",
            "parallelism.dp_replicate",
            "at least 1",
        ),
        (
            "parallelism.dp_replicate=2",
            "parallelism.dp_replicate",
            "needs parallelism.dp_shard > 1",
        ),
        (
            "parallelism.timeout_s=0",
            "parallelism.timeout_s",
            "positive",
        ),
        (
            "parallelism.ep_capacity_factor=0.5",
            "parallelism.ep_capacity_factor",
            "at least 1",
        ),
        (
            "parallelism.prefetch=9",
            "parallelism.prefetch",
            "at most 8",
        ),
        (
            "parallelism.gradient_sets=3",
            "parallelism.gradient_sets",
            "must be 1",
        ),
        (
            "parallelism.gradient_sets=0",
            "parallelism.gradient_sets",
            "must be 1",
        ),
        ("training.steps=0", "training.steps", "at least 1"),
        (
            "data.document_mask=true",
            "data.document_mask",
            "no document boundaries",
        ),
        (
            "data.mean_document_tokens=0",
            "data.mean_document_tokens",
            "at least 1",
        ),
    ];
    for (o, key, reason) in cases {
        let c = JobConfig::load(Some("tiny"), None, &[o.to_string()]).unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains(key) && e.contains(reason), "{o}: {e}");
    }
}

#[test]
fn toml_round_trip() {
    let c = preset("small").unwrap();
    let back = JobConfig::from_toml_str(&c.to_toml(), "round trip").unwrap();
    assert_eq!(c, back);
}

#[test]
fn file_errors_name_the_file() {
    let dir = std::env::temp_dir().join(format!("gm-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("bad.toml");
    std::fs::write(&f, "[model]\nhidden = \"wide\"\n").unwrap();
    let e = JobConfig::from_file(&f).unwrap_err().to_string();
    assert!(e.contains("bad.toml"), "{e}");
    let e = JobConfig::from_file(&dir.join("missing.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.toml"), "{e}");
}

#[test]
fn parallelism_keys_parse() {
    let c = JobConfig::load(
        Some("tiny"),
        None,
        &[
            "parallelism.gather_dtype=f32".into(),
            "parallelism.muon_placement=naive".into(),
            "parallelism.prefetch=2".into(),
        ],
    )
    .unwrap();
    c.validate().unwrap();
    assert_eq!(c.parallelism.gather_dtype, GatherDtype::F32);
    assert_eq!(c.parallelism.muon_placement, MuonPlacement::Naive);
    assert_eq!(c.parallelism.prefetch, 2);
    let e = JobConfig::load(
        Some("tiny"),
        None,
        &["parallelism.muon_placement=ring".into()],
    )
    .unwrap_err();
    assert!(e.to_string().contains("ring"), "{e}");
}

#[test]
fn offloaded_layers_round_trip_through_three_decimals() {
    // docs/planning.md: 0.730 of 74 layers is 54 (0.73·74 = 54.02), not 55.
    assert_eq!(offloaded_layers(0.73, 74), 54);
    assert_eq!(offloaded_layers(0.0, 74), 0);
    assert_eq!(offloaded_layers(1.0, 74), 74);
    for layers in [1usize, 2, 7, 61, 74, 128, 999] {
        for n in 0..=layers {
            let printed: f64 = format!("{:.3}", n as f64 / layers as f64).parse().unwrap();
            assert_eq!(offloaded_layers(printed, layers), n, "{n} of {layers}");
        }
    }
}

#[test]
fn tensorboard_key_defaults_off_and_parses() {
    assert!(!preset("tiny").unwrap().metrics.tensorboard);
    let c = JobConfig::load(Some("tiny"), None, &["metrics.tensorboard=true".into()]).unwrap();
    assert!(c.metrics.tensorboard);
}

#[test]
fn device_kind_cuda_parses_and_refuses_cpu_only_knobs() {
    let c = JobConfig::load(Some("tiny"), None, &["device.kind=cuda".into()]).unwrap();
    assert_eq!(c.device.kind, DeviceKind::Cuda);
    assert_eq!(c.device.kind.name(), "cuda");
    c.validate().unwrap();
    for knob in ["device.memory_gib=1", "device.check_streams=true"] {
        let c = c.with_overrides(&[knob.into()]).unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("device.kind") && e.contains("cpu-two-memory"),
            "{knob}: {e}"
        );
    }
}

#[test]
fn compute_dtype_parses_round_trips_and_names_bad_values() {
    let c = JobConfig::load(Some("tiny"), None, &[]).unwrap();
    assert_eq!(
        c.training.compute_dtype,
        ComputeDtype::F32,
        "default stays exact f32"
    );
    let c = JobConfig::load(Some("tiny"), None, &["training.compute_dtype=bf16".into()]).unwrap();
    c.validate().unwrap();
    assert_eq!(c.training.compute_dtype, ComputeDtype::Bf16);
    assert!(c.to_toml().contains("compute_dtype = \"bf16\""));
    let back = JobConfig::from_toml_str(&c.to_toml(), "round trip").unwrap();
    assert_eq!(back, c);
    let e = JobConfig::load(Some("tiny"), None, &["training.compute_dtype=fp16".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("compute_dtype") && e.contains("fp16"), "{e}");
}

#[test]
fn ns_dtype_parses_round_trips_defaults_for_old_configs_and_names_bad_values() {
    let c = JobConfig::load(Some("tiny"), None, &[]).unwrap();
    assert_eq!(c.optimizer.ns_dtype, NsDtype::Auto);
    for (v, want) in [
        ("auto", NsDtype::Auto),
        ("f32", NsDtype::F32),
        ("bf16", NsDtype::Bf16),
    ] {
        let c = JobConfig::load(Some("tiny"), None, &[format!("optimizer.ns_dtype={v}")]).unwrap();
        c.validate().unwrap();
        assert_eq!(c.optimizer.ns_dtype, want);
        assert!(c.to_toml().contains(&format!("ns_dtype = \"{v}\"")));
        let back = JobConfig::from_toml_str(&c.to_toml(), "round trip").unwrap();
        assert_eq!(back, c);
    }
    // A config saved before the key existed (a checkpoint's, say) loads with the default.
    let c = JobConfig::load(Some("tiny"), None, &["optimizer.ns_dtype=auto".into()]).unwrap();
    let old: String = c
        .to_toml()
        .lines()
        .filter(|l| !l.starts_with("ns_dtype"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(!old.contains("ns_dtype"));
    assert_eq!(JobConfig::from_toml_str(&old, "old").unwrap(), c);
    let e = JobConfig::load(Some("tiny"), None, &["optimizer.ns_dtype=fp16".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("optimizer.ns_dtype") && e.contains("fp16") && e.contains("auto"),
        "{e}"
    );
}

#[test]
fn ns_dtype_auto_follows_native_bf16() {
    assert!(!NsDtype::Auto.bf16_on(false), "auto is f32 on the CPU");
    assert!(NsDtype::Auto.bf16_on(true), "auto is bf16 on a GPU");
    for native in [false, true] {
        assert!(!NsDtype::F32.bf16_on(native));
        assert!(NsDtype::Bf16.bf16_on(native));
    }
}

#[test]
fn boundary_dtype_parses_round_trips_follows_compute_and_names_bad_values() {
    let c = JobConfig::load(Some("tiny"), None, &[]).unwrap();
    assert_eq!(c.activation_checkpoint.boundary_dtype, BoundaryDtype::Auto);
    for (v, want) in [
        ("auto", BoundaryDtype::Auto),
        ("f32", BoundaryDtype::F32),
        ("bf16", BoundaryDtype::Bf16),
    ] {
        let set = format!("activation_checkpoint.boundary_dtype={v}");
        let c = JobConfig::load(Some("tiny"), None, &[set]).unwrap();
        c.validate().unwrap();
        assert_eq!(c.activation_checkpoint.boundary_dtype, want);
        assert!(c.to_toml().contains(&format!("boundary_dtype = \"{v}\"")));
        let back = JobConfig::from_toml_str(&c.to_toml(), "round trip").unwrap();
        assert_eq!(back, c);
    }
    // A config saved before the key existed loads with `auto`.
    let old: String = c
        .to_toml()
        .lines()
        .filter(|l| !l.starts_with("boundary_dtype"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(!old.contains("boundary_dtype"));
    assert_eq!(JobConfig::from_toml_str(&old, "old").unwrap(), c);
    let e = JobConfig::load(
        Some("tiny"),
        None,
        &["activation_checkpoint.boundary_dtype=fp16".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("activation_checkpoint.boundary_dtype") && e.contains("fp16"),
        "{e}"
    );
    // auto is the compute dtype.
    assert!(!BoundaryDtype::Auto.bf16_under(ComputeDtype::F32));
    assert!(BoundaryDtype::Auto.bf16_under(ComputeDtype::Bf16));
    for compute in [ComputeDtype::F32, ComputeDtype::Bf16] {
        assert!(!BoundaryDtype::F32.bf16_under(compute));
        assert!(BoundaryDtype::Bf16.bf16_under(compute));
    }
}

#[test]
fn router_dtype_parses_applies_only_under_bf16_compute_and_names_bad_values() {
    let c = JobConfig::load(Some("tiny"), None, &[]).unwrap();
    assert_eq!(c.training.router_dtype, RouterDtype::Auto);
    for (v, want) in [
        ("auto", RouterDtype::Auto),
        ("f32", RouterDtype::F32),
        ("bf16", RouterDtype::Bf16),
    ] {
        let set = [format!("training.router_dtype={v}")];
        let c = JobConfig::load(Some("tiny"), None, &set).unwrap();
        assert_eq!(c.training.router_dtype, want);
        let back = JobConfig::from_toml_str(&c.to_toml(), "round trip").unwrap();
        assert_eq!(back, c);
    }
    // (compute, router_dtype, native bf16) -> bf16 router operands.
    for (compute, router, native, want) in [
        (ComputeDtype::F32, RouterDtype::Bf16, true, false),
        (ComputeDtype::Bf16, RouterDtype::Auto, false, false),
        (ComputeDtype::Bf16, RouterDtype::Auto, true, true),
        (ComputeDtype::Bf16, RouterDtype::F32, true, false),
        (ComputeDtype::Bf16, RouterDtype::Bf16, false, true),
    ] {
        let t = TrainingConfig {
            compute_dtype: compute,
            router_dtype: router,
            ..TrainingConfig::default()
        };
        assert_eq!(
            t.router_bf16(native),
            want,
            "{compute:?} {router:?} {native}"
        );
    }
    let e = JobConfig::load(Some("tiny"), None, &["training.router_dtype=fp8".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("training.router_dtype") && e.contains("fp8"),
        "{e}"
    );
}
