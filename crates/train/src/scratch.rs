//! Run folders for tests and benchmarks under the system's temporary folder.
//!
//! Every training run writes its data cache (about 17 MB for `tiny`) into its run folder, so
//! folders left behind by earlier test processes add up quickly (tens of GB over a day of test
//! runs). Folders live under `temp/<prefix>/<pid>-<name>`; the first call in a process removes
//! those whose process is gone, so at most the live processes' folders remain.

use std::path::PathBuf;
use std::sync::Once;

/// An empty run folder `temp/<prefix>/<pid>-<name>` (not created: the run creates it).
pub fn run_dir(prefix: &str, name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(prefix);
    static SWEEP: Once = Once::new();
    SWEEP.call_once(|| sweep(&root));
    let d = root.join(format!("{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Remove the folders of processes that no longer run (`/proc/<pid>` gone). Where `/proc` does
/// not exist, nothing is removed.
fn sweep(root: &std::path::Path) {
    if !std::path::Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let pid = name.to_string_lossy().split('-').next().map(str::to_string);
        let alive = pid
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            .map(|p| std::path::Path::new("/proc").join(p).exists());
        if alive == Some(false) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_of_dead_processes_are_swept_and_live_ones_kept() {
        let root = std::env::temp_dir().join(format!("gm-scratch-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // pid 0 never names a user process's /proc entry; ours is alive.
        let dead = root.join("0-old");
        let live = root.join(format!("{}-mine", std::process::id()));
        let other = root.join("notes");
        for d in [&dead, &live, &other] {
            std::fs::create_dir_all(d).unwrap();
        }
        sweep(&root);
        assert!(!dead.exists(), "a dead process's folder stays");
        assert!(live.exists(), "a live process's folder was removed");
        assert!(other.exists(), "a folder not named by a pid was removed");
        let _ = std::fs::remove_dir_all(&root);
    }
}
