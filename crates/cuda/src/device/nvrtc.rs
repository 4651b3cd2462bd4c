//! CUDA C to device code with NVRTC, once per process and architecture.
//!
//! The output is a CUBIN for the exact architecture (`sm_90` on H100/H200), not PTX: PTX would
//! be JIT-compiled by the driver, which refuses PTX from an NVRTC newer than itself, while a
//! CUBIN only needs a driver of the same CUDA major version.
//!
//! CUBINs are also kept on disk ([`cache_dir`]), so a process that finds its file, source,
//! options, architecture and NVRTC version compiled before loads it instead of compiling
//! (seconds a process: every rank and every run of a job would compile the same code). A cache
//! file is written whole under another name and renamed into place, so ranks writing at once or
//! a process killed mid-write leave a complete file or none; one whose key or checksum does not
//! match is compiled again and replaced.

use cudarc::nvrtc::{result, sys};
use ganymede_core::fnv1a64;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
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

/// The options every file is compiled with: [`crate::sources::NVRTC_OPTIONS`] for `arch`, with
/// the CUDA headers' folders where found (see [`include_dirs`]).
pub fn options(arch: &str) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}")];
    o.extend(crate::sources::NVRTC_OPTIONS.iter().map(|s| s.to_string()));
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

/// Every file of `sources` compiled for `arch` (or loaded from [`cache_dir`]), once per
/// process: later calls (another backend on the same device, a second rank's thread) get the
/// same CUBINs.
pub fn compile_all_once(sources: &[(&str, &str)], arch: &str) -> Cached {
    static CACHE: OnceLock<Mutex<HashMap<String, Cached>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // Held while compiling, so two threads asking at once compile once.
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    let names: Vec<&str> = sources.iter().map(|(f, _)| *f).collect();
    map.entry(format!("{arch}:{}", names.join(",")))
        .or_insert_with(|| {
            let dir = cache_dir();
            Arc::new(
                sources
                    .iter()
                    .map(|(file, src)| compile_cached(file, src, arch, dir.as_deref()).0)
                    .collect(),
            )
        })
        .clone()
}

/// Where compiled kernels are kept between processes: `GANYMEDE_KERNEL_CACHE` (empty or `off`:
/// nowhere), else `$XDG_CACHE_HOME/ganymede/kernels`, else `$HOME/.cache/ganymede/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(v) = std::env::var_os("GANYMEDE_KERNEL_CACHE") {
        return (!v.is_empty() && v != "off").then(|| PathBuf::from(v));
    }
    var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| var("HOME").map(|h| Path::new(&h).join(".cache")))
        .map(|c| c.join("ganymede").join("kernels"))
}

/// Where a compile came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Read from the cache.
    Cache,
    /// Compiled by NVRTC (and written to the cache, where there is one).
    Compiled,
}

/// [`compile`], through the cache in `dir` (none: always compile). A cache that cannot be read
/// or written only costs the compile: the error is NVRTC's alone.
pub fn compile_cached(
    file: &str,
    src: &str,
    arch: &str,
    dir: Option<&Path>,
) -> (Result<Compiled, CompileError>, Origin) {
    let Some(dir) = dir else {
        return (compile(file, src, arch), Origin::Compiled);
    };
    let key = cache_key(file, src, arch);
    let path = dir.join(format!(
        "{}-{:016x}.cubin",
        sanitize(file),
        fnv1a64(key.as_bytes())
    ));
    if let Some(cubin) = std::fs::read(&path)
        .ok()
        .and_then(|b| cache_decode(&b, &key))
    {
        let file = file.to_string();
        return (Ok(Compiled { file, cubin }), Origin::Cache);
    }
    let out = compile(file, src, arch);
    if let Ok(c) = &out {
        // Best effort: a read-only or full disk leaves the compile as it is.
        let _ = std::fs::create_dir_all(dir);
        let _ = write_whole(&path, &cache_encode(&key, &c.cubin));
    }
    (out, Origin::Compiled)
}

/// `bytes` into `path` through a file of its own (process and call), renamed into place: a
/// reader sees a whole file or none. No fsync: a cache file lost in a crash is compiled again,
/// and a damaged one fails its checksum.
fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()));
    let r = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Everything a CUBIN depends on: the file's name and source, the options, the architecture
/// and the NVRTC library's version.
fn cache_key(file: &str, src: &str, arch: &str) -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters; a failure leaves 0.0, which only makes the key stricter.
    let _ = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    format!(
        "{file}\n{arch}\nnvrtc {major}.{minor}\n{}\n{} bytes {:016x}",
        options(arch).join(" "),
        src.len(),
        fnv1a64(src.as_bytes())
    )
}

const CACHE_MAGIC: &[u8] = b"ganymede cubin 1\n";

/// A cache file: magic, the key's length and bytes, the CUBIN's checksum, length and bytes.
fn cache_encode(key: &str, cubin: &[u8]) -> Vec<u8> {
    let mut b = CACHE_MAGIC.to_vec();
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key.as_bytes());
    b.extend(fnv1a64(cubin).to_le_bytes());
    b.extend((cubin.len() as u64).to_le_bytes());
    b.extend(cubin);
    b
}

/// The CUBIN of a cache file written for `key`; `None` for any other key, a truncated or
/// altered file, or one that is not an ELF image.
fn cache_decode(b: &[u8], key: &str) -> Option<Vec<u8>> {
    let rest = b.strip_prefix(CACHE_MAGIC)?;
    let u64_at = |b: &[u8], i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?))
    };
    let klen = usize::try_from(u64_at(rest, 0)?).ok()?;
    let k = rest.get(8..8usize.checked_add(klen)?)?;
    if k != key.as_bytes() {
        return None;
    }
    let rest = &rest[8 + klen..];
    let (sum, len) = (u64_at(rest, 0)?, usize::try_from(u64_at(rest, 8)?).ok()?);
    let cubin = rest.get(16..)?;
    (cubin.len() == len && fnv1a64(cubin) == sum && cubin.starts_with(b"\x7fELF"))
        .then(|| cubin.to_vec())
}

/// A file name's characters outside `[A-Za-z0-9._-]` as `_`.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
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

    use super::{cache_decode, cache_encode, compile_cached, Origin};
    use std::path::PathBuf;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ganymede-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_cache_file_gives_back_its_cubin_for_its_key_only() {
        let cubin = b"\x7fELF and some machine code".to_vec();
        let f = cache_encode("key one", &cubin);
        assert_eq!(cache_decode(&f, "key one"), Some(cubin.clone()));
        assert_eq!(cache_decode(&f, "key two"), None, "another key");
        assert_eq!(cache_decode(&f, "key on"), None, "a prefix of the key");
        for cut in [0, 10, f.len() / 2, f.len() - 1] {
            assert_eq!(cache_decode(&f[..cut], "key one"), None, "cut at {cut}");
        }
        let mut longer = f.clone();
        longer.push(0);
        assert_eq!(cache_decode(&longer, "key one"), None, "a byte too many");
        let mut flipped = f.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert_eq!(cache_decode(&flipped, "key one"), None, "a changed byte");
        let not_elf = cache_encode("k", b"PTX text");
        assert_eq!(cache_decode(&not_elf, "k"), None, "not an ELF image");
    }

    /// A second compile of the same source reads the cache, byte for byte; a changed source
    /// misses; a damaged file is compiled again and replaced; no temporary file is left.
    #[test]
    fn a_second_compile_is_read_from_the_disk_cache() {
        // SAFETY: a probe for the library; cudarc panics on first use without one.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            assert_ne!(
                std::env::var("GANYMEDE_REQUIRE_NVRTC").as_deref(),
                Ok("1"),
                "GANYMEDE_REQUIRE_NVRTC=1 but no NVRTC library"
            );
            println!("SKIPPED: no NVRTC library");
            return;
        }
        let dir = temp_dir("kernel-cache");
        let src = "extern \"C\" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n";
        let (first, o1) = compile_cached("t.cu", src, "sm_90", Some(&dir));
        let first = first.expect("compiles").cubin;
        assert_eq!(o1, Origin::Compiled);
        let (second, o2) = compile_cached("t.cu", src, "sm_90", Some(&dir));
        assert_eq!(o2, Origin::Cache);
        assert_eq!(second.unwrap().cubin, first);
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "{files:?}");
        // Another source, another architecture: misses, each its own file.
        let other = src.replace("2.0f", "3.0f");
        assert_eq!(
            compile_cached("t.cu", &other, "sm_90", Some(&dir)).1,
            Origin::Compiled
        );
        assert_eq!(
            compile_cached("t.cu", src, "sm_80", Some(&dir)).1,
            Origin::Compiled
        );
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 3);
        // A damaged file: compiled again, and the next call reads the rewritten one.
        let mut bytes = std::fs::read(&files[0]).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x55;
        std::fs::write(&files[0], &bytes).unwrap();
        let (again, o3) = compile_cached("t.cu", src, "sm_90", Some(&dir));
        assert_eq!(o3, Origin::Compiled);
        assert_eq!(again.unwrap().cubin, first);
        assert_eq!(
            compile_cached("t.cu", src, "sm_90", Some(&dir)).1,
            Origin::Cache
        );
        // A compile error is NVRTC's, and nothing is cached for it.
        let (bad, o4) = compile_cached("bad.cu", "this is not C++", "sm_90", Some(&dir));
        assert!(bad.is_err());
        assert_eq!(o4, Origin::Compiled);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
