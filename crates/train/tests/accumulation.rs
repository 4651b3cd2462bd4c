//! Gradient accumulation (`training.micro_batch_size`): a rank's share of the batch in
//! microbatches whose gradients add up before the one update. Without the auxiliary loss (which
//! is each microbatch's own, as Megatron's, and not linear in the batch) the step is the whole
//! batch's, so the losses match a run without accumulation up to the order of f32 sums; one
//! process and the sharded layouts alike.

mod common;

use common::{losses, max_rel, tiny};

/// f32 sums in another order: measured at most 3.0e-9 over these runs.
const REL_BOUND: f64 = 1e-7;

/// `tiny` (batch 8) for 4 steps without the auxiliary loss, plus `extra`.
fn cfg(micro: usize, extra: &[&str]) -> ganymede_config::JobConfig {
    let m = format!("training.micro_batch_size={micro}");
    tiny(
        4,
        &[&["model.aux_loss_coef=0", m.as_str()][..], extra].concat(),
    )
}

#[test]
fn accumulated_microbatches_train_as_the_whole_batch() {
    for (ranks, micro, extra, label) in [
        (1, 2, &[][..], "1 rank, 4 microbatches of 2"),
        (1, 1, &["optimizer.name=adamw"][..], "1 rank, 8 of 1, AdamW"),
        (2, 2, &[][..], "FSDP 2, 2 of 2"),
        (
            2,
            1,
            &["parallelism.gradient_sets=1"][..],
            "FSDP 2, 4 of 1, one gradient set",
        ),
        // More blocks than gradient sets: landing shards reused block after block.
        (2, 1, &["model.layers=5"][..], "FSDP 2, 4 of 1, five layers"),
        (
            4,
            1,
            &["parallelism.dp_shard=4", "parallelism.ep=2"][..],
            "FSDP 4 with EP 2, 2 of 1",
        ),
        (
            4,
            1,
            &["parallelism.dp_replicate=2", "parallelism.dp_shard=2"][..],
            "HSDP 2 x 2, 2 of 1",
        ),
    ] {
        let dir = label.replace([' ', ',', '.'], "");
        let want = losses(&cfg(0, extra), 1, "gm-accum", &format!("{dir}-whole"));
        let got = losses(&cfg(micro, extra), ranks, "gm-accum", &dir);
        let d = max_rel(&got, &want);
        println!("{label}: max relative loss difference {d:e}");
        assert!(d <= REL_BOUND, "{label}: {d:e} ({got:?} against {want:?})");
    }
}

#[test]
fn the_auxiliary_loss_is_each_microbatchs_own() {
    // With it, the first step's cross-entropy (reported before any update) is still the whole
    // batch's, and the later steps differ: each microbatch balances its own routing.
    let with_aux = |micro: usize| {
        let m = format!("training.micro_batch_size={micro}");
        losses(&tiny(3, &[&m]), 1, "gm-accum", &format!("aux-{micro}"))
    };
    let (whole, micro) = (with_aux(0), with_aux(2));
    assert!(((whole[0] - micro[0]) / whole[0]).abs() <= REL_BOUND);
    assert!(
        whole[2] != micro[2],
        "the aux loss's gradient did not change"
    );
}

#[test]
fn a_micro_batch_that_does_not_divide_a_ranks_share_is_refused() {
    let c = cfg(3, &[]);
    let opts = ganymede_train::trainer::TrainOptions {
        ranks: 1,
        out: Some(ganymede_train::scratch::run_dir("gm-accum", "bad")),
        quiet: true,
        ..Default::default()
    };
    let e = ganymede_train::trainer::train(&c, None, &opts)
        .unwrap_err()
        .to_string();
    let e = format!("{e:#}");
    assert!(
        e.contains("training.micro_batch_size = 3") && e.contains("8 sequences"),
        "{e}"
    );
}

#[test]
fn a_run_resumes_with_another_micro_batch() {
    // What a run that ran out of memory does: resume its checkpoint in smaller microbatches.
    // The key passes the resume check, and the continuation is the uninterrupted run's.
    use ganymede_train::trainer::{resolve_config, train, TrainOptions};
    let mut c = cfg(0, &["checkpoint.enable=true", "checkpoint.interval=2"]);
    c.training.steps = 4;
    let dir = ganymede_train::scratch::run_dir("gm-accum", "resume-whole");
    let opts = |out| TrainOptions {
        ranks: 1,
        out: Some(out),
        quiet: true,
        ..Default::default()
    };
    let full = train(&c, None, &opts(dir.clone())).unwrap().losses;
    let ck = dir
        .join("checkpoints")
        .join(ganymede_train::checkpoint::dir_name(2));
    let set = ["training.micro_batch_size=2".to_string()];
    let (resumed_cfg, ck) = resolve_config(None, None, &set, None, Some(&ck), 1).unwrap();
    assert_eq!(resumed_cfg.training.micro_batch_size, 2);
    let out = ganymede_train::scratch::run_dir("gm-accum", "resume-micro");
    let resumed = train(&resumed_cfg, ck.as_deref(), &opts(out))
        .unwrap()
        .losses;
    let d = max_rel(&resumed, &full[2..]);
    println!("resumed in microbatches of 2: max relative loss difference {d:e}");
    assert!(d <= REL_BOUND, "{d:e}");
}
