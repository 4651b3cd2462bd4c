//! CUDA C to device code with NVRTC, once per process and architecture.
//!
//! The output is a CUBIN for the exact architecture (`sm_90` on H100/H200), not PTX: PTX would
//! be JIT-compiled by the driver, which refuses PTX from an NVRTC newer than itself, while a
//! CUBIN only needs a driver of the same CUDA major version.

use cudarc::nvrtc::{result, sys};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// One source file compiled for one architecture.
pub struct Compiled {
    pub file: String,
    pub cubin: Vec<u8>,
}

/// A file that did not compile: NVRTC's log names the line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompileError {
    pub file: String,
    pub arch: String,
    pub log: String,
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The log's first line is the first error; the whole log is in `log`.
        let first = self.log.lines().find(|l| !l.trim().is_empty());
        write!(
            f,
            "NVRTC could not compile {} for {}: {}",
            self.file,
            self.arch,
            first.unwrap_or("(no log)")
        )
    }
}

impl std::error::Error for CompileError {}

/// The options every file is compiled with. Precise division and square roots and no flushing
/// of denormals, so device results can be held against the CPU backend's; the CUDA headers'
/// folders where found (see [`include_dirs`]).
pub fn options(arch: &str) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--fmad=true".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--ftz=false".into(),
    ];
    o.extend(
        include_dirs()
            .into_iter()
            .map(|d| format!("--include-path={d}")),
    );
    o
}

/// Folders with the CUDA headers (`cuda_bf16.h`, …), which NVRTC does not carry: those in
/// `GANYMEDE_CUDA_INCLUDE` (colon-separated), else the `include` folder beside each library
/// folder on `LD_LIBRARY_PATH` that has them (a wheel's `nvidia/cu13/{lib,include}`).
pub fn include_dirs() -> Vec<String> {
    if let Ok(v) = std::env::var("GANYMEDE_CUDA_INCLUDE") {
        return v
            .split(':')
            .filter(|d| !d.is_empty())
            .map(String::from)
            .collect();
    }
    let lib_path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let mut dirs: Vec<String> = Vec::new();
    for lib in lib_path.split(':').filter(|d| !d.is_empty()) {
        let inc = std::path::Path::new(lib).join("../include");
        if inc.join("cuda_bf16.h").is_file() {
            let d = inc.to_string_lossy().into_owned();
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
    }
    dirs
}

/// Compile one file for `arch` (e.g. `sm_90`).
pub fn compile(file: &str, src: &str, arch: &str) -> Result<Compiled, CompileError> {
    let fail = |log: String| CompileError {
        file: file.to_string(),
        arch: arch.to_string(),
        log,
    };
    let csrc = CString::new(src).map_err(|_| fail("a NUL byte in the source".into()))?;
    let cname = CString::new(file).map_err(|_| fail("a NUL byte in the file name".into()))?;
    let prog = result::create_program(&csrc, Some(&cname)).map_err(|e| fail(format!("{e:?}")))?;
    // SAFETY: `prog` was created above and is destroyed once, at the end.
    let out = unsafe {
        let compiled = result::compile_program(prog, &options(arch));
        let log = result::get_program_log(prog)
            .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
            .unwrap_or_default();
        match compiled {
            Err(e) => Err(fail(if log.is_empty() {
                format!("{e:?}")
            } else {
                log
            })),
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| {
                        fail(format!("no CUBIN ({e:?}); is {arch} a real architecture?"))
                    })?;
                let mut cubin = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _)
                    .result()
                    .map_err(|e| fail(format!("{e:?}")))?;
                Ok(Compiled {
                    file: file.to_string(),
                    cubin,
                })
            }
        }
    };
    // SAFETY: created above, not destroyed before.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

type Cached = Arc<Result<Vec<Compiled>, CompileError>>;

/// Every file of `sources` compiled for `arch`, once per process: later calls (another backend
/// on the same device, a second rank's thread) get the same CUBINs.
pub fn compile_all_once(sources: &[(&str, &str)], arch: &str) -> Cached {
    static CACHE: OnceLock<Mutex<HashMap<String, Cached>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // Held while compiling, so two threads asking at once compile once.
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    let names: Vec<&str> = sources.iter().map(|(f, _)| *f).collect();
    map.entry(format!("{arch}:{}", names.join(",")))
        .or_insert_with(|| {
            Arc::new(
                sources
                    .iter()
                    .map(|(file, src)| compile(file, src, arch))
                    .collect(),
            )
        })
        .clone()
}

/// Names of the `extern "C" __global__` kernels a source defines, in order: what the device
/// check looks up after loading, so a kernel that compiled but is not found by name shows.
pub fn kernel_names(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find("__global__") {
        rest = &rest[i + "__global__".len()..];
        // The name is the last word before the parameter list's `(`; `__launch_bounds__(…)`
        // has a parenthesis of its own, skipped.
        let mut from = 0;
        let paren = loop {
            let Some(p) = rest[from..].find('(') else {
                return names;
            };
            let paren = from + p;
            if rest[..paren].split_whitespace().last() == Some("__launch_bounds__") {
                let Some(close) = rest[paren..].find(')') else {
                    return names;
                };
                from = paren + close + 1;
                continue;
            }
            break paren;
        };
        if let Some(name) = rest[..paren].split_whitespace().last() {
            if name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                names.push(name.to_string());
            }
        }
        rest = &rest[paren..];
    }
    names
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_names_are_found_in_order() {
        let src = "__device__ float f(float x) { return x; }\n\
                   extern \"C\" __global__ void a_kernel(float* x) {}\n\
                   extern \"C\" __global__ void __launch_bounds__(256) b2(int n) {}\n\
                   extern \"C\" __global__\nvoid\nc_3 (float* y) {}\n";
        assert_eq!(super::kernel_names(src), ["a_kernel", "b2", "c_3"]);
        let plumbing = super::kernel_names(crate::device::PLUMBING.1);
        assert!(plumbing.contains(&"ganymede_cast_f32_to_bf16".to_string()));
        assert!(!plumbing.iter().any(|n| n == "ganymede_block_add"));
    }
}
