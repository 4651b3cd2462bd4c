//! The backend's constructor on this machine: with a GPU it comes up with its kernels loaded;
//! without one it returns the probe's one-line error (naming what is missing), never a panic.
#![cfg(feature = "cuda")]

use ganymede_core::{Ledger, Memory};
use ganymede_cuda::device::{probe, CudaBackend, DeviceError};
use std::sync::Arc;

#[test]
fn backend_comes_up_or_says_why_in_one_line() {
    let r = std::panic::catch_unwind(|| CudaBackend::new(0, Arc::new(Ledger::new())))
        .expect("setting up the backend panicked");
    match (probe(), r) {
        (Ok(_), Ok(be)) => {
            assert!(be.arch().starts_with("sm_"), "{}", be.arch());
            assert!(be.function("ganymede_cast_f32_to_bf16").is_ok());
            assert!(be.function("no_such_kernel").is_err());
            be.synchronize();
        }
        (Err(p), Err(DeviceError::Probe(e))) => {
            assert_eq!(p, e);
            let line = e.to_string();
            assert!(
                !line.contains('\n') && (line.contains("CUDA") || line.contains("GPU")),
                "{line}"
            );
        }
        (p, r) => panic!("probe {p:?} but the backend {:?}", r.err()),
    }
}
