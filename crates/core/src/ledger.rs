//! Byte accounting: current and peak bytes per (device, category), and the peak of the total.

use serde::Serialize;
use std::sync::Mutex;

/// Where bytes live. `Host` is CPU memory (also pinned host memory of a GPU backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Device {
    Host,
    Gpu(u16),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Host => write!(f, "host"),
            Device::Gpu(i) => write!(f, "gpu{i}"),
        }
    }
}

/// What the bytes are for; the planner predicts the same categories.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Master parameters.
    Params,
    /// Gradients of the parameters.
    Grads,
    /// Optimizer state (momenta, second moments).
    Optimizer,
    /// Activations saved for backward, and the recompute working set.
    Activations,
    /// Scratch and communication buffers (gathers, dispatch, optimizer scratch).
    Buffers,
}

pub const CATEGORIES: [Category; 5] = [
    Category::Params,
    Category::Grads,
    Category::Optimizer,
    Category::Activations,
    Category::Buffers,
];

impl Category {
    pub fn name(self) -> &'static str {
        match self {
            Category::Params => "params",
            Category::Grads => "grads",
            Category::Optimizer => "optimizer",
            Category::Activations => "activations",
            Category::Buffers => "buffers",
        }
    }
}

#[derive(Default, Clone, Copy, Debug)]
struct Counter {
    current: u64,
    peak: u64,
}

#[derive(Default)]
struct Inner {
    cells: Vec<((Device, Category), Counter)>,
    totals: Vec<(Device, Counter)>,
}

/// Thread-safe byte ledger. Allocations are rare (buffers are made once and reused), so a mutex
/// is cheap enough.
#[derive(Default)]
pub struct Ledger {
    inner: Mutex<Inner>,
}

/// A snapshot of the ledger: per device and category, current and peak bytes.
#[derive(Clone, Debug, Serialize)]
pub struct LedgerReport {
    pub entries: Vec<LedgerEntry>,
    /// Per device: the peak of the sum over categories (not the sum of per-category peaks).
    pub device_peaks: Vec<(Device, u64)>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LedgerEntry {
    pub device: Device,
    pub category: Category,
    pub current: u64,
    pub peak: u64,
}

impl LedgerReport {
    pub fn peak(&self, device: Device, category: Category) -> u64 {
        self.entries
            .iter()
            .find(|e| e.device == device && e.category == category)
            .map_or(0, |e| e.peak)
    }
    pub fn current(&self, device: Device, category: Category) -> u64 {
        self.entries
            .iter()
            .find(|e| e.device == device && e.category == category)
            .map_or(0, |e| e.current)
    }
}

impl Ledger {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn alloc(&self, device: Device, category: Category, bytes: u64) {
        let mut g = self.inner.lock().unwrap();
        let c = cell(&mut g.cells, (device, category));
        c.current += bytes;
        c.peak = c.peak.max(c.current);
        let t = cell(&mut g.totals, device);
        t.current += bytes;
        t.peak = t.peak.max(t.current);
    }

    pub fn free(&self, device: Device, category: Category, bytes: u64) {
        let mut g = self.inner.lock().unwrap();
        let c = cell(&mut g.cells, (device, category));
        c.current = c.current.checked_sub(bytes).expect("ledger underflow");
        let t = cell(&mut g.totals, device);
        t.current -= bytes;
    }

    /// Forget peaks (e.g. after start-up), keeping current values.
    pub fn reset_peaks(&self) {
        let mut g = self.inner.lock().unwrap();
        for (_, c) in g.cells.iter_mut() {
            c.peak = c.current;
        }
        for (_, c) in g.totals.iter_mut() {
            c.peak = c.current;
        }
    }

    pub fn report(&self) -> LedgerReport {
        let g = self.inner.lock().unwrap();
        let mut entries: Vec<LedgerEntry> = g
            .cells
            .iter()
            .map(|((device, category), c)| LedgerEntry {
                device: *device,
                category: *category,
                current: c.current,
                peak: c.peak,
            })
            .collect();
        entries.sort_by_key(|e| (e.device, e.category));
        let mut device_peaks: Vec<(Device, u64)> =
            g.totals.iter().map(|(d, c)| (*d, c.peak)).collect();
        device_peaks.sort();
        LedgerReport {
            entries,
            device_peaks,
        }
    }
}

fn cell<K: PartialEq>(v: &mut Vec<(K, Counter)>, key: K) -> &mut Counter {
    let i = match v.iter().position(|(k, _)| *k == key) {
        Some(i) => i,
        None => {
            v.push((key, Counter::default()));
            v.len() - 1
        }
    };
    &mut v[i].1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_and_totals() {
        let l = Ledger::new();
        l.alloc(Device::Host, Category::Params, 100);
        l.alloc(Device::Host, Category::Activations, 50);
        l.free(Device::Host, Category::Activations, 50);
        l.alloc(Device::Host, Category::Grads, 30);
        let r = l.report();
        assert_eq!(r.peak(Device::Host, Category::Activations), 50);
        assert_eq!(r.current(Device::Host, Category::Activations), 0);
        assert_eq!(r.current(Device::Host, Category::Params), 100);
        // Total peak is 150 (params + activations), not 180 (sum of per-category peaks).
        assert_eq!(r.device_peaks, vec![(Device::Host, 150)]);
        l.reset_peaks();
        assert_eq!(l.report().peak(Device::Host, Category::Activations), 0);
    }
}
