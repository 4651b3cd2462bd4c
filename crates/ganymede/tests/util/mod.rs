//! Helpers for tests that drive the `ganymede` binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        // A counter as well as the pid: tests of one binary run in parallel and may share a tag,
        // and one's drop must not remove the directory another is running in.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("ganymede-test-{tag}-{}-{n}", std::process::id());
        let p = std::env::temp_dir().join(name);
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Run the binary in `cwd` with `args` and extra environment variables.
pub fn ganymede<S: AsRef<str>>(cwd: &Path, args: &[S], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ganymede"));
    c.current_dir(cwd).args(args.iter().map(|s| s.as_ref()));
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run ganymede")
}

/// Stdout of a successful run; panics with stderr otherwise.
pub fn ok(o: Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "failed ({}):\n{out}\n{err}", o.status);
    out
}

/// The single stderr line of a failed run; panics if it succeeded.
pub fn fails(o: Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).trim().to_string();
    assert!(
        !o.status.success(),
        "expected failure, got success:\n{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(err.starts_with("error: "), "not a clean error: {err}");
    assert_eq!(err.lines().count(), 1, "error is not one line: {err}");
    err
}

/// Training losses of a run directory's metrics.jsonl, in step order.
pub fn losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["loss"].as_f64().unwrap()
        })
        .collect()
}

/// A Python that imports torch, transformers and safetensors: `GANYMEDE_PYTHON`, else `python3`.
pub fn python_with_transformers() -> Option<String> {
    let py = std::env::var("GANYMEDE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import torch, transformers, safetensors"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(py)
}

/// Print a line that shows even when the test harness captures output (it captures `print!`
/// and `eprint!`, not writes to the stderr handle).
pub fn loud(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "\n{msg}\n");
}
