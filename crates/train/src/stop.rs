//! Graceful stop: SIGINT, SIGTERM and an optional extra signal (Slurm's `--signal=USR1@120`)
//! ask a run to finish its current step, checkpoint, print how to resume and exit with
//! [`EXIT_STOPPED`]. A SIGINT after the first request exits at once with [`EXIT_INTERRUPTED`].
//!
//! The handler only stores the signal's number (and writes one fixed line with `write(2)`,
//! which is async-signal-safe); the training loop reads it at each step boundary, and ranks
//! agree on it there (see `trainer`), so every rank stops after the same step.

use anyhow::{bail, Result};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// Exit status of a run stopped by a signal after saving its checkpoint: sysexits' EX_TEMPFAIL
/// ("try again later"), distinct from success, from errors (1) and from a kill by the signal.
pub const EXIT_STOPPED: u8 = 75;
/// Exit status of a second SIGINT during a stop: 128 + SIGINT, as a shell reports Ctrl-C.
pub const EXIT_INTERRUPTED: i32 = 130;

/// The signal that asked for a stop (0: none yet).
static REQUESTED: AtomicI32 = AtomicI32::new(0);
/// Whether training has begun. Before, there is nothing to save: a signal ends the process at
/// once (as without a handler) instead of waiting for a first step that may be minutes away.
static ARMED: AtomicBool = AtomicBool::new(false);

const MSG_FIRST: &[u8] = b"\nganymede: stop requested: finishing this step, then checkpointing (Ctrl-C again exits at once, losing the steps since the last checkpoint)\n";
const MSG_SECOND: &[u8] = b"\nganymede: second interrupt: exiting at once without a checkpoint\n";

extern "C" fn on_signal(sig: libc::c_int) {
    if !ARMED.load(Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe; 128 + the signal, as a shell reports it.
        unsafe { libc::_exit(128 + sig) };
    }
    let first = REQUESTED
        .compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok();
    let say = |m: &[u8]| {
        // SAFETY: write(2) on stderr is async-signal-safe; the buffer is static.
        unsafe { libc::write(2, m.as_ptr().cast(), m.len()) };
    };
    if first {
        say(MSG_FIRST);
    } else if sig == libc::SIGINT {
        say(MSG_SECOND);
        // SAFETY: _exit is async-signal-safe and runs no destructors.
        unsafe { libc::_exit(EXIT_INTERRUPTED) };
    }
}

/// Install the stop handler for SIGINT, SIGTERM and `extra` (a signal number). Call once,
/// before training starts.
pub fn install(extra: Option<i32>) -> Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM].into_iter().chain(extra) {
        // SAFETY: a zeroed sigaction with a plain handler; SA_RESTART so that interrupted reads
        // and writes of the training loop resume instead of failing with EINTR.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            bail!(
                "cannot install a handler for {}: {}",
                signal_name(sig),
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// From now on a signal stops the run gracefully (called when the first step starts).
pub fn arm() {
    ARMED.store(true, Ordering::SeqCst);
}

/// The signal that asked this process to stop, if any.
pub fn requested() -> Option<i32> {
    match REQUESTED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

const NAMES: [(&str, i32); 8] = [
    ("INT", libc::SIGINT),
    ("TERM", libc::SIGTERM),
    ("USR1", libc::SIGUSR1),
    ("USR2", libc::SIGUSR2),
    ("HUP", libc::SIGHUP),
    ("QUIT", libc::SIGQUIT),
    ("XCPU", libc::SIGXCPU),
    ("ALRM", libc::SIGALRM),
];

/// `SIGUSR1`'s name for a number.
pub fn signal_name(sig: i32) -> String {
    NAMES
        .iter()
        .find(|(_, n)| *n == sig)
        .map_or(format!("signal {sig}"), |(name, _)| format!("SIG{name}"))
}

/// A stop signal by name (`USR1`, `SIGUSR1`, case-insensitive) or number; `--stop-signal`.
pub fn parse_signal(s: &str) -> Result<i32> {
    let t = s.trim().to_ascii_uppercase();
    let t = t.strip_prefix("SIG").unwrap_or(&t);
    if let Some((_, n)) = NAMES.iter().find(|(name, _)| *name == t) {
        return Ok(*n);
    }
    match t.parse::<i32>() {
        Ok(n) if NAMES.iter().any(|(_, x)| *x == n) => Ok(n),
        _ => bail!(
            "--stop-signal {s}: not a signal a run can stop on (one of {})",
            NAMES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_names() {
        assert_eq!(parse_signal("usr1").unwrap(), libc::SIGUSR1);
        assert_eq!(parse_signal("SIGTERM").unwrap(), libc::SIGTERM);
        assert_eq!(parse_signal("10").unwrap(), 10);
        assert!(parse_signal("KILL").is_err());
        assert_eq!(signal_name(libc::SIGUSR2), "SIGUSR2");
    }
}
