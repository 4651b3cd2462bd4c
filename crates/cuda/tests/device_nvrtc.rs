//! NVRTC without a GPU: every kernel file (the model's `sources::SOURCES` and the backend's
//! own) compiles to a CUBIN for sm_90, and a broken file is reported with NVRTC's log. Needs
//! libnvrtc.so.13 on the library path (the `nvidia-cuda-nvrtc` wheel's `nvidia/cu13/lib`); where
//! it is absent the tests say SKIPPED, unless GANYMEDE_REQUIRE_NVRTC=1 (CI) makes that a failure.
#![cfg(feature = "cuda")]

use ganymede_cuda::device::{nvrtc, probe_nvrtc, PLUMBING};

fn nvrtc_here() -> bool {
    match probe_nvrtc() {
        Ok(()) => true,
        Err(e) => {
            assert!(
                std::env::var("GANYMEDE_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "GANYMEDE_REQUIRE_NVRTC=1 but {e}"
            );
            eprintln!("SKIPPED: {e}");
            false
        }
    }
}

#[test]
fn every_kernel_file_compiles_for_sm_90() {
    if !nvrtc_here() {
        return;
    }
    let mut files: Vec<(&str, &str)> = ganymede_cuda::sources::SOURCES.to_vec();
    files.push(PLUMBING);
    for (file, src) in files {
        let c = nvrtc::compile(file, src, "sm_90").unwrap_or_else(|e| panic!("{e}\n{}", e.log));
        // An ELF image, not PTX text.
        assert!(c.cubin.starts_with(b"\x7fELF"), "{file}: not a CUBIN");
    }
}

#[test]
fn a_broken_file_names_itself_and_the_error() {
    if !nvrtc_here() {
        return;
    }
    let src = "extern \"C\" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n";
    let e = nvrtc::compile("broken.cu", src, "sm_90")
        .err()
        .expect("it compiled");
    let line = e.to_string();
    assert!(
        line.contains("broken.cu") && line.contains("sm_90"),
        "{line}"
    );
    assert!(e.log.contains("undefined_name"), "{}", e.log);
}

#[test]
fn compiling_twice_in_a_process_reuses_the_first() {
    if !nvrtc_here() {
        return;
    }
    let a = nvrtc::compile_all_once(&[PLUMBING], "sm_90");
    let b = nvrtc::compile_all_once(&[PLUMBING], "sm_90");
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert!(a.as_ref().as_ref().is_ok());
}

/// Kernels may include the CUDA headers where they are found (a wheel's `nvidia/cu13/include`
/// beside its `lib` on LD_LIBRARY_PATH, or GANYMEDE_CUDA_INCLUDE).
#[test]
fn cuda_headers_are_found_beside_the_libraries() {
    if !nvrtc_here() {
        return;
    }
    if nvrtc::include_dirs().is_empty() {
        eprintln!("SKIPPED: no CUDA headers beside the libraries on LD_LIBRARY_PATH");
        return;
    }
    let src = "#include <cuda_bf16.h>\n\
               extern \"C\" __global__ void k(__nv_bfloat16* x) { x[0] = __float2bfloat16_rn(1.0f); }\n";
    nvrtc::compile("bf16_header.cu", src, "sm_90").unwrap_or_else(|e| panic!("{e}\n{}", e.log));
}
