//! Whole-model checks: every parameter's gradient against finite differences in f64 (both
//! activation-checkpointing modes), the two modes against each other, f32 against f64, the
//! activation plan against the ledger, and KV-cached generation against full recomputation.

use crate::*;
use ganymede_config::{preset, AcMode, ComputeDtype, ModelConfig};
use ganymede_core::{CpuBackend, Device, Ledger, Memory};
use std::sync::Arc;

mod boundaries;
mod documents;
mod host_reads;
mod loss_chunk;
mod moe_chunk;

fn cfg(dense: bool, shared: bool, renorm: bool, bias: bool) -> ModelConfig {
    ModelConfig {
        vocab_size: 11,
        hidden: 8,
        layers: 2,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        experts: 4,
        top_k: 2,
        expert_hidden: 6,
        shared_experts: if shared { 2 } else { 0 },
        shared_expert_hidden: 5,
        dense_layers: dense as usize,
        dense_hidden: 7,
        seq_len: 5,
        rope_theta: 10_000.0,
        norm_eps: 1e-6,
        norm_topk_prob: renorm,
        aux_loss_coef: 0.3,
        router_bias_update: if bias { 0.01 } else { 0.0 },
        init_std: 0.5,
    }
}

fn be64() -> CpuBackend {
    CpuBackend::new_f64(Arc::new(Ledger::new()))
}

fn tokens(n: usize, v: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| (r.next_u64() % v as u64) as u32).collect()
}

/// One step of `model` (a `tiny` shape) on a batch of 2 × 32 tokens in `mode`: the step's
/// output, the gradients, the loss of a forward alone on the same batch, and the workspace.
fn tiny_step(model: &Model, mode: AcMode) -> (StepOutput, Vec<Vec<f32>>, f64, Workspace) {
    let c = model.config();
    let be = ganymede_core::CpuBackend::default();
    let params = model.init_params(&be, 3);
    let (batch, seq) = (2, 32);
    let inputs = tokens(batch * seq, c.vocab_size, 4);
    let targets = tokens(batch * seq, c.vocab_size, 5);
    let t = Tokens {
        inputs: &inputs,
        targets: &targets,
        doc_starts: None,
    };
    let mut ws = Workspace::new(&be, model, batch, seq, mode);
    let mut grads = ParamStore::zeros(&be, model.param_specs(), Category::Grads);
    let out = forward_backward(&be, model, &params, &mut grads, &mut ws, t, 1.0);
    let eval = forward_loss(&be, model, &params, &mut ws, t).loss;
    let g = grads
        .tensors()
        .iter()
        .map(|t| be.download(t.view()))
        .collect();
    (out, g, eval, ws)
}

/// Largest |a − b| over all gradients, relative to the largest |b|.
fn max_rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut d, mut m) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        d = d.max((x - y).abs() as f64);
        m = m.max(y.abs() as f64);
    }
    d / m
}

/// Parameters with every entry (norm gains and the selection bias included) away from its
/// special initial value, so no gradient term can vanish by symmetry.
fn random_params(be: &dyn Backend, model: &Model, seed: u64) -> ParamStore {
    let mut p = model.init_params(be, seed);
    let mut r = Rng::new(seed + 1);
    for (spec, t) in p.iter_mut() {
        let mut x = be.download_f64(t.view());
        for v in x.iter_mut() {
            match spec.kind {
                ParamKind::Vector => *v = 1.0 + 0.3 * r.normal(),
                ParamKind::Buffer => *v = 0.05 * r.normal(),
                _ => {}
            }
        }
        set(be, t, &x);
    }
    p
}

fn set(be: &dyn Backend, t: &mut ganymede_core::Tensor, x: &[f64]) {
    let u = be.upload_f64(x, t.shape(), Category::Buffers);
    be.copy(t.view_mut(), u.view());
}

fn total_loss(o: &StepOutput, cfg: &ModelConfig) -> f64 {
    o.loss + cfg.aux_loss_coef * o.aux_loss
}

fn grad_check(cfg: &ModelConfig, mode: AcMode) {
    grad_check_of(&Model::new(cfg), mode)
}

/// [`grad_check`] of `model` (its config and options, e.g. a MoE chunk).
fn grad_check_of(model: &Model, mode: AcMode) {
    let be = be64();
    let cfg = model.config();
    let mut params = random_params(&be, model, 7);
    let (batch, seq) = (2, cfg.seq_len);
    let inputs = tokens(batch * seq, cfg.vocab_size, 1);
    let targets = tokens(batch * seq, cfg.vocab_size, 2);
    let mut ws = Workspace::new(&be, model, batch, seq, mode);
    let mut grads = ParamStore::zeros(&be, model.param_specs(), Category::Grads);
    let out = forward_backward(
        &be,
        model,
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
    if cfg.layers == cfg.dense_layers {
        assert!(out.aux_loss == 0.0 && out.expert_load.is_empty());
    } else {
        assert!(out.aux_loss > 0.0);
    }
    let h = 1e-5;
    let mut worst = 0.0f64;
    for i in 0..params.len() {
        let spec = params.specs()[i].clone();
        if !spec.kind.is_trainable() {
            continue;
        }
        let g = be.download_f64(grads.get(i).view());
        let x0 = be.download_f64(params.get(i).view());
        let stride = (x0.len() / 7).max(1);
        for j in (0..x0.len()).step_by(stride) {
            let mut f = |d: f64| {
                let mut x = x0.clone();
                x[j] += d;
                set(&be, params.get_mut(i), &x);
                let o = forward_loss(
                    &be,
                    model,
                    &params,
                    &mut ws,
                    Tokens {
                        inputs: &inputs,
                        targets: &targets,
                        doc_starts: None,
                    },
                );
                (total_loss(&o, cfg), o.expert_load)
            };
            let ((fp, lp), (fm, lm)) = (f(h), f(-h));
            set(&be, params.get_mut(i), &x0);
            assert_eq!(lp, lm, "{}: perturbation changed routing", spec.name);
            let num = (fp - fm) / (2.0 * h);
            let err = (num - g[j]).abs() / (num.abs().max(g[j].abs()) + 1e-7);
            worst = worst.max(err);
            assert!(
                err < 1e-5,
                "{:?} {}[{j}]: numeric {num:e} analytic {:e}",
                mode,
                spec.name,
                g[j]
            );
        }
        // A gradient that is identically zero would pass trivially: every trained tensor
        // must receive some gradient.
        assert!(g.iter().any(|&v| v != 0.0), "{}: zero gradient", spec.name);
    }
    eprintln!("grad check {mode:?}: worst relative error {worst:.2e}");
}

#[test]
fn gradients_dense_first_layer_shared_experts_renorm() {
    let c = cfg(true, true, true, false);
    grad_check(&c, AcMode::None);
    grad_check(&c, AcMode::Full);
}

#[test]
fn gradients_all_moe_no_renorm_with_selection_bias() {
    let c = cfg(false, false, false, true);
    grad_check(&c, AcMode::None);
    grad_check(&c, AcMode::Full);
}

#[test]
fn gradients_all_dense() {
    let mut c = cfg(true, false, true, false);
    c.layers = 1;
    grad_check(&c, AcMode::Full);
}

#[test]
fn gradients_all_moe_shared_no_renorm() {
    grad_check(&cfg(false, true, false, false), AcMode::Full);
}

fn tiny_f32(mode: AcMode) -> (Vec<Vec<f32>>, StepOutput) {
    let c = preset("tiny").unwrap().model;
    tiny_grads(&c, &CpuBackend::default(), mode, ComputeDtype::F32)
}

/// Model `c`'s gradients and step output on `be` (tiny's batch), with GEMM operands in
/// `compute`.
fn tiny_grads(
    c: &ModelConfig,
    be: &CpuBackend,
    mode: AcMode,
    compute: ComputeDtype,
) -> (Vec<Vec<f32>>, StepOutput) {
    tiny_grads_of(&Model::new(c).with_compute_dtype(compute), be, mode)
}

/// [`tiny_grads`] of `model`.
fn tiny_grads_of(model: &Model, be: &CpuBackend, mode: AcMode) -> (Vec<Vec<f32>>, StepOutput) {
    let c = model.config().clone();
    let params = model.init_params(be, 3);
    let (batch, seq) = (2, 32);
    let inputs = tokens(batch * seq, c.vocab_size, 4);
    let targets = tokens(batch * seq, c.vocab_size, 5);
    let mut ws = Workspace::new(be, model, batch, seq, mode);
    let mut grads = ParamStore::zeros(be, model.param_specs(), Category::Grads);
    let out = forward_backward(
        be,
        model,
        &params,
        &mut grads,
        &mut ws,
        Tokens {
            inputs: &inputs,
            targets: &targets,
            doc_starts: None,
        },
        0.5,
    );
    (
        grads
            .tensors()
            .iter()
            .map(|t| be.download(t.view()))
            .collect(),
        out,
    )
}

#[test]
fn checkpointing_modes_give_identical_gradients() {
    let (ga, oa) = tiny_f32(AcMode::None);
    let (gb, ob) = tiny_f32(AcMode::Full);
    assert_eq!(oa.loss, ob.loss);
    assert_eq!(oa.aux_loss, ob.aux_loss);
    assert_eq!(oa.expert_load, ob.expert_load);
    // Recompute runs the same kernels on the same inputs: bitwise equal.
    assert_eq!(ga, gb);
}

#[test]
fn f32_forward_matches_f64() {
    let c = cfg(true, true, true, false);
    let (b64, b32) = (be64(), CpuBackend::default());
    let model = Model::new(&c);
    let p64 = random_params(&b64, &model, 9);
    let tensors = p64
        .iter()
        .map(|(s, t)| b32.upload_f64(&b64.download_f64(t.view()), &s.shape, Category::Params))
        .collect();
    let p32 = ParamStore::from_tensors(model.param_specs().to_vec(), tensors);
    let inputs = tokens(10, c.vocab_size, 1);
    let targets = tokens(10, c.vocab_size, 2);
    let mut losses = vec![];
    for (be, p) in [(&b64 as &dyn Backend, &p64), (&b32, &p32)] {
        let mut ws = Workspace::new(be, &model, 2, 5, AcMode::Full);
        let o = forward_loss(
            be,
            &model,
            p,
            &mut ws,
            Tokens {
                inputs: &inputs,
                targets: &targets,
                doc_starts: None,
            },
        );
        losses.push((o.loss, o.aux_loss));
    }
    let (a, b) = (losses[0], losses[1]);
    assert!((a.0 - b.0).abs() < 1e-5 * a.0, "{losses:?}");
    assert!((a.1 - b.1).abs() < 1e-5 * a.1, "{losses:?}");
}

/// Elements the workspace holds in bf16 under bf16 rows and outputs ([`Precision::bf16_rows`],
/// [`Precision::bf16_outputs`]) for `n` tokens: per set, a MoE layer's dispatched inputs, gate,
/// up, SwiGLU products and outputs (k·(2H + 3F) a token) and an FFN's gate, up and products
/// (3W); once,
/// the scratch's expert output, SwiGLU product, gate and up gradients (k·(H + 3F)), the
/// FFN's three (3·max W) and the head's logits (V, every token's: no loss chunks here).
fn bf16_row_elems(c: &ModelConfig, n: usize, mode: AcMode) -> u64 {
    let width = |l: usize| match c.is_moe_layer(l) {
        true => c.shared_experts * c.shared_hidden(),
        false => c.dense_hidden,
    };
    let (k, h, f) = (c.top_k, c.hidden, c.expert_hidden);
    let any_moe = (0..c.layers).any(|l| c.is_moe_layer(l));
    let max_w = (0..c.layers).map(width).max().unwrap_or(0);
    let sets: Vec<(bool, usize)> = match mode {
        AcMode::None => (0..c.layers)
            .map(|l| (c.is_moe_layer(l), width(l)))
            .collect(),
        AcMode::Full => vec![(any_moe, max_w)],
    };
    let per_set: usize = sets
        .iter()
        .map(|&(moe, w)| moe as usize * k * (2 * h + 3 * f) + 3 * w)
        .sum();
    (n * (per_set + any_moe as usize * k * (h + 3 * f) + 3 * max_w + c.vocab_size)) as u64
}

#[test]
fn activation_bytes_match_the_ledger() {
    use ganymede_config::BoundaryDtype;
    for c in [
        preset("tiny").unwrap().model,
        cfg(true, true, true, true),
        cfg(true, false, false, false),
    ] {
        for mode in [AcMode::None, AcMode::Full] {
            for (compute, boundary) in [
                (ComputeDtype::F32, BoundaryDtype::Auto),
                (ComputeDtype::F32, BoundaryDtype::Bf16),
                (ComputeDtype::Bf16, BoundaryDtype::F32),
                (ComputeDtype::Bf16, BoundaryDtype::Auto),
            ] {
                let what = format!("{mode:?}, {compute:?} compute, {boundary:?} boundaries");
                let ledger = Arc::new(Ledger::new());
                let be = CpuBackend::new(ledger.clone());
                let model = Model::new(&c)
                    .with_compute_dtype(compute)
                    .with_boundary_dtype(boundary);
                let prec = Precision::of(&model);
                let ws = Workspace::new(&be, &model, 3, 7, mode);
                let measured = ledger.report().peak(Device::Host, Category::Activations);
                assert_eq!(
                    measured,
                    activation_bytes_at(&c, 3, 7, mode, prec),
                    "{what}"
                );
                assert_eq!(ws.bytes(), measured, "{what}");
                // bf16 compute: each set's v, qr, kr, att in bf16, four bf16 attention
                // gradients in the scratch, the rows only bf16-input GEMMs read and the GEMM
                // outputs only SwiGLU reads in bf16.
                // bf16 boundaries: L + 1 of them at 2 bytes an element and one f32 working
                // copy.
                let sets = match mode {
                    AcMode::None => c.layers as u64,
                    AcMode::Full => 1,
                };
                let attn16 = 2 * 21 * (2 * c.q_dim() + 2 * c.kv_dim()) as u64;
                let nh = 21 * c.hidden as u64;
                let saved = match prec.bf16 {
                    true => (sets - 1) * attn16 + 2 * bf16_row_elems(&c, 21, mode),
                    false => 0,
                } + match prec.bf16_boundaries {
                    true => 2 * nh * (c.layers as u64 + 1) - 4 * nh,
                    false => 0,
                };
                assert_eq!(activation_bytes(&c, 3, 7, mode) - measured, saved, "{what}");
                if boundary == BoundaryDtype::Auto {
                    let same = match compute {
                        ComputeDtype::F32 => activation_bytes(&c, 3, 7, mode),
                        ComputeDtype::Bf16 => activation_bytes_bf16(&c, 3, 7, mode),
                    };
                    assert_eq!(measured, same, "{what}");
                }
            }
        }
    }
    // Full checkpointing keeps less than keeping everything once there are several layers.
    let c = preset("small").unwrap().model;
    assert!(
        activation_bytes(&c, 8, 256, AcMode::Full) < activation_bytes(&c, 8, 256, AcMode::None)
    );
}

#[test]
fn parameter_table_follows_qwen3_moe() {
    let c = cfg(true, true, true, true);
    let m = Model::new(&c);
    let names: Vec<&str> = m.param_specs().iter().map(|s| s.name.as_str()).collect();
    for n in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.1.mlp.shared_experts.up_proj",
        "model.layers.1.mlp.e_score_correction_bias",
        "model.layers.1.self_attn.q_norm.weight",
    ] {
        assert!(names.contains(&n), "{n}");
    }
    let tiny = Model::new(&preset("tiny").unwrap().model);
    let total: usize = tiny.param_specs().iter().map(|s| s.numel()).sum();
    assert!(
        (400_000..500_000).contains(&total),
        "tiny has {total} parameters"
    );
}

#[test]
fn init_is_deterministic() {
    let be = CpuBackend::default();
    let m = Model::new(&preset("tiny").unwrap().model);
    let (a, b, c) = (
        m.init_params(&be, 1),
        m.init_params(&be, 1),
        m.init_params(&be, 2),
    );
    let e = m
        .param_specs()
        .iter()
        .position(|s| s.kind == ParamKind::Embedding)
        .unwrap();
    assert_eq!(be.download(a.get(e).view()), be.download(b.get(e).view()));
    assert_ne!(be.download(a.get(e).view()), be.download(c.get(e).view()));
    let x = be.download(a.get(e).view());
    let std = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
    assert!((std - 0.02).abs() < 0.002, "std {std}");
}

#[test]
fn router_bias_moves_towards_balance() {
    let c = cfg(false, false, true, true);
    let be = be64();
    let model = Model::new(&c);
    let mut params = model.init_params(&be, 1);
    let out = StepOutput {
        loss: 0.0,
        aux_loss: 0.0,
        tokens: 10,
        expert_load: vec![vec![0.5, 0.25, 0.25, 0.0]; 2],
    };
    update_router_bias(&be, &model, &mut params, &out);
    let b = be.download_f64(
        params
            .by_name("model.layers.0.mlp.e_score_correction_bias")
            .view(),
    );
    let want = [-0.01, 0.0, 0.0, 0.01];
    assert!(
        b.iter().zip(want).all(|(x, y)| (x - y).abs() < 1e-9),
        "{b:?}"
    );
}

/// Logits of every position of one sequence, by the full (uncached) forward.
fn full_logits(be: &dyn Backend, model: &Model, params: &ParamStore, ids: &[u32]) -> Vec<f64> {
    let mut ws = Workspace::new(be, model, 1, ids.len(), AcMode::None);
    forward_loss(
        be,
        model,
        params,
        &mut ws,
        Tokens {
            inputs: ids,
            targets: ids,
            doc_starts: None,
        },
    );
    be.download_f64(ws.head.logits.view())
}

#[test]
fn kv_cache_generation_matches_full_forward() {
    for c in [cfg(true, true, true, false), cfg(false, false, false, true)] {
        let be = be64();
        let model = Model::new(&c);
        let params = random_params(&be, &model, 11);
        let prompt = [3u32, 1, 4];
        // seq_len is 5: the first two tokens come from the cache, the rest from a sliding
        // window of the last 5 tokens.
        let (ids, logits) = generate::generate_with_logits(
            &be,
            &model,
            &params,
            &prompt,
            Sampling {
                max_new_tokens: 7,
                temperature: 0.0,
                top_k: 0,
                seed: 1,
            },
        );
        assert_eq!(ids.len(), 7);
        assert!(prompt.len() + 7 > c.seq_len + 2);
        let mut seq = prompt.to_vec();
        seq.extend(&ids[..6]);
        let v = c.vocab_size;
        for (i, l) in logits.iter().enumerate() {
            // The context of token i is the last seq_len tokens before it, at positions from 0.
            let end = prompt.len() + i;
            let ctx = &seq[end.saturating_sub(c.seq_len)..end];
            let full = full_logits(&be, &model, &params, ctx);
            let row = &full[(ctx.len() - 1) * v..][..v];
            for (a, b) in l.iter().zip(row) {
                assert!((a - b).abs() < 1e-10, "step {i}: generated {a} vs full {b}");
            }
            // Greedy: the argmax of the full recompute.
            let am = (0..v).fold(0, |b, j| if row[j] > row[b] { j } else { b });
            assert_eq!(ids[i] as usize, am);
        }
        // A prompt longer than seq_len keeps only its last seq_len tokens.
        let long = [2u32, 7, 3, 1, 4, 1, 5, 9];
        let (_, a) = generate::generate_with_logits(
            &be,
            &model,
            &params,
            &long,
            Sampling {
                max_new_tokens: 2,
                temperature: 0.0,
                top_k: 0,
                seed: 1,
            },
        );
        let (_, b) = generate::generate_with_logits(
            &be,
            &model,
            &params,
            &long[3..],
            Sampling {
                max_new_tokens: 2,
                temperature: 0.0,
                top_k: 0,
                seed: 1,
            },
        );
        assert_eq!(a, b);
        // Scoring a known continuation walks the same path: its losses are those logits'.
        let losses = continuation_losses(&be, &model, &params, &prompt, &ids);
        for (i, (l, &t)) in logits.iter().zip(&ids).enumerate() {
            let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + l.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            assert!((losses[i] - (lse - l[t as usize])).abs() < 1e-12);
        }
    }
}

#[test]
fn sampling_is_seeded_and_respects_top_k() {
    let c = cfg(false, false, true, false);
    let be = CpuBackend::default();
    let model = Model::new(&c);
    let params = random_params(&be, &model, 5);
    let a = generate(
        &be,
        &model,
        &params,
        &[1, 2],
        Sampling {
            max_new_tokens: 20,
            temperature: 1.0,
            top_k: 3,
            seed: 42,
        },
    );
    let b = generate(
        &be,
        &model,
        &params,
        &[1, 2],
        Sampling {
            max_new_tokens: 20,
            temperature: 1.0,
            top_k: 3,
            seed: 42,
        },
    );
    assert_eq!(a, b);
    assert!(a.iter().all(|&t| (t as usize) < c.vocab_size));
    // top_k = 1 is greedy whatever the temperature.
    let g = generate(
        &be,
        &model,
        &params,
        &[1, 2],
        Sampling {
            max_new_tokens: 10,
            temperature: 0.0,
            top_k: 0,
            seed: 0,
        },
    );
    assert_eq!(
        generate(
            &be,
            &model,
            &params,
            &[1, 2],
            Sampling {
                max_new_tokens: 10,
                temperature: 2.0,
                top_k: 1,
                seed: 9
            }
        ),
        g
    );
}

#[test]
fn gradients_accumulate_scaled() {
    // Two half-weighted steps add up to one full step (up to the order of additions).
    let c = cfg(true, true, true, false);
    let be = CpuBackend::default();
    let model = Model::new(&c);
    let params = random_params(&be, &model, 3);
    let inputs = tokens(10, c.vocab_size, 1);
    let targets = tokens(10, c.vocab_size, 2);
    let mut ws = Workspace::new(&be, &model, 2, 5, AcMode::Full);
    let mut once = ParamStore::zeros(&be, model.param_specs(), Category::Grads);
    forward_backward(
        &be,
        &model,
        &params,
        &mut once,
        &mut ws,
        Tokens {
            inputs: &inputs,
            targets: &targets,
            doc_starts: None,
        },
        1.0,
    );
    let mut twice = ParamStore::zeros(&be, model.param_specs(), Category::Grads);
    for _ in 0..2 {
        forward_backward(
            &be,
            &model,
            &params,
            &mut twice,
            &mut ws,
            Tokens {
                inputs: &inputs,
                targets: &targets,
                doc_starts: None,
            },
            0.5,
        );
    }
    for (a, b) in once.tensors().iter().zip(twice.tensors()) {
        for (x, y) in be.download(a.view()).iter().zip(be.download(b.view())) {
            assert!((x - y).abs() <= 1e-6 * (1.0 + x.abs()), "{x} vs {y}");
        }
    }
}

/// `tiny`, and `tiny` with a dense first layer (hidden 96) and `shared` shared experts of
/// hidden 40: the SwiGLU FFNs' paths beside the routed experts'.
fn tiny_and_ffn(shared: usize) -> (ModelConfig, ModelConfig) {
    let tiny = preset("tiny").unwrap().model;
    let mut ffn = tiny.clone();
    ffn.dense_layers = 1;
    ffn.dense_hidden = 96;
    ffn.shared_experts = shared;
    ffn.shared_expert_hidden = 40;
    (tiny, ffn)
}

#[test]
fn the_cast_promises_keep_every_bit() {
    // Under bf16 compute the routed experts, the attention projections and the SwiGLU FFNs
    // promise that an operand is unchanged since the last GEMM read it (`Gemm::unchanged`) and
    // the backend skips the cast; ignoring every promise casts each time. A promise on an
    // operand that did change (dU read where dG was cast, say) would give other gradients.
    // tiny, and tiny with a dense first layer and shared experts (the SwiGLU FFN's promises).
    let (tiny, ffn) = tiny_and_ffn(1);
    for c in [tiny, ffn] {
        for mode in [AcMode::None, AcMode::Full] {
            let (g1, o1) = tiny_grads(&c, &CpuBackend::default(), mode, ComputeDtype::Bf16);
            let be = CpuBackend::default().with_cast_promises(false);
            let (g0, o0) = tiny_grads(&c, &be, mode, ComputeDtype::Bf16);
            assert_eq!(o1.loss, o0.loss);
            assert_eq!(g1, g0, "{mode:?}, {} dense layer(s)", c.dense_layers);
        }
    }
}

#[test]
fn bf16_rows_give_the_gradients_of_f32_rows_cast_in_each_gemm() {
    // Under bf16 compute the rows only bf16-input GEMMs read are made in bf16 where they are
    // written (rounded once); kept in f32, each GEMM rounds them the same way. Every GEMM reads
    // the same values, so every gradient is the same to the bit, with half those rows' bytes.
    // tiny (with and without MoE chunks), and tiny with a dense first layer and two shared
    // experts (the SwiGLU FFNs' rows, read by GEMMs through strided views).
    let (tiny, ffn) = tiny_and_ffn(2);
    for (c, chunk) in [(&tiny, 0), (&tiny, 24), (&ffn, 0)] {
        for mode in [AcMode::None, AcMode::Full] {
            // Both with f32 GEMM outputs, whose rounding changes values (tested below).
            let model = |f32_rows| {
                Model::new(c)
                    .with_compute_dtype(ComputeDtype::Bf16)
                    .with_moe_chunk(chunk)
                    .with_f32_rows(f32_rows)
                    .with_f32_outputs(true)
            };
            let (m, f32_rows) = (model(false), model(true));
            let be = CpuBackend::default();
            let bytes = |m: &Model| Workspace::new(&be, m, 2, 32, mode).bytes();
            assert!(bytes(&m) < bytes(&f32_rows), "the rows are not bf16");
            let (g1, o1) = tiny_grads_of(&m, &be, mode);
            let (g0, o0) = tiny_grads_of(&f32_rows, &be, mode);
            let what = format!("{mode:?}, moe chunk {chunk}, {} dense", c.dense_layers);
            assert_eq!(o1.loss.to_bits(), o0.loss.to_bits(), "{what}");
            assert_eq!(g1, g0, "{what}");
        }
    }
}

#[test]
fn bf16_gemm_outputs_move_the_gradients_by_bf16_rounding_only() {
    // Under bf16 compute the GEMMs whose outputs only element-wise ops read (gate, up, the
    // SwiGLU product's gradient, the experts' outputs, the logits) write bf16, as autocast's
    // GEMMs do: SwiGLU, the combine and the loss read inputs rounded once (relative 2^-9),
    // which moves the gradients by a few of bf16's ulps (measured: 3.8e-3 and 4.1e-3 in L2,
    // where bf16 operands moved them from f32 compute by 3.7e-2 and 6.8e-3), and halves those
    // rows' bytes. That each output is the f32 product rounded once, and that SwiGLU and the combine
    // compute on the widened values, is held bit for bit by the backends' own tests. tiny, and
    // tiny with a dense first layer and two shared experts (the FFNs' outputs, one written
    // through a strided view), both checkpointing modes.
    let (tiny, ffn) = tiny_and_ffn(2);
    let be = CpuBackend::default();
    let dist = rel_l2;
    for c in [&tiny, &ffn] {
        for mode in [AcMode::None, AcMode::Full] {
            let model = |f32_outputs| {
                Model::new(c)
                    .with_compute_dtype(ComputeDtype::Bf16)
                    .with_f32_outputs(f32_outputs)
            };
            let (m, reference) = (model(false), model(true));
            let bytes = |m: &Model| Workspace::new(&be, m, 2, 32, mode).bytes();
            assert!(bytes(&m) < bytes(&reference), "the outputs are not bf16");
            let (g1, o1) = tiny_grads_of(&m, &be, mode);
            let (g0, o0) = tiny_grads_of(&reference, &be, mode);
            let (gf, _) = tiny_grads(c, &be, mode, ComputeDtype::F32);
            let what = format!("{mode:?}, {} dense", c.dense_layers);
            let (rounding, compute) = (dist(&g1, &g0), dist(&g0, &gf));
            println!("{what}: outputs {rounding:.2e}, bf16 compute {compute:.2e}");
            assert!(rounding > 0.0, "{what}: bf16 outputs changed nothing");
            assert!(
                rounding < 1e-2,
                "{what}: {rounding} (bf16 compute: {compute})"
            );
            let dl = (o1.loss - o0.loss).abs() / o0.loss.abs();
            assert!(dl < 1e-3, "{what}: loss {} against {}", o1.loss, o0.loss);
        }
    }
}

/// The distance of gradients `a` from `b` relative to `b`'s size (L2 over every tensor).
fn rel_l2(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut d, mut r) = (0f64, 0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        d += ((x - y) as f64).powi(2);
        r += (*y as f64).powi(2);
    }
    (d / r).sqrt()
}

#[test]
fn a_bf16_router_moves_the_gradients_by_operand_rounding_only() {
    // Under bf16 compute the router's three GEMMs (logits; the input's and the weight's
    // gradients) may take bf16 operands (`training.router_dtype`): the logits move by operand
    // rounding (relative 2^-9), the router's own gradient with them and the rest a little
    // through the routing weights. Under f32 compute the switch changes nothing. tiny (the
    // router in every layer), both checkpointing modes.
    let (tiny, _) = tiny_and_ffn(0);
    let be = CpuBackend::default();
    for mode in [AcMode::None, AcMode::Full] {
        let m = |on| {
            Model::new(&tiny)
                .with_compute_dtype(ComputeDtype::Bf16)
                .with_router_bf16(on)
        };
        let (model, reference) = (m(true), m(false));
        let (g1, o1) = tiny_grads_of(&model, &be, mode);
        let (g0, o0) = tiny_grads_of(&reference, &be, mode);
        let routers: Vec<usize> = (0..g1.len())
            .filter(|&i| model.param_specs()[i].name.ends_with("mlp.gate.weight"))
            .collect();
        assert!(!routers.is_empty());
        for &i in &routers {
            let name = &model.param_specs()[i].name;
            assert_ne!(g1[i], g0[i], "{mode:?}: {name} did not move");
            let d = rel_l2(&g1[i..=i], &g0[i..=i]);
            assert!(d < 2e-2, "{mode:?}: {name} moved by {d}");
        }
        let d = rel_l2(&g1, &g0);
        println!(
            "{mode:?}: gradients {d:.2e}, loss {} against {}",
            o1.loss, o0.loss
        );
        assert!(d > 0.0 && d < 1e-2, "{mode:?}: {d}");
        assert!((o1.loss - o0.loss).abs() < 1e-3 * o0.loss.abs());
        let f32_compute = |on| Model::new(&tiny).with_router_bf16(on);
        let (f1, p1) = tiny_grads_of(&f32_compute(true), &be, mode);
        let (f0, p0) = tiny_grads_of(&f32_compute(false), &be, mode);
        assert_eq!((f1, p1.loss.to_bits()), (f0, p0.loss.to_bits()), "{mode:?}");
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| tiny_f32(AcMode::Full))
    };
    let (g1, o1) = run(1);
    let (g3, o3) = run(3);
    assert_eq!(o1.loss, o3.loss);
    assert_eq!(g1, g3);
}

/// Losses of each step, final gradients, and the device and host activation peaks.
struct OffloadRun {
    losses: Vec<(f64, f64)>,
    grads: Vec<Vec<f32>>,
    device: u64,
    host: u64,
}

/// One training step's outputs and gradients with the first `n_off` block inputs offloaded, on
/// the two-memory backend in checking mode (an unordered access panics). Two steps run, so the
/// second's forward reuses slots and host copies the first's backward fetched from.
fn offload_run(n_off: usize, fault: Option<OffloadFault>) -> OffloadRun {
    use ganymede_config::{BoundaryDtype, ComputeDtype};
    offload_run_at(n_off, fault, (ComputeDtype::F32, BoundaryDtype::Auto))
}

/// [`offload_run`] at a compute dtype and boundary dtype.
fn offload_run_at(
    n_off: usize,
    fault: Option<OffloadFault>,
    (compute, boundary): (
        ganymede_config::ComputeDtype,
        ganymede_config::BoundaryDtype,
    ),
) -> OffloadRun {
    let mut c = cfg(true, true, true, false);
    c.layers = 5;
    let ledger = Arc::new(Ledger::new());
    let opts = ganymede_core::TwoMemoryOptions {
        device_capacity: None,
        checking: true,
    };
    let be = CpuBackend::two_memory(ledger.clone(), opts);
    let model = Model::new(&c)
        .with_compute_dtype(compute)
        .with_boundary_dtype(boundary);
    let params = random_params(&be, &model, 3);
    let mut ws = Workspace::with_offload(&be, &model, 2, c.seq_len, AcMode::Full, n_off);
    assert_eq!(ws.offloaded(), n_off);
    ws.inject_offload_fault(fault);
    let mut grads = ParamStore::zeros(&be, model.param_specs(), Category::Grads);
    let mut losses = vec![];
    for seed in [1, 5] {
        let inputs = tokens(2 * c.seq_len, c.vocab_size, seed);
        let targets = tokens(2 * c.seq_len, c.vocab_size, seed + 1);
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
        losses.push((o.loss, o.aux_loss));
    }
    let g = grads
        .tensors()
        .iter()
        .map(|t| be.download(t.view()))
        .collect();
    let report = ledger.report();
    let act = |d| report.peak(d, Category::Activations);
    OffloadRun {
        losses,
        grads: g,
        device: act(ganymede_core::cpu::two_memory::DEVICE),
        host: act(Device::Host),
    }
}

/// At f32 and bf16 compute, with f32 and bf16 boundaries: the same results whatever is
/// offloaded, and both memories' peaks equal to [`activation_bytes_offloaded`]. The host's
/// share is n_off boundaries of 4 bytes an element, or 2 with bf16 boundaries (bf16 compute's
/// default).
#[test]
fn activation_offload_is_exact_ordered_and_accounted() {
    use ganymede_config::{BoundaryDtype, ComputeDtype};
    let c = {
        let mut c = cfg(true, true, true, false);
        c.layers = 5;
        c
    };
    let mut f32_device = vec![];
    for dtypes in [
        (ComputeDtype::F32, BoundaryDtype::Auto),
        (ComputeDtype::Bf16, BoundaryDtype::F32),
        (ComputeDtype::Bf16, BoundaryDtype::Auto),
    ] {
        let prec = Precision::of(
            &Model::new(&c)
                .with_compute_dtype(dtypes.0)
                .with_boundary_dtype(dtypes.1),
        );
        let base = offload_run_at(0, None, dtypes);
        assert_eq!(
            base.device,
            activation_bytes_offloaded(&c, 2, c.seq_len, 0, prec).0
        );
        for n_off in 1..=c.layers {
            let r = offload_run_at(n_off, None, dtypes);
            let what = format!("{dtypes:?}, {n_off} offloaded");
            assert_eq!(r.losses, base.losses, "losses, {what}");
            assert!(r.grads == base.grads, "gradients differ, {what}");
            let (dev, host) = activation_bytes_offloaded(&c, 2, c.seq_len, n_off, prec);
            assert_eq!((r.device, r.host), (dev, host), "ledger peaks, {what}");
            let size = if prec.bf16_boundaries { 2 } else { 4 };
            let boundary = size * (2 * c.seq_len * c.hidden) as u64;
            assert_eq!(host, n_off as u64 * boundary, "{what}");
            // Kept boundaries plus at most two slots: below the no-offload workspace from 3 on.
            assert_eq!(
                base.device + n_off.min(2) as u64 * boundary,
                dev + host,
                "{what}"
            );
            match dtypes {
                (ComputeDtype::F32, _) => f32_device.push(r.device),
                // Under full checkpointing the one set's bf16 v, q, k and output save what
                // the scratch's four bf16 gradients add, so the device's share is f32's less
                // the bf16 rows' half.
                (_, BoundaryDtype::F32) => assert_eq!(
                    f32_device[n_off - 1] - r.device,
                    2 * bf16_row_elems(&c, 2 * c.seq_len, AcMode::Full),
                    "{what}"
                ),
                // bf16 boundaries: L + 1 − n_off kept and min(n_off, 2) slots at half the
                // bytes, plus the f32 working copy.
                _ => {
                    let nh = (2 * c.seq_len * c.hidden) as u64;
                    let kept = (c.layers + 1 - n_off + n_off.min(2)) as u64;
                    assert_eq!(
                        f32_device[n_off - 1] - r.device,
                        2 * nh * kept - 4 * nh
                            + 2 * bf16_row_elems(&c, 2 * c.seq_len, AcMode::Full),
                        "{what}"
                    );
                }
            }
        }
    }
}

/// The checking mode catches a missing prefetch wait with bf16 boundaries too (the widening
/// cast reads the slot).
#[test]
#[should_panic(expected = "before waiting for the from-host stream's write of it")]
fn a_missing_prefetch_wait_is_caught_with_bf16_boundaries() {
    use ganymede_config::{BoundaryDtype, ComputeDtype};
    let dtypes = (ComputeDtype::F32, BoundaryDtype::Bf16);
    offload_run_at(3, Some(OffloadFault::SkipPrefetchWait), dtypes);
}

#[test]
#[should_panic(expected = "before waiting for the from-host stream's write of it")]
fn a_missing_prefetch_wait_is_caught() {
    offload_run(3, Some(OffloadFault::SkipPrefetchWait));
}

#[test]
#[should_panic(expected = "while the to-host stream's read of it (op 1) may be in flight")]
fn overwriting_a_slot_before_its_offload_is_caught() {
    offload_run(3, Some(OffloadFault::SkipSlotFreeWait));
}

/// The parallel fill draws the same normals as one generator drawing them in turn, bit for bit,
/// across chunk boundaries (so initial weights did not change when it came in).
#[test]
fn parallel_normals_equal_the_sequential_stream() {
    let seed = 0x1234_5678_9abc_def0;
    let n = 3 * (1 << 16) + 12_345;
    let mut rng = Rng::new(seed);
    let want: Vec<f64> = (0..n).map(|_| 0.02 * rng.normal()).collect();
    let mut got = vec![0.0; n];
    fill_normals(&mut got, seed, 0.02);
    let first_diff = want
        .iter()
        .zip(&got)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    assert_eq!(first_diff, None);
    // One draw off is another stream.
    let mut off = vec![0.0; 8];
    fill_normals(&mut off, seed.wrapping_add(0x9E37_79B9_7F4A_7C15), 0.02);
    assert_ne!(off[..], want[..8]);
}
