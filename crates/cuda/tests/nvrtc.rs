//! Every kernel file compiled by NVRTC for sm_90, as the device side compiles them at run time,
//! down to machine code (a real architecture makes NVRTC run ptxas too, so limits such as 48 KiB
//! of static shared memory per block are checked, not only the C++). Needs only the NVRTC
//! library (CI installs the nvidia-cuda-nvrtc wheel and points LD_LIBRARY_PATH at it); without
//! it the test prints SKIPPED, unless GANYMEDE_REQUIRE_NVRTC=1, when it fails.

use cudarc::nvrtc::{result, sys};
use ganymede_cuda::sources::{KERNELS, NVRTC_OPTIONS, SOURCES};
use std::ffi::CString;

fn nvrtc_present() -> bool {
    // cudarc panics on first use when the library is missing; probe first.
    let present = unsafe { sys::is_culib_present() };
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

fn text(v: Vec<std::ffi::c_char>) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles one source for sm_90: (PTX, CUBIN size, log), or the log of a failure.
fn compile(file: &str, src: &str) -> Result<(String, usize, String), String> {
    let src = CString::new(src).unwrap();
    let name = CString::new(file).unwrap();
    let prog = result::create_program(&src, Some(&name)).map_err(|e| format!("{e:?}"))?;
    let mut opts = vec![
        "--gpu-architecture=sm_90".to_string(),
        "--ptxas-options=-v".into(),
    ];
    opts.extend(NVRTC_OPTIONS.iter().map(|s| s.to_string()));
    // Safety: prog is live until destroyed below; the sizes come from NVRTC.
    unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = text(result::get_program_log(prog).unwrap());
        let out = match compiled {
            Err(e) => Err(format!("{e:?}\n{log}")),
            Ok(()) => {
                let ptx = text(result::get_ptx(prog).unwrap());
                let mut cubin = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut cubin).result().unwrap();
                Ok((ptx, cubin, log))
            }
        };
        result::destroy_program(prog).unwrap();
        out
    }
}

#[test]
fn every_kernel_compiles_for_sm_90() {
    if !nvrtc_present() {
        return;
    }
    let (mut major, mut minor) = (0, 0);
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    println!("NVRTC {major}.{minor}");
    for (file, src) in SOURCES {
        let (ptx, cubin, log) =
            compile(file, src).unwrap_or_else(|e| panic!("{file}: NVRTC failed:\n{e}"));
        assert!(ptx.contains(".target sm_90"), "{file}: not sm_90 PTX");
        assert!(cubin > 0, "{file}: no machine code");
        let kernels = KERNELS.iter().find(|(f, _)| f == file).unwrap().1;
        for k in kernels {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{file}: no entry point {k} in the PTX"
            );
        }
        if *file == "attention.cu" {
            // The fused backward's paired atomic adds take sm_90's vector reduction.
            assert!(
                ptx.contains("red.global.add.v2.f32"),
                "{file}: no vector reduction"
            );
        }
        // The memory-bound kernels move 4 elements per access where their arrays are aligned
        // (`ew_loop`, `row_loop` in common.cuh): a vector load or store in each one's code.
        for k in kernels.iter().filter(|k| moves_four_at_a_time(file, k)) {
            // The multi-tensor kernels read their tensors' addresses from a table, which the
            // compiler cannot prove global: generic 16-byte accesses there.
            let wide = match k.contains("_multi_") {
                true => ".v4.f32",
                false => ".global.v4.",
            };
            assert!(
                entry_body(&ptx, k).contains(wide),
                "{file}: {k} has no 4-wide global access"
            );
        }
        println!(
            "{file}: {} kernels, {} bytes of PTX, {cubin} bytes of sm_90 code",
            kernels.len(),
            ptx.len()
        );
        // ptxas's resources per kernel (registers, shared memory), for the record.
        let mut entry = "";
        for line in log.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                entry = rest.split('\'').next().unwrap_or("");
            } else if let Some(used) = line.split("info    : ").nth(1) {
                if used.starts_with("Used") {
                    println!("  {entry}: {used}");
                }
            }
        }
    }
}

/// The kernels written with 4-wide accesses: every elementwise and optimizer kernel but the
/// partial sums' total, the MoE gathers and combines, RMSNorm's row passes and the
/// cross-entropy's.
fn moves_four_at_a_time(file: &str, kernel: &str) -> bool {
    match file {
        // The scalar kernels: sums of partials, and the step's one-thread scale.
        "elementwise.cu" | "optim.cu" => !matches!(
            kernel,
            "sum_acc_f64" | "sum_rows_f64" | "sum_acc_multi_f64" | "step_scale_f64"
        ),
        "dispatch.cu" => kernel.starts_with("moe_"),
        "norm.cu" => {
            kernel.starts_with("rmsnorm_forward") || kernel.starts_with("rmsnorm_backward_dx")
        }
        "loss.cu" => !kernel.starts_with("cross_entropy_loss_acc"),
        _ => false,
    }
}

/// The PTX of entry `name`, up to the next entry.
fn entry_body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("no entry {name}"));
    let rest = &ptx[start + 1..];
    &rest[..rest.find(".entry ").unwrap_or(rest.len())]
}

#[test]
fn a_kernel_that_does_not_compile_fails() {
    if !nvrtc_present() {
        return;
    }
    let (file, src) = SOURCES[0];
    let broken = format!("{src}\nextern \"C\" __global__ void broken(float* x) {{ x[0] = ; }}\n");
    let err = compile(file, &broken).expect_err("a syntax error compiled");
    assert!(err.contains("error"), "{err}");
}
