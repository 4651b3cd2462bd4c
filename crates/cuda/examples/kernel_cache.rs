//! What the disk cache of compiled kernels saves a process: every kernel file (and the
//! backend's own) compiled by NVRTC for sm_90 into an empty cache folder, then read back from
//! it, as the second process of a job would (the in-process cache is bypassed: each file goes
//! through `compile_cached`). Needs only the NVRTC library (`LD_LIBRARY_PATH`).
//!
//! `cargo run --release -p ganymede-cuda --features cuda --example kernel_cache`

use ganymede_cuda::device::nvrtc::{compile_cached, Origin};
use std::time::Instant;

fn main() {
    // SAFETY: a probe for the library; cudarc panics on first use without one.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!(
            "no NVRTC library: put the nvidia-cuda-nvrtc wheel's lib folder on LD_LIBRARY_PATH"
        );
        std::process::exit(1);
    }
    let dir = std::env::temp_dir().join(format!("ganymede-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut files: Vec<(&str, &str)> = ganymede_cuda::sources::SOURCES.to_vec();
    files.push(ganymede_cuda::device::PLUMBING);
    for pass in ["compiled (empty cache)", "read from the cache"] {
        let t = Instant::now();
        let mut bytes = 0;
        for (file, src) in &files {
            let (c, origin) = compile_cached(file, src, "sm_90", Some(&dir));
            let c = c.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                origin == Origin::Cache,
                pass.starts_with("read"),
                "{file}: {origin:?}"
            );
            bytes += c.cubin.len();
        }
        println!(
            "{} files, {bytes} bytes of CUBIN, {pass}: {:.3} s",
            files.len(),
            t.elapsed().as_secs_f64()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
