//! The watchdog of a device collective (the NCCL group): poll the operation until it completes,
//! fails or passes its deadline, and on failure or timeout abort it and name the rank, the group
//! and the collective. A GPU library gives no blocking wait with a deadline, and a stalled peer
//! would otherwise hang the job forever, so the wait is a poll loop with a growing sleep.
//!
//! The logic is here, CPU-only, so it is tested with a fake operation; the NCCL group supplies
//! the real one (its completion event and `ncclCommGetAsyncError`, aborting with
//! `ncclCommAbort`).

use crate::error::{CommError, Result};
use std::time::{Duration, Instant};

/// What one poll of a pending operation found.
#[derive(Clone, Debug, PartialEq)]
pub enum Poll {
    Done,
    Pending,
    /// The library reported an error (its text).
    Failed(String),
}

/// A pending operation as the watchdog sees it.
pub trait Watched {
    /// Never blocks.
    fn poll(&mut self) -> Poll;
    /// Give up on the operation for good (for NCCL: abort the communicator, so no kernel keeps
    /// waiting for a peer and the buffers can be released).
    fn abort(&mut self);
}

/// Which collective is being waited for, and for how long at most.
#[derive(Clone, Debug)]
pub struct Watch {
    pub op: &'static str,
    pub group: String,
    /// World rank of this process.
    pub rank: usize,
    pub timeout: Duration,
}

/// Sleep before poll number `i` (0-based): none for the first polls (short collectives finish
/// in microseconds), then growing to 10 ms, so a long wait costs no CPU and a timeout is
/// noticed within 10 ms.
pub fn backoff(i: u32) -> Duration {
    match i {
        0..=15 => Duration::ZERO,
        _ => Duration::from_micros((50u64 << (i - 16).min(8)).min(10_000)),
    }
}

/// Poll `p` until done; on a library error or past the deadline abort it and return the error
/// naming the rank, the group and the collective.
pub fn watch(w: &Watch, p: &mut dyn Watched) -> Result<()> {
    let start = Instant::now();
    let mut i = 0u32;
    loop {
        match p.poll() {
            Poll::Done => return Ok(()),
            Poll::Failed(message) => {
                p.abort();
                return Err(CommError::Aborted {
                    op: w.op,
                    group: w.group.clone(),
                    rank: w.rank,
                    message,
                });
            }
            Poll::Pending => {}
        }
        let waited = start.elapsed();
        if waited >= w.timeout {
            p.abort();
            return Err(CommError::Timeout {
                op: w.op,
                group: w.group.clone(),
                rank: w.rank,
                waited,
                missing: Vec::new(),
            });
        }
        let nap = backoff(i).min(w.timeout - waited);
        if !nap.is_zero() {
            std::thread::sleep(nap);
        } else {
            std::thread::yield_now();
        }
        i = i.saturating_add(1);
    }
}

/// A deadline for a blocking library call that cannot be polled (NCCL's communicator creation
/// and split wait inside the library for every peer): if the guard is still alive after
/// `timeout`, `on_expiry` runs on a watchdog thread with the one-line error naming the rank, the
/// group and the call (the caller's `on_expiry` ends the process, since the call never returns).
/// Dropping the guard disarms it.
pub fn deadline(w: &Watch, on_expiry: impl FnOnce(String) + Send + 'static) -> DeadlineGuard {
    let state = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let s2 = state.clone();
    let (timeout, message) = (
        w.timeout,
        format!(
            "{} on group {} did not return within {:?} on rank {}: a peer did not join",
            w.op, w.group, w.timeout, w.rank
        ),
    );
    std::thread::spawn(move || {
        let (lock, cv) = &*s2;
        let done = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (done, r) = cv
            .wait_timeout_while(done, timeout, |d| !*d)
            .unwrap_or_else(|e| e.into_inner());
        if r.timed_out() && !*done {
            drop(done);
            on_expiry(message);
        }
    });
    DeadlineGuard { state }
}

/// Disarms its [`deadline`] when dropped.
pub struct DeadlineGuard {
    state: std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
}

impl Drop for DeadlineGuard {
    fn drop(&mut self) {
        let (lock, cv) = &*self.state;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake operation: done after `done_after` polls, or failing at poll `fail_at`.
    struct Fake {
        polls: u32,
        done_after: Option<u32>,
        fail_at: Option<u32>,
        aborted: bool,
    }

    impl Fake {
        fn new(done_after: Option<u32>, fail_at: Option<u32>) -> Self {
            Self {
                polls: 0,
                done_after,
                fail_at,
                aborted: false,
            }
        }
    }

    impl Watched for Fake {
        fn poll(&mut self) -> Poll {
            assert!(!self.aborted, "polled after abort");
            self.polls += 1;
            if self.fail_at == Some(self.polls) {
                return Poll::Failed("ncclRemoteError: a peer failed".into());
            }
            if self.done_after.is_some_and(|d| self.polls >= d) {
                return Poll::Done;
            }
            Poll::Pending
        }
        fn abort(&mut self) {
            self.aborted = true;
        }
    }

    fn w(timeout_ms: u64) -> Watch {
        Watch {
            op: "all_reduce",
            group: "ep".into(),
            rank: 3,
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    #[test]
    fn a_completing_operation_is_not_aborted() {
        let mut f = Fake::new(Some(40), None);
        watch(&w(10_000), &mut f).unwrap();
        assert_eq!(f.polls, 40);
        assert!(!f.aborted);
    }

    #[test]
    fn a_stalled_operation_is_aborted_at_the_deadline_and_named() {
        let mut f = Fake::new(None, None);
        let t = Instant::now();
        let e = watch(&w(150), &mut f).unwrap_err();
        let took = t.elapsed();
        assert!(f.aborted);
        assert!(took >= Duration::from_millis(150), "{took:?}");
        assert!(took < Duration::from_millis(1500), "{took:?}");
        assert!(matches!(e, CommError::Timeout { rank: 3, .. }), "{e:?}");
        let line = e.to_string();
        assert!(
            line.contains("all_reduce") && line.contains("group ep") && line.contains("rank 3"),
            "{line}"
        );
        // Sleeping, not spinning: far fewer polls than a busy loop would make.
        assert!(f.polls < 1000, "{} polls", f.polls);
    }

    #[test]
    fn a_library_error_aborts_at_once_and_is_named() {
        let mut f = Fake::new(None, Some(5));
        let e = watch(&w(60_000), &mut f).unwrap_err();
        assert!(f.aborted);
        assert_eq!(f.polls, 5);
        let line = e.to_string();
        assert!(
            line.contains("all_reduce on group ep failed on rank 3")
                && line.contains("ncclRemoteError")
                && line.contains("aborted"),
            "{line}"
        );
    }

    #[test]
    fn backoff_grows_to_ten_milliseconds() {
        assert_eq!(backoff(0), Duration::ZERO);
        assert!(backoff(16) > Duration::ZERO);
        assert!((0..200).all(|i| backoff(i) <= Duration::from_millis(10)));
        assert_eq!(backoff(100), Duration::from_millis(10));
    }

    #[test]
    fn a_blocking_call_past_its_deadline_is_named_and_one_in_time_is_not() {
        let (tx, rx) = std::sync::mpsc::channel();
        let t2 = tx.clone();
        let g = deadline(&w(2_000), move |m| t2.send(m).unwrap());
        drop(g);
        let _g = deadline(
            &Watch {
                op: "init",
                ..w(50)
            },
            move |m| tx.send(m).unwrap(),
        );
        let m = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(
            m.contains("init on group ep did not return") && m.contains("rank 3"),
            "{m}"
        );
        // The disarmed one never fires.
        assert!(rx.recv_timeout(Duration::from_millis(2_500)).is_err());
    }
}
