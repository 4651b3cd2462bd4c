//! Generation past the training length: with the context kept to the last `seq_len` tokens, a
//! briefly trained model predicts a long continuation of held-out text about as well past the
//! window as inside it.

use ganymede_config::{preset, AcMode};
use ganymede_data::Dataset;
use ganymede_model::{continuation_losses, forward_loss, Tokens, Workspace};
use ganymede_train::{eval, trainer};
use std::path::PathBuf;

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

#[test]
fn continuation_past_seq_len_keeps_the_in_window_loss() {
    let dir = ganymede_train::scratch::run_dir("gm-generation", "run");
    // A short window so a continuation of four windows stays cheap; trained long enough that the
    // model uses its context (the built-in corpus's loss falls well below a unigram model's).
    let seq = 32;
    let cfg = preset("tiny")
        .unwrap()
        .with_overrides(&[
            format!("model.seq_len={seq}"),
            "training.steps=150".into(),
            "training.batch_size=16".into(),
            "data.builtin_bytes=400000".into(),
            "metrics.val_every=0".into(),
        ])
        .unwrap();
    cfg.validate().unwrap();
    let opts = trainer::TrainOptions {
        out: Some(dir.clone()),
        quiet: true,
        ..Default::default()
    };
    let summary = trainer::train(&cfg, None, &opts).unwrap();
    let loaded = eval::load(summary.checkpoint.as_ref().unwrap()).unwrap();
    let data = Dataset::build(
        &cfg.data,
        cfg.model.vocab_size,
        seq,
        0,
        Some(&dir.join("data")),
    )
    .unwrap();
    let windows = 8;
    let text = &data.val_tokens()[..windows * seq + 1];

    // Every token after the first, each predicted from (at most) the last seq tokens before it;
    // losses[i] predicts text[i + 1], past the window from i = seq on.
    let (be, model, params) = (&loaded.be, &loaded.model, &loaded.params);
    let losses = continuation_losses(be, model, params, &text[..1], &text[1..]);
    let past = mean(&losses[seq..]);
    // The in-window loss: the same text cut into consecutive training-length windows.
    let mut ws = Workspace::new(be, model, 1, seq, AcMode::Full);
    let inside = mean(
        &(0..windows)
            .map(|w| {
                let x = &text[w * seq..][..seq + 1];
                forward_loss(
                    be,
                    model,
                    params,
                    &mut ws,
                    Tokens {
                        inputs: &x[..seq],
                        targets: &x[1..],
                        doc_starts: None,
                    },
                )
                .loss
            })
            .collect::<Vec<_>>(),
    );
    // The whole text in one pass at positions 0..8·seq, most of which training never reached.
    let mut ws = Workspace::new(be, model, 1, windows * seq, AcMode::Full);
    let n = windows * seq;
    let unwindowed = forward_loss(
        be,
        model,
        params,
        &mut ws,
        Tokens {
            inputs: &text[..n],
            targets: &text[1..],
            doc_starts: None,
        },
    )
    .loss;
    let _ = std::fs::remove_dir_all(PathBuf::from(&dir));
    eprintln!(
        "per-token loss past the window {past:.4}, in-window {inside:.4}; one unwindowed pass {unwindowed:.4}"
    );
    // Past the window every token has a full window of context, so it should do no worse than
    // the in-window average (which includes tokens with little context); allow 10% for noise.
    assert!(
        past < 1.1 * inside,
        "past the window {past:.4} vs in-window {inside:.4}"
    );
}
