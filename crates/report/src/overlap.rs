//! How much of each rank's communication and offload copying ran under compute, read from a
//! Chrome trace written by `ganymede train --trace` (tracks by `tid`: 0 compute, 1
//! communication, 2 waiting, 3 to-host copies, 4 from-host copies). A span hidden behind
//! compute costs no step time; what is not hidden is what a faster link would buy.

use serde_json::Value;

/// Time on one track of one rank, in microseconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Busy {
    /// Length of the union of the track's spans.
    pub busy_us: f64,
    /// Part of it during which compute ran too.
    pub hidden_us: f64,
}

impl Busy {
    /// Share of the busy time hidden behind compute (`None` when the track was idle).
    pub fn hidden_share(&self) -> Option<f64> {
        (self.busy_us > 0.0).then(|| self.hidden_us / self.busy_us)
    }
}

/// One rank's tracks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankOverlap {
    pub rank: u64,
    pub comm: Busy,
    pub to_host: Busy,
    pub from_host: Busy,
    /// Time blocked waiting for collectives (exposed communication).
    pub wait_us: f64,
}

/// Sorted, disjoint intervals covering the given ones.
fn union(mut v: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    v.retain(|(a, b)| b > a);
    v.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn length(v: &[(f64, f64)]) -> f64 {
    v.iter().map(|(a, b)| b - a).sum()
}

/// Length of the intersection of two unions (both sorted and disjoint).
fn intersection(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let (mut i, mut j, mut total) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if hi > lo {
            total += hi - lo;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

/// Per rank, from a trace document (`{"traceEvents": [...]}`); ranks in order.
pub fn from_trace(doc: &Value) -> Vec<RankOverlap> {
    let Some(events) = doc["traceEvents"].as_array() else {
        return vec![];
    };
    let mut ranks: Vec<u64> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .filter_map(|e| e["pid"].as_u64())
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
        .into_iter()
        .map(|pid| {
            let spans = |tid: u64| {
                union(
                    events
                        .iter()
                        .filter(|e| e["ph"] == "X" && e["pid"] == pid && e["tid"] == tid)
                        .filter_map(|e| {
                            let ts = e["ts"].as_f64()?;
                            Some((ts, ts + e["dur"].as_f64()?))
                        })
                        .collect(),
                )
            };
            let compute = spans(0);
            let busy = |tid| {
                let s = spans(tid);
                Busy {
                    busy_us: length(&s),
                    hidden_us: intersection(&s, &compute),
                }
            };
            RankOverlap {
                rank: pid,
                comm: busy(1),
                to_host: busy(3),
                from_host: busy(4),
                wait_us: length(&spans(2)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn x(pid: u64, tid: u64, ts: f64, dur: f64) -> Value {
        json!({"ph": "X", "name": "s", "pid": pid, "tid": tid, "ts": ts, "dur": dur})
    }

    #[test]
    fn hidden_time_is_the_overlap_with_compute_counted_once() {
        // Rank 0: compute [0,10) and [20,30); comm [5,25) and an overlapping [8,12): union
        // [5,25) = 20 us, under compute [5,10) and [20,25) = 10 us. A to-host copy [30,40) runs
        // after compute: hidden 0. Waiting [10,12) and [11,14): 4 us.
        // Rank 1: a from-host copy inside compute: all hidden; no communication.
        let doc = json!({"traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0},
            x(0, 0, 0.0, 10.0), x(0, 0, 20.0, 10.0),
            x(0, 1, 5.0, 20.0), x(0, 1, 8.0, 4.0),
            x(0, 3, 30.0, 10.0),
            x(0, 2, 10.0, 2.0), x(0, 2, 11.0, 3.0),
            x(1, 0, 0.0, 100.0), x(1, 4, 10.0, 5.0),
        ]});
        let r = from_trace(&doc);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0].comm,
            Busy {
                busy_us: 20.0,
                hidden_us: 10.0
            }
        );
        assert_eq!(r[0].comm.hidden_share(), Some(0.5));
        assert_eq!(
            r[0].to_host,
            Busy {
                busy_us: 10.0,
                hidden_us: 0.0
            }
        );
        assert_eq!(r[0].wait_us, 4.0);
        assert_eq!(r[1].from_host.hidden_share(), Some(1.0));
        assert_eq!(r[1].comm.hidden_share(), None);
    }
}
