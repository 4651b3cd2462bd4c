//! Where a step's GPU time goes, op by op: with `GANYMEDE_CUDA_PROFILE=FILE`, every kernel
//! launch and cuBLAS call on the compute stream is followed by an event, and the time between
//! one op's event and the previous op's is charged to the op (so idle time while the host
//! catches up lands on the op that waited for it, which is where a launch-bound step loses
//! it). Every few thousand ops the events are read (a host wait: profiling perturbs the step,
//! so a profiled run is a run of its own) and FILE is rewritten as a markdown table; the last
//! partial batch is read when the backend is dropped.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// Ops whose events are held before they are read.
const BATCH: usize = 4096;

pub(crate) struct Profile {
    path: PathBuf,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The event before the first pending op (the last one read).
    prev: Option<CudaEvent>,
    pending: Vec<(String, CudaEvent)>,
    totals: Totals,
}

/// The profile, when `GANYMEDE_CUDA_PROFILE` names a file.
pub(crate) fn profile() -> Option<&'static Profile> {
    static P: OnceLock<Option<Profile>> = OnceLock::new();
    P.get_or_init(|| {
        let path = std::env::var_os("GANYMEDE_CUDA_PROFILE").filter(|v| !v.is_empty())?;
        Some(Profile {
            path: PathBuf::from(path),
            state: Mutex::new(State::default()),
        })
    })
    .as_ref()
}

impl Profile {
    /// Run `op`, which enqueues the op `name` on `stream`, and charge it what the stream spends
    /// from the previous op to this one.
    pub(crate) fn op<R>(
        &self,
        stream: &CudaStream,
        name: impl FnOnce() -> String,
        op: impl FnOnce() -> R,
    ) -> R {
        let event = || {
            stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .ok()
        };
        let lock = || self.state.lock().unwrap_or_else(|e| e.into_inner());
        {
            let mut s = lock();
            if s.prev.is_none() {
                s.prev = event();
            }
        }
        // Not under the lock: an op may be made of ops (a GEMM's operand casts).
        let r = op();
        let mut s = lock();
        if let Some(e) = event() {
            s.pending.push((name(), e));
        }
        if s.pending.len() >= BATCH {
            self.read(&mut s);
        }
        r
    }

    /// Read the pending events into the totals and rewrite the file.
    pub(crate) fn flush(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.read(&mut s);
    }

    fn read(&self, s: &mut State) {
        let pending = std::mem::take(&mut s.pending);
        let Some(mut prev) = s.prev.take() else {
            return;
        };
        for (name, e) in pending {
            let ms = prev.elapsed_ms(&e).unwrap_or(0.0);
            s.totals.add(&name, f64::from(ms.max(0.0)));
            prev = e;
        }
        s.prev = Some(prev);
        let _ = std::fs::write(&self.path, s.totals.markdown());
    }
}

/// Calls and milliseconds per op name.
#[derive(Default, Debug)]
pub struct Totals {
    by_name: HashMap<String, (u64, f64)>,
}

impl Totals {
    pub fn add(&mut self, name: &str, ms: f64) {
        let t = self.by_name.entry(name.to_string()).or_insert((0, 0.0));
        t.0 += 1;
        t.1 += ms;
    }

    /// One row per op, the most time first (ties by name), with its share of the whole.
    pub fn markdown(&self) -> String {
        let mut rows: Vec<_> = self.by_name.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1).then(a.0.cmp(b.0)));
        let total: f64 = rows.iter().map(|r| r.1 .1).sum();
        let calls: u64 = rows.iter().map(|r| r.1 .0).sum();
        let mut md = format!(
            "GPU time by op (compute stream; each op charged the time since the previous op's \
             end): {calls} ops, {total:.3} ms\n\n| op | calls | total ms | mean us | share |\n\
             |---|---|---|---|---|\n"
        );
        for (name, &(n, ms)) in rows {
            md.push_str(&format!(
                "| {name} | {n} | {ms:.3} | {:.1} | {:.1}% |\n",
                ms * 1e3 / n as f64,
                if total > 0.0 { 100.0 * ms / total } else { 0.0 }
            ));
        }
        md
    }
}

#[cfg(test)]
mod tests {
    use super::Totals;

    #[test]
    fn totals_sum_per_name_and_sort_by_time() {
        let mut t = Totals::default();
        for (n, ms) in [("a", 1.0), ("b", 5.0), ("a", 2.0), ("c", 0.5), ("a", 0.5)] {
            t.add(n, ms);
        }
        let md = t.markdown();
        assert!(md.contains("5 ops, 9.000 ms"), "{md}");
        let rows: Vec<&str> = md
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| op"))
            .collect();
        assert_eq!(rows.len(), 3, "{md}");
        assert!(
            rows[0].starts_with("| b | 1 | 5.000 | 5000.0 | 55.6% |"),
            "{md}"
        );
        assert!(
            rows[1].starts_with("| a | 3 | 3.500 | 1166.7 | 38.9% |"),
            "{md}"
        );
        assert!(
            rows[2].starts_with("| c | 1 | 0.500 | 500.0 | 5.6% |"),
            "{md}"
        );
    }
}
