//! Finding NCCL's shared library so that cudarc can load it.
//!
//! cudarc (0.19.10, `dynamic-loading`) opens NCCL by bare names only (`libnccl.so`,
//! `libnccl.so.13`, `.12`, ..., `.1`), so the dynamic loader's search path decides; but the pip
//! wheel `nvidia-nccl-cu13` ships only `libnccl.so.2`, and a venv's folder is rarely on that
//! path. The loader reads `LD_LIBRARY_PATH` once, at process start, so the fix is: search the
//! usual places for `libnccl.so` / `libnccl.so.2`, link the file found as `libnccl.so` in a
//! private folder, and start this program again with that folder first on `LD_LIBRARY_PATH`
//! (`prepare`, with the `nccl` feature, before MPI or any thread starts). When nothing is
//! found, the error is one line naming every folder searched.
//!
//! The search and the decision are pure functions of the environment and the file system, tested
//! with a temporary folder of fake files; only `prepare` touches the process.

use std::path::{Path, PathBuf};

/// The file names looked for in each folder, preferred first.
pub const NAMES: [&str; 2] = ["libnccl.so", "libnccl.so.2"];

/// Set on the restarted process: the private folder it was given, so it never restarts twice.
pub const RELINKED_VAR: &str = "GANYMEDE_NCCL_RELINKED";

/// A library file found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub path: PathBuf,
    /// Whether cudarc opens it by name as it is (`libnccl.so` in a folder on `LD_LIBRARY_PATH`).
    pub loadable_by_name: bool,
}

/// No NCCL library in any folder searched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Missing {
    pub searched: Vec<PathBuf>,
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dirs: Vec<String> = self
            .searched
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        write!(
            f,
            "NCCL not found: no {} in {} (LD_LIBRARY_PATH, $NCCL_HOME, $CUDA_HOME, the active venv's \
             nvidia/nccl/lib and the system folders); install it (`pip install nvidia-nccl-cu13`) \
             and put its lib folder on LD_LIBRARY_PATH",
            NAMES.join(" or "),
            if dirs.is_empty() {
                "no folder".to_string()
            } else {
                dirs.join(", ")
            }
        )
    }
}

impl std::error::Error for Missing {}

/// The folders to search, in order: `LD_LIBRARY_PATH`, `$NCCL_HOME/lib`, `$CUDA_HOME/lib64`,
/// the active venv's and ganymede's own venvs' `nvidia/nccl/lib`, then the system's folders.
/// `get` reads a variable (the environment, or a test's map); duplicates are dropped.
pub fn search_dirs(get: impl Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(p) = get("LD_LIBRARY_PATH") {
        dirs.extend(p.split(':').filter(|s| !s.is_empty()).map(PathBuf::from));
    }
    if let Some(h) = get("NCCL_HOME") {
        dirs.push(Path::new(&h).join("lib"));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = get(var) {
            dirs.push(Path::new(&h).join("lib64"));
        }
    }
    let mut venvs: Vec<PathBuf> = get("VIRTUAL_ENV").map(PathBuf::from).into_iter().collect();
    if let Some(home) = get("HOME") {
        for v in ["venv", "nvrtc-venv"] {
            venvs.push(Path::new(&home).join(".cache/ganymede").join(v));
        }
    }
    for v in venvs {
        // <venv>/lib/python3.X/site-packages/nvidia/nccl/lib, whatever the Python version.
        let mut pys: Vec<PathBuf> = std::fs::read_dir(v.join("lib"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("python"))
            })
            .collect();
        pys.sort();
        dirs.extend(
            pys.into_iter()
                .map(|p| p.join("site-packages/nvidia/nccl/lib")),
        );
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/nccl/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}

/// The first folder of `dirs` holding one of [`NAMES`] (`libnccl.so` preferred within a folder).
/// `on_ld_path` is the `LD_LIBRARY_PATH` part, for [`Found::loadable_by_name`].
pub fn find(dirs: &[PathBuf], on_ld_path: &[PathBuf]) -> Result<Found, Missing> {
    for d in dirs {
        for name in NAMES {
            let p = d.join(name);
            if p.is_file() {
                return Ok(Found {
                    loadable_by_name: name == NAMES[0] && on_ld_path.contains(d),
                    path: p,
                });
            }
        }
    }
    Err(Missing {
        searched: dirs.to_vec(),
    })
}

/// What to do at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// cudarc will find NCCL by itself.
    AsIs,
    /// Link `target` as `link_dir/libnccl.so` and restart with `link_dir` first on
    /// `LD_LIBRARY_PATH`.
    Relink { target: PathBuf, link_dir: PathBuf },
    /// NCCL cannot be loaded: the one-line reason, reported only if NCCL is needed.
    Unavailable(String),
}

/// The private folder for a library file: one per target, so the ranks on a node share it.
pub fn link_dir(base: &Path, target: &Path) -> PathBuf {
    let h = crate::fnv1a64(target.as_os_str().as_encoded_bytes());
    base.join(format!("ganymede-nccl-{h:016x}"))
}

/// Decide from whether cudarc already opens NCCL, what the search found and whether this is the
/// restarted process (`relinked`: the folder it was given).
pub fn decide(
    cudarc_finds: bool,
    found: Result<Found, Missing>,
    relinked: Option<&str>,
    tmp: &Path,
) -> Decision {
    if cudarc_finds {
        return Decision::AsIs;
    }
    match found {
        Err(m) => Decision::Unavailable(m.to_string()),
        Ok(f) if relinked.is_some() || f.loadable_by_name => Decision::Unavailable(format!(
            "NCCL found at {} but it does not load (a missing dependency, or a library for \
             another CUDA or CPU architecture)",
            f.path.display()
        )),
        Ok(f) => Decision::Relink {
            link_dir: link_dir(tmp, &f.path),
            target: f.path,
        },
    }
}

/// Why NCCL is unavailable in this process, set by [`prepare`] (`None`: not asked, or fine).
#[cfg(feature = "nccl")]
static UNAVAILABLE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// At start-up, before MPI or any thread starts: make NCCL loadable by cudarc, restarting this
/// program if its library needs a link (see the module doc). Returns normally when NCCL is
/// loadable or when it is not (then [`check`] gives the reason); only returns after a restart
/// that failed to happen.
#[cfg(feature = "nccl")]
pub fn prepare() {
    // SAFETY: loading NCCL runs only its own initialisers; cudarc would load it on first use.
    let cudarc_finds = unsafe { cudarc::nccl::sys::is_culib_present() };
    let get = |k: &str| std::env::var(k).ok();
    let ld: Vec<PathBuf> = search_dirs(|k| (k == "LD_LIBRARY_PATH").then(|| get(k)).flatten());
    let dirs = search_dirs(get);
    let relinked = get(RELINKED_VAR);
    let d = if cudarc_finds {
        Decision::AsIs
    } else {
        decide(
            false,
            find(&dirs, &ld),
            relinked.as_deref(),
            &std::env::temp_dir(),
        )
    };
    let why = match d {
        Decision::AsIs => None,
        Decision::Unavailable(why) => Some(why),
        Decision::Relink { target, link_dir } => Some(relink_and_restart(&target, &link_dir)),
    };
    let _ = UNAVAILABLE.set(why);
}

/// Link `target` as `link_dir/libnccl.so` and exec this program again with `link_dir` first on
/// `LD_LIBRARY_PATH`; returns the reason only if that failed.
#[cfg(feature = "nccl")]
fn relink_and_restart(target: &Path, link_dir: &Path) -> String {
    use std::os::unix::process::CommandExt;
    let link = link_dir.join(NAMES[0]);
    let made = std::fs::create_dir_all(link_dir).and_then(|_| {
        match std::os::unix::fs::symlink(target, &link) {
            // Another rank on this node made the same link first.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            r => r,
        }
    });
    if let Err(e) = made {
        return format!(
            "NCCL found at {} but cannot link it as {}: {e}; put a libnccl.so link to it in a \
             folder on LD_LIBRARY_PATH",
            target.display(),
            link.display()
        );
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return format!("NCCL: cannot restart this program to load it: {e}"),
    };
    let ld = match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", link_dir.display()),
        _ => link_dir.display().to_string(),
    };
    let e = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", ld)
        .env(RELINKED_VAR, link_dir)
        .exec();
    format!("NCCL: cannot restart this program to load it: {e}")
}

/// Whether cudarc can load NCCL in this process: `Err` with the one-line reason if not. Call
/// [`prepare`] first (at start-up); without it, only cudarc's own names are tried.
#[cfg(feature = "nccl")]
pub fn check() -> Result<(), String> {
    if let Some(Some(why)) = UNAVAILABLE.get() {
        return Err(why.clone());
    }
    // SAFETY: as in `prepare`.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        let dirs = search_dirs(|k| std::env::var(k).ok());
        Err(match find(&dirs, &[]) {
            Err(m) => m.to_string(),
            Ok(f) => format!(
                "NCCL found at {} but cudarc opens it by the name libnccl.so: put a libnccl.so \
                 link to it in a folder on LD_LIBRARY_PATH",
                f.path.display()
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Tmp(PathBuf);
    impl Tmp {
        fn new(tag: &str) -> Self {
            let p = std::env::temp_dir().join(format!(
                "ganymede-nccl-lib-{tag}-{}-{:?}",
                std::process::id(),
                std::time::SystemTime::now()
            ));
            std::fs::create_dir_all(&p).unwrap();
            Tmp(p)
        }
        fn file(&self, rel: &str) -> PathBuf {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"not really ELF").unwrap();
            p
        }
    }
    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn env(kv: &[(&str, String)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> =
            kv.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn search_order_ld_path_then_homes_then_venvs_then_system() {
        let t = Tmp::new("order");
        t.file("venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2");
        let v = t.0.join("venv").display().to_string();
        let dirs = search_dirs(env(&[
            ("LD_LIBRARY_PATH", "/a::/b".into()),
            ("NCCL_HOME", "/nccl".into()),
            ("CUDA_HOME", "/cuda".into()),
            ("VIRTUAL_ENV", v.clone()),
        ]));
        let s: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        assert_eq!(&s[..4], ["/a", "/b", "/nccl/lib", "/cuda/lib64"]);
        assert_eq!(
            s[4],
            format!("{v}/lib/python3.12/site-packages/nvidia/nccl/lib")
        );
        assert!(s.contains(&"/usr/lib/aarch64-linux-gnu".to_string()));
        // No duplicates even when a folder is named twice.
        let d2 = search_dirs(env(&[("LD_LIBRARY_PATH", "/usr/lib64:/usr/lib64".into())]));
        assert_eq!(d2.iter().filter(|d| d.ends_with("usr/lib64")).count(), 1);
    }

    #[test]
    fn the_wheels_so_2_is_found_and_relinked() {
        let t = Tmp::new("wheel");
        let lib = t.file("venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2");
        let dirs = search_dirs(env(&[(
            "VIRTUAL_ENV",
            t.0.join("venv").display().to_string(),
        )]));
        let f = find(&dirs, &[]).unwrap();
        assert_eq!(f.path, lib);
        assert!(!f.loadable_by_name);
        match decide(false, Ok(f.clone()), None, &t.0) {
            Decision::Relink { target, link_dir } => {
                assert_eq!(target, lib);
                assert!(link_dir.starts_with(&t.0));
                // Stable, so the ranks of a node share one folder.
                assert_eq!(link_dir, super::link_dir(&t.0, &lib));
            }
            d => panic!("{d:?}"),
        }
        // The restarted process does not restart again.
        assert!(matches!(
            decide(false, Ok(f), Some("/x"), &t.0),
            Decision::Unavailable(m) if m.contains("does not load")
        ));
        // Whatever was found, cudarc finding it itself wins.
        assert_eq!(
            decide(true, Err(Missing { searched: vec![] }), None, &t.0),
            Decision::AsIs
        );
    }

    #[test]
    fn plain_so_is_preferred_and_on_ld_path_loads_by_name() {
        let t = Tmp::new("plain");
        t.file("a/libnccl.so.2");
        let so = t.file("b/libnccl.so");
        t.file("b/libnccl.so.2");
        let (a, b) = (t.0.join("a"), t.0.join("b"));
        // The first folder holding either name wins.
        assert_eq!(
            find(&[a.clone(), b.clone()], &[]).unwrap().path,
            a.join("libnccl.so.2")
        );
        let f = find(std::slice::from_ref(&b), std::slice::from_ref(&b)).unwrap();
        assert_eq!(f.path, so);
        assert!(f.loadable_by_name);
    }

    #[test]
    fn nothing_found_is_one_line_naming_the_folders() {
        let t = Tmp::new("none");
        t.file("empty/libnccl_device.bc");
        let dirs = vec![t.0.join("empty"), PathBuf::from("/nonexistent/lib")];
        let m = find(&dirs, &[]).unwrap_err();
        let line = m.to_string();
        assert!(!line.contains('\n'), "{line}");
        assert!(line.contains("libnccl.so or libnccl.so.2"), "{line}");
        assert!(line.contains("/nonexistent/lib"), "{line}");
        assert!(
            line.contains(&t.0.join("empty").display().to_string()),
            "{line}"
        );
        assert!(matches!(
            decide(false, Err(m), None, &t.0),
            Decision::Unavailable(l) if l.starts_with("NCCL not found")
        ));
    }
}
