//! Document masking (`data.document_mask`): a window holding several documents gives the loss
//! and every parameter gradient that scoring each document alone gives, weighted by its tokens.

use super::*;

/// (loss, gradients) of the documents `docs` (each `(inputs, targets)`) packed `rows` to a
/// window (each row's documents filling it), with their document starts; or, `masked` false,
/// the same windows without them.
fn packed(
    model: &Model,
    params: &ParamStore,
    rows: &[&[(Vec<u32>, Vec<u32>)]],
    masked: bool,
    mode: AcMode,
) -> (f64, Vec<Vec<f32>>) {
    let be = CpuBackend::default();
    let seq: usize = rows[0].iter().map(|d| d.0.len()).sum();
    let (mut x, mut y, mut starts) = (vec![], vec![], vec![]);
    for row in rows {
        let mut at = 0u32;
        for (i, t) in row.iter() {
            x.extend(i);
            y.extend(t);
            starts.extend(std::iter::repeat_n(at, i.len()));
            at += i.len() as u32;
        }
        assert_eq!(at as usize, seq, "rows of one window length");
    }
    let mut ws = Workspace::new(&be, model, rows.len(), seq, mode);
    let mut grads = ParamStore::zeros(&be, model.param_specs(), Category::Grads);
    let t = Tokens {
        inputs: &x,
        targets: &y,
        doc_starts: masked.then_some(&starts[..]),
    };
    let out = forward_backward(&be, model, params, &mut grads, &mut ws, t, 1.0);
    // A forward alone agrees with the step's.
    let eval = forward_loss(&be, model, params, &mut ws, t).loss;
    assert!(
        (eval - out.loss).abs() <= 1e-6 * out.loss.abs(),
        "{eval} vs {}",
        out.loss
    );
    (out.loss, download(&be, &grads))
}

fn download(be: &CpuBackend, g: &ParamStore) -> Vec<Vec<f32>> {
    g.tensors().iter().map(|t| be.download(t.view())).collect()
}

#[test]
fn a_window_of_documents_trains_as_the_documents_alone() {
    // A dense and a MoE layer with shared experts; no auxiliary loss, whose batch statistics
    // tie the tokens of a batch together whatever the attention.
    let c = ModelConfig {
        aux_loss_coef: 0.0,
        ..cfg(true, true, true, false)
    };
    let model = Model::new(&c);
    let be = CpuBackend::default();
    let params = random_params(&be, &model, 21);
    let doc = |n: usize, seed: u64| {
        (
            tokens(n, c.vocab_size, seed),
            tokens(n, c.vocab_size, seed + 100),
        )
    };
    let (r0, r1) = ([doc(5, 1), doc(7, 2)], [doc(3, 3), doc(9, 4)]);
    let total: usize = r0.iter().chain(&r1).map(|d| d.0.len()).sum();
    // Each document alone, its loss and gradients weighted by its share of the tokens.
    let (mut loss, mut want) = (0.0, None::<Vec<Vec<f32>>>);
    for d in r0.iter().chain(&r1) {
        let w = d.0.len() as f64 / total as f64;
        let (l, g) = packed(
            &model,
            &params,
            &[std::slice::from_ref(d)],
            false,
            AcMode::None,
        );
        loss += w * l;
        let g: Vec<Vec<f32>> = g
            .iter()
            .map(|t| t.iter().map(|&x| x * w as f32).collect())
            .collect();
        want = Some(match want {
            None => g,
            Some(a) => a
                .iter()
                .zip(&g)
                .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x + y).collect())
                .collect(),
        });
    }
    let want = want.unwrap();
    for mode in [AcMode::None, AcMode::Full] {
        let (l, g) = packed(&model, &params, &[&r0, &r1], true, mode);
        let (dl, dg) = ((l - loss).abs() / loss, max_rel(&g, &want));
        eprintln!("{mode:?}: loss {l} vs {loss} (relative {dl:.1e}), gradients {dg:.1e}");
        assert!(
            dl <= 1e-6 && dg <= 1e-6,
            "{mode:?}: loss {dl:.2e}, grads {dg:.2e}"
        );
    }
    // Unmasked, the second documents see the first and start at later positions: the
    // comparison can fail.
    let (l, g) = packed(&model, &params, &[&r0, &r1], false, AcMode::None);
    assert!((l - loss).abs() / loss > 1e-4 && max_rel(&g, &want) > 1e-3);
}

#[test]
#[should_panic(expected = "after itself")]
fn a_document_start_after_its_token_is_refused() {
    let c = cfg(true, false, false, false);
    let model = Model::new(&c);
    let be = CpuBackend::default();
    let params = model.init_params(&be, 1);
    let x = tokens(4, c.vocab_size, 1);
    let mut ws = Workspace::new(&be, &model, 1, 4, AcMode::None);
    let t = Tokens {
        inputs: &x,
        targets: &x,
        doc_starts: Some(&[0, 0, 3, 3]),
    };
    forward_loss(&be, &model, &params, &mut ws, t);
}
