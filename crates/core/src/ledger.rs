//! Byte accounting: current and peak bytes per (device, category), the peak of the total, and
//! how many allocations were made (so a test can assert that a steady-state step allocates
//! nothing).

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
    /// Allocations since the ledger was made, and since the last `mark_window`, per device.
    allocs: Vec<(Device, (u64, u64))>,
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
        charge(&mut g, device, category, bytes);
    }

    /// Charge `bytes` only if the device's total stays within `capacity`; otherwise charge
    /// nothing and return the bytes in use. Checked and charged under one lock, so two threads
    /// cannot both squeeze into the last free bytes.
    pub fn try_alloc(
        &self,
        device: Device,
        category: Category,
        bytes: u64,
        capacity: u64,
    ) -> Result<(), u64> {
        let mut g = self.inner.lock().unwrap();
        let in_use = g
            .totals
            .iter()
            .find(|(d, _)| *d == device)
            .map_or(0, |(_, c)| c.current);
        if in_use.saturating_add(bytes) > capacity {
            return Err(in_use);
        }
        charge(&mut g, device, category, bytes);
        Ok(())
    }

    /// Bytes currently charged to `device`, over all categories.
    pub fn in_use(&self, device: Device) -> u64 {
        let g = self.inner.lock().unwrap();
        g.totals
            .iter()
            .find(|(d, _)| *d == device)
            .map_or(0, |(_, c)| c.current)
    }

    /// Allocations (calls to `alloc`/`try_alloc` that charged) since the ledger was made.
    pub fn alloc_count(&self) -> u64 {
        let g = self.inner.lock().unwrap();
        g.allocs.iter().map(|(_, (total, _))| total).sum()
    }

    /// Allocations on one device since the ledger was made.
    pub fn alloc_count_on(&self, device: Device) -> u64 {
        let g = self.inner.lock().unwrap();
        g.allocs
            .iter()
            .find(|(d, _)| *d == device)
            .map_or(0, |(_, (total, _))| *total)
    }

    /// Start a new counting window (e.g. at the start of a step).
    pub fn mark_window(&self) {
        let mut g = self.inner.lock().unwrap();
        for (_, (_, window)) in g.allocs.iter_mut() {
            *window = 0;
        }
    }

    /// Allocations since the last `mark_window` (or since the ledger was made).
    pub fn window_alloc_count(&self) -> u64 {
        let g = self.inner.lock().unwrap();
        g.allocs.iter().map(|(_, (_, window))| window).sum()
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

fn charge(g: &mut Inner, device: Device, category: Category, bytes: u64) {
    let c = cell(&mut g.cells, (device, category));
    c.current += bytes;
    c.peak = c.peak.max(c.current);
    let t = cell(&mut g.totals, device);
    t.current += bytes;
    t.peak = t.peak.max(t.current);
    let a = match g.allocs.iter().position(|(d, _)| *d == device) {
        Some(i) => &mut g.allocs[i].1,
        None => {
            g.allocs.push((device, (0, 0)));
            &mut g.allocs.last_mut().unwrap().1
        }
    };
    a.0 += 1;
    a.1 += 1;
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

    #[test]
    fn ledger_alloc_counts_and_capacity() {
        let l = Ledger::new();
        let gpu = Device::Gpu(0);
        l.alloc(Device::Host, Category::Params, 8);
        assert_eq!(l.try_alloc(gpu, Category::Activations, 60, 100), Ok(()));
        // 60 + 50 > 100: refused, nothing charged or counted.
        assert_eq!(l.try_alloc(gpu, Category::Grads, 50, 100), Err(60));
        assert_eq!(l.in_use(gpu), 60);
        assert_eq!(l.report().current(gpu, Category::Grads), 0);
        assert_eq!((l.alloc_count(), l.alloc_count_on(gpu)), (2, 1));
        l.mark_window();
        assert_eq!(l.window_alloc_count(), 0);
        l.free(gpu, Category::Activations, 60);
        assert_eq!(l.window_alloc_count(), 0, "a free is not an allocation");
        l.alloc(gpu, Category::Activations, 60);
        assert_eq!((l.window_alloc_count(), l.alloc_count()), (1, 3));
        assert_eq!(l.in_use(Device::Host), 8);
    }
}
