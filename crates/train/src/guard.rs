//! What keeps one command from destroying another's results: the run directory's writer lock,
//! and the checks every command that writes a file or folder makes before writing.

use anyhow::{bail, Context, Result};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The lock file in a run directory; it records the holder as `pid PID on HOST`.
pub const LOCK_FILE: &str = "train.lock";

/// An exclusive advisory lock (`flock`) on `RUN/train.lock`, held by the one process that writes
/// the run (for ranks as threads, the process; under MPI, rank 0's) until it is dropped. The
/// kernel releases it when its holder dies, however it dies, so a stale file never blocks.
/// (On NFS, Linux maps `flock` onto byte-range locks that every client sees; Lustre needs the
/// `flock` mount option.)
pub struct RunLock {
    _file: fs::File,
    pub path: PathBuf,
}

impl RunLock {
    /// Take the lock of `run_dir` (creating the directory), or fail with one line naming the
    /// holder.
    pub fn acquire(run_dir: &Path) -> Result<RunLock> {
        use std::os::unix::io::AsRawFd;
        fs::create_dir_all(run_dir)
            .with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
        let path = run_dir.join(LOCK_FILE);
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let holder = fs::read_to_string(&path).unwrap_or_default();
                let holder = holder.trim();
                bail!(
                    "run directory {} is being written by another ganymede train ({}; lock {}): wait for it to end or stop it, or pick another --out",
                    run_dir.display(),
                    if holder.is_empty() { "holder unknown" } else { holder },
                    path.display()
                );
            }
            bail!("cannot lock {}: {e}", path.display());
        }
        let who = format!("pid {} on {}\n", std::process::id(), hostname());
        file.set_len(0)
            .and_then(|()| file.write_all(who.as_bytes()))
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(RunLock { _file: file, path })
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer's length is passed; the result is NUL-terminated on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown host".into();
    }
    let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// What `dir` holds that no other command may overwrite: a checkpoint (its manifest) or a run
/// (checkpoints, metrics, a lock). None for anything else.
pub fn holds_run_or_checkpoint(dir: &Path) -> Option<&'static str> {
    if dir.join(crate::checkpoint::MANIFEST_FILE).is_file() {
        Some("a checkpoint")
    } else if dir.join(crate::checkpoint::sharded::SHARDS_FILE).is_file() {
        Some("a sharded checkpoint")
    } else if dir.join("checkpoints").is_dir()
        || dir.join("metrics.jsonl").is_file()
        || dir.join(LOCK_FILE).is_file()
    {
        Some("a training run")
    } else {
        None
    }
}

/// Refuse an output folder (`export --out`) that holds a checkpoint or a run, even with
/// `force`; refuse any other non-empty folder (or a file there) unless `force`.
pub fn check_output_dir(dir: &Path, flag: &str, force: bool) -> Result<()> {
    if dir.is_file() {
        bail!("{flag} {} is a file, not a folder", dir.display());
    }
    if let Some(what) = holds_run_or_checkpoint(dir) {
        bail!(
            "{flag} {} holds {what}, which this would overwrite: pick another {flag}",
            dir.display()
        );
    }
    let used = fs::read_dir(dir).is_ok_and(|mut rd| rd.next().is_some());
    if used && !force {
        bail!(
            "{flag} {} is not empty: pick another {flag}, or pass --force to overwrite what is there",
            dir.display()
        );
    }
    Ok(())
}

/// Refuse an output file that exists unless `force`, and an existing one inside a checkpoint
/// or a run directory even with `force`.
pub fn check_output_file(path: &Path, flag: &str, force: bool) -> Result<()> {
    if path.is_dir() {
        bail!("{flag} {} is a folder, not a file", path.display());
    }
    if !path.exists() {
        return Ok(());
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(what) = holds_run_or_checkpoint(parent.unwrap_or(Path::new("."))) {
        bail!(
            "{flag} {} belongs to {what}: pick another {flag}",
            path.display()
        );
    }
    if !force {
        bail!(
            "{flag} {} exists: pick another {flag}, or pass --force to overwrite it",
            path.display()
        );
    }
    Ok(())
}
