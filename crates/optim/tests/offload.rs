//! The offload pipeline (`optimizer.offload`) on the checking two-memory CPU backend: its
//! results equal the on-device optimizer's bitwise, and leaving out any one of its event waits
//! panics naming the access that would race on a GPU.

mod common;
use common::Rng;
use ganymede_config::{OptimizerConfig, OptimizerName};
use ganymede_core::{
    Category, CpuBackend, Device, GradScale, Ledger, Memory, ParamKind, ParamSpec, ParamStore,
    TwoMemoryOptions,
};
use ganymede_optim::{Optimizer, SkipWait};
use std::sync::Arc;

fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("embed", &[10, 6], ParamKind::Embedding),
        ParamSpec::new("wide", &[6, 12], ParamKind::Matrix),
        ParamSpec::new("tall", &[12, 6], ParamKind::Matrix),
        ParamSpec::new("experts", &[3, 8, 6], ParamKind::Experts),
        ParamSpec::new("norm", &[6], ParamKind::Vector),
        ParamSpec::new("bias", &[3], ParamKind::Buffer),
        ParamSpec::new("lm_head", &[10, 6], ParamKind::LmHead),
    ]
}

fn checking() -> CpuBackend {
    let opts = TwoMemoryOptions {
        device_capacity: None,
        checking: true,
    };
    CpuBackend::two_memory(Arc::new(Ledger::new()), opts)
}

fn cfg(name: OptimizerName, offload: bool) -> OptimizerConfig {
    OptimizerConfig {
        name,
        lr: 0.02,
        warmup_steps: 0,
        offload,
        ..Default::default()
    }
}

fn store(be: &CpuBackend, specs: &[ParamSpec], rng: &mut Rng, cat: Category) -> ParamStore {
    let t = specs
        .iter()
        .map(|s| be.upload_f64(&rng.normals(s.numel()), &s.shape, cat))
        .collect();
    ParamStore::from_tensors(specs.to_vec(), t)
}

/// Three steps of `opt` on fixed parameters and gradients; the final parameters and state.
fn three_steps(be: &CpuBackend, opt: &mut Optimizer) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let specs = specs();
    let mut rng = Rng::new(7);
    let mut params = store(be, &specs, &mut rng, Category::Params);
    // A clip coefficient folded into the update in one of the steps, as the trainer passes it.
    for coef in [1.0, 0.43, 1.0] {
        let grads = store(be, &specs, &mut rng, Category::Grads);
        opt.step_scaled(be, &mut params, &grads, 0.02, GradScale::Host(coef));
    }
    opt.synchronize_state(be);
    let p = params.tensors().iter().map(|t| be.download(t.view()));
    let s = opt.state().into_iter().map(|(_, t)| be.download(t.view()));
    (p.collect(), s.collect())
}

#[test]
fn offloaded_state_gives_the_same_bits_and_lives_on_the_host() {
    for name in [OptimizerName::Muon, OptimizerName::Adamw] {
        let be = checking();
        let mut on = Optimizer::new(&be, &cfg(name, true), &specs());
        let r = be.ledger().report();
        // State on the host, two staging slots of the largest state (experts' momentum for
        // Muon, 2·144 floats; AdamW: m and v of the 3x8x6 experts) on the device.
        assert_eq!(
            r.current(Device::Host, Category::Optimizer),
            on.state_bytes()
        );
        assert_eq!(r.current(Device::Gpu(0), Category::Optimizer), 0);
        assert_eq!(
            on.staging_bytes(),
            2 * 4 * 144 * if name == OptimizerName::Muon { 1 } else { 2 }
        );
        let got = three_steps(&be, &mut on);
        let mut off = Optimizer::new(&be, &cfg(name, false), &specs());
        assert_eq!(off.staging_bytes(), 0);
        let want = three_steps(&be, &mut off);
        assert_eq!(got, want, "{name:?}");
        // On the one-memory backend "pinned" memory is ordinary memory and copies complete at
        // once: the same results again.
        let plain = CpuBackend::default();
        let mut on = Optimizer::new(&plain, &cfg(name, true), &specs());
        assert_eq!(three_steps(&plain, &mut on), want, "{name:?}, one memory");
    }
}

/// Each wait of the pipeline is needed: without it the checking mode panics at the access that
/// would read or overwrite data still being copied on a GPU.
#[test]
fn a_missing_wait_in_the_pipeline_is_caught() {
    let cases = [
        (
            SkipWait::Fill,
            "(the compute stream)",
            "from-host stream's write",
        ),
        (
            SkipWait::Drain,
            "to-host stream) reads",
            "compute stream's write",
        ),
        (
            SkipWait::Refill,
            "(the from-host stream) writes",
            "compute stream's write",
        ),
    ];
    for (skip, who, what) in cases {
        let be = checking();
        let mut opt = Optimizer::new(&be, &cfg(OptimizerName::Muon, true), &specs());
        opt.skip_offload_wait(skip);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            three_steps(&be, &mut opt);
        }));
        let e = r.expect_err("a missing wait went unnoticed");
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        assert!(
            msg.contains("two-memory check") && msg.contains(who) && msg.contains(what),
            "{skip:?}: {msg}"
        );
    }
}
