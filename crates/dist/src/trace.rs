//! Per-rank timelines in Chrome trace-event JSON (opens in Perfetto and chrome://tracing).
//!
//! Each rank is a "process" (`pid` = rank) with five tracks: compute, communication (a
//! collective from post to completion), waiting (time blocked in `wait`), and the copies of the
//! to-host and from-host streams (activation offload and its prefetch, optimizer state). Overlap
//! of a gather or a copy with compute shows as a span under a compute span with no wait span.
//! Timestamps are microseconds since the Unix epoch, so the files of separate MPI processes line
//! up (to the hosts' clock agreement) and can be merged with [`write_chrome_trace`].

use serde::Serialize;
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Track {
    Compute,
    Comm,
    Wait,
    /// Device-to-host copies.
    ToHost,
    /// Host-to-device copies.
    FromHost,
}

impl Track {
    fn tid(self) -> u32 {
        match self {
            Track::Compute => 0,
            Track::Comm => 1,
            Track::Wait => 2,
            Track::ToHost => 3,
            Track::FromHost => 4,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Track::Compute => "compute",
            Track::Comm => "communication",
            Track::Wait => "waiting",
            Track::ToHost => "to-host copies",
            Track::FromHost => "from-host copies",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Event {
    pub name: String,
    pub track: Track,
    /// Microseconds since the Unix epoch.
    pub start_us: f64,
    pub end_us: f64,
    /// Bytes this rank sent, for communication events.
    pub bytes: Option<u64>,
}

/// One rank's recorder. Disabled recorders cost one branch per event.
pub struct Tracer {
    rank: usize,
    enabled: bool,
    origin: Instant,
    origin_unix_us: f64,
    events: Mutex<Vec<Event>>,
}

impl Tracer {
    pub fn new(rank: usize, enabled: bool) -> Self {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            rank,
            enabled,
            origin: Instant::now(),
            origin_unix_us: unix.as_secs_f64() * 1e6,
            events: Mutex::new(Vec::new()),
        }
    }
    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    fn us(&self, t: Instant) -> f64 {
        self.origin_unix_us + t.saturating_duration_since(self.origin).as_secs_f64() * 1e6
    }

    /// Record a finished interval.
    pub fn record(
        &self,
        name: impl Into<String>,
        track: Track,
        start: Instant,
        end: Instant,
        bytes: Option<u64>,
    ) {
        if !self.enabled {
            return;
        }
        let ev = Event {
            name: name.into(),
            track,
            start_us: self.us(start),
            end_us: self.us(end),
            bytes,
        };
        self.events.lock().unwrap().push(ev);
    }

    /// A span that records itself when dropped: `let _s = tracer.span("block 3 fwd", Track::Compute);`
    pub fn span(&self, name: impl Into<String>, track: Track) -> Span<'_> {
        Span {
            tracer: self,
            name: Some(name.into()),
            track,
            start: Instant::now(),
        }
    }

    pub fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }
    pub fn clear(&self) {
        self.events.lock().unwrap().clear();
    }

    /// This rank's events as trace-event objects (with the track-name metadata).
    pub fn to_trace_events(&self) -> Vec<serde_json::Value> {
        let pid = self.rank;
        let mut out = vec![serde_json::json!({
            "ph": "M", "name": "process_name", "pid": pid, "tid": 0,
            "args": {"name": format!("rank {pid}")}
        })];
        for t in [
            Track::Compute,
            Track::Comm,
            Track::Wait,
            Track::ToHost,
            Track::FromHost,
        ] {
            out.push(serde_json::json!({
                "ph": "M", "name": "thread_name", "pid": pid, "tid": t.tid(),
                "args": {"name": t.name()}
            }));
        }
        for e in self.events.lock().unwrap().iter() {
            let mut v = serde_json::json!({
                "ph": "X", "name": e.name, "cat": t_cat(e.track), "pid": pid,
                "tid": e.track.tid(), "ts": e.start_us, "dur": (e.end_us - e.start_us).max(0.0),
            });
            if let Some(b) = e.bytes {
                v["args"] = serde_json::json!({ "bytes_sent": b });
            }
            out.push(v);
        }
        out
    }
}

fn t_cat(t: Track) -> &'static str {
    match t {
        Track::Compute => "compute",
        Track::Comm => "comm",
        Track::Wait => "wait",
        Track::ToHost => "to_host",
        Track::FromHost => "from_host",
    }
}

pub struct Span<'a> {
    tracer: &'a Tracer,
    name: Option<String>,
    track: Track,
    start: Instant,
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        if let Some(name) = self.name.take() {
            self.tracer
                .record(name, self.track, self.start, Instant::now(), None);
        }
    }
}

/// The JSON document for a set of ranks' events (`{"traceEvents": [...]}`).
pub fn chrome_trace_json(events: impl IntoIterator<Item = serde_json::Value>) -> serde_json::Value {
    serde_json::json!({
        "traceEvents": events.into_iter().collect::<Vec<_>>(),
        "displayTimeUnit": "ms",
    })
}

/// Merge per-rank trace files (MPI: each process writes its own) into one.
pub fn merge_chrome_traces(
    inputs: &[std::path::PathBuf],
    out: &std::path::Path,
) -> std::io::Result<()> {
    let mut evs = Vec::new();
    for p in inputs {
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(p)?)?;
        if let Some(a) = doc["traceEvents"].as_array() {
            evs.extend(a.iter().cloned());
        }
    }
    std::fs::write(out, serde_json::to_vec(&chrome_trace_json(evs))?)
}

/// Write the timelines of several ranks (threads backend: all of them; MPI: gather the
/// per-rank event lists first, or write one file per rank) into one trace file.
pub fn write_chrome_trace(path: &std::path::Path, tracers: &[&Tracer]) -> std::io::Result<()> {
    let evs = tracers.iter().flat_map(|t| t.to_trace_events());
    let doc = chrome_trace_json(evs);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(&doc)?)?;
    std::fs::rename(&tmp, path)
}
