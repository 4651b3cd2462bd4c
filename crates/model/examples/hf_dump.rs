//! Dump a small random model, a batch, and ganymede's logits, loss and gradients (f32, auxiliary
//! loss off) for `scripts/hf_check.py`, which recomputes them with transformers'
//! Qwen3MoeForCausalLM (the llm.c `test_gpt2` idea: check against an independent implementation).
//!
//! `cargo run --release -p ganymede-model --example hf_dump -- OUT_DIR [renorm 0|1] [dense 0|1]`

use ganymede_config::{preset, AcMode};
use ganymede_core::sample::Lcg;
use ganymede_core::{Category, CpuBackend, Memory, ParamStore};
use ganymede_model::{forward_backward, Model, Tokens, Workspace};
use std::io::Write;

fn write_f32(path: &std::path::Path, x: &[f32]) {
    let mut f = std::fs::File::create(path).unwrap();
    for v in x {
        f.write_all(&v.to_le_bytes()).unwrap();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let out = std::path::PathBuf::from(args.first().expect("OUT_DIR"));
    let renorm = args.get(1).is_none_or(|s| s == "1");
    let dense = args.get(2).is_some_and(|s| s == "1");
    std::fs::create_dir_all(&out).unwrap();
    let mut cfg = preset("tiny").unwrap().model;
    cfg.vocab_size = 97;
    cfg.seq_len = 24;
    cfg.norm_topk_prob = renorm;
    cfg.aux_loss_coef = 0.0;
    cfg.init_std = 0.1;
    cfg.rope_theta = 10_000.0;
    if dense {
        cfg.dense_layers = 1;
        cfg.dense_hidden = 96;
    }
    let (batch, seq) = (3, cfg.seq_len);
    let be = CpuBackend::default();
    let model = Model::new(&cfg);
    let mut params = model.init_params(&be, 5);
    // Norm gains away from one, so a mix-up of gains would show.
    let mut g = Lcg::new(99);
    for (spec, t) in params.iter_mut() {
        if spec.shape.len() == 1 {
            let x: Vec<f32> = (0..spec.numel()).map(|_| 1.0 + 0.3 * g.uniform()).collect();
            be.write(t.view_mut(), &x);
        }
    }
    let n = batch * seq;
    let inputs: Vec<u32> = (0..n).map(|_| g.below(cfg.vocab_size)).collect();
    let targets: Vec<u32> = (0..n).map(|_| g.below(cfg.vocab_size)).collect();
    let mut grads = ParamStore::zeros(&be, model.param_specs(), Category::Grads);
    let mut ws = Workspace::new(&be, &model, batch, seq, AcMode::Full);
    let o = forward_backward(
        &be,
        &model,
        &params,
        &mut grads,
        &mut ws,
        Tokens {
            inputs: &inputs,
            targets: &targets,
            doc_starts: None,
        },
        1.0,
    );
    let mut manifest = serde_json::json!({
        "config": cfg, "batch": batch, "seq": seq, "loss": o.loss,
        "inputs": inputs, "targets": targets, "params": [],
    });
    for (i, (spec, t)) in params.iter().enumerate() {
        let file = format!("p{i}.bin");
        write_f32(&out.join(&file), &be.download(t.view()));
        write_f32(
            &out.join(format!("g{i}.bin")),
            &be.download(grads.get(i).view()),
        );
        manifest["params"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
                "name": spec.name, "shape": spec.shape, "file": file, "grad": format!("g{i}.bin"),
            }));
    }
    std::fs::write(out.join("manifest.json"), manifest.to_string()).unwrap();
    println!("loss {} written to {}", o.loss, out.display());
}
