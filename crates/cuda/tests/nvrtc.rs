//! Every kernel file compiled by NVRTC for sm_90, as the device side compiles them at run time.
//! Needs only the NVRTC library (CI installs the nvidia-cuda-nvrtc wheel and points
//! LD_LIBRARY_PATH at it); without it the test prints SKIPPED, unless
//! GANYMEDE_REQUIRE_NVRTC=1, when it fails.

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use ganymede_cuda::sources::{KERNELS, NVRTC_OPTIONS, SOURCES};

fn nvrtc_present() -> bool {
    // cudarc panics on first use when the library is missing; probe first.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !present {
        if std::env::var("GANYMEDE_REQUIRE_NVRTC").as_deref() == Ok("1") {
            panic!(
                "GANYMEDE_REQUIRE_NVRTC=1 but no NVRTC library could be loaded (LD_LIBRARY_PATH?)"
            );
        }
        println!("SKIPPED: no NVRTC library (install nvidia-cuda-nvrtc, set LD_LIBRARY_PATH)");
    }
    present
}

#[test]
fn every_kernel_compiles_for_sm_90() {
    if !nvrtc_present() {
        return;
    }
    let (mut major, mut minor) = (0, 0);
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    println!("NVRTC {major}.{minor}");
    for (file, src) in SOURCES {
        let opts = CompileOptions {
            arch: Some("sm_90"),
            name: Some(file.to_string()),
            options: NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(src, opts).unwrap_or_else(|e| match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                panic!("{file}: NVRTC failed:\n{}", log.to_string_lossy())
            }
            e => panic!("{file}: NVRTC failed: {e:?}"),
        });
        let ptx = ptx.to_src();
        assert!(ptx.contains(".target sm_90"), "{file}: not sm_90 PTX");
        let kernels = KERNELS.iter().find(|(f, _)| f == file).unwrap().1;
        for k in kernels {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{file}: no entry point {k} in the PTX"
            );
        }
        println!(
            "{file}: {} kernels, {} bytes of PTX",
            kernels.len(),
            ptx.len()
        );
    }
}
