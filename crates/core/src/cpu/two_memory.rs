//! Two-memory mode of the CPU backend: a "device" (`Device::Gpu(0)`, emulated in host RAM, with
//! an optional capacity) and pinned host memory (`Device::Host`) as separate ledger devices,
//! with copies between them running asynchronously on one thread per copy stream. It lets the
//! memory milestones (activation offload with prefetch, host-resident optimizer state) run and
//! be tested without a GPU, and with `checking` it catches a missing event wait at the access
//! that would read stale data on a GPU, deterministically (not by luck of timing).
//!
//! How ordering is tracked: every operation gets a sequence number on the stream that issues
//! it (kernels and synchronous transfers on the compute stream; CPU code touching pinned memory
//! on the host). Each stream, and the host, carries a vector clock of how far into each other
//! stream it is ordered: recording an event snapshots the recording stream's clock, waiting on
//! it merges the snapshot into the waiter's clock, synchronizing it on the host merges it into
//! the host's (and everything issued after a host synchronization is ordered after it, so
//! every stream sees the host's clock). Each buffer remembers its last write and the reads
//! since; an access is correct when its stream's clock covers the last write (and, to write,
//! the reads). That is exactly what a GPU requires, independent of how fast the copy threads
//! happen to run.
//!
//! Without `checking` the same bookkeeping runs but violations are not reported; an access
//! then waits for conflicting copies in flight (on a GPU it would race). Either way the
//! emulation itself never races: the calling thread waits for copies in flight on a buffer
//! before touching it, and copy threads take a per-buffer lock while copying.

use crate::ledger::{Category, Device, Ledger};
use crate::stream::{CopySpan, Event, MemoryError, Stream};
use crate::tensor::{Buffer, DType, DeviceBuffer, Tensor, View, ViewMut};
use std::any::Any;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How the CPU backend's two-memory mode behaves.
#[derive(Clone, Copy, Debug, Default)]
pub struct TwoMemoryOptions {
    /// Bytes of emulated device memory; `None` for no limit.
    pub device_capacity: Option<u64>,
    /// Panic at an access that is not ordered after the copies it depends on.
    pub checking: bool,
}

/// The emulated device.
pub const DEVICE: Device = Device::Gpu(0);

/// Clock slots: the four streams, then the host.
const SLOTS: usize = 5;
const HOST: usize = 4;
const COMPUTE: usize = 0;
type Clock = [u64; SLOTS];

fn slot_name(slot: usize) -> &'static str {
    match slot {
        HOST => "the host",
        s => match Stream::ALL[s] {
            Stream::Compute => "the compute stream",
            Stream::ToHost => "the to-host stream",
            Stream::FromHost => "the from-host stream",
            Stream::Comm => "the comm stream",
        },
    }
}

fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    // A checking panic is raised after guards are dropped, but stay usable after any panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One operation: its issuing slot and its sequence number there.
#[derive(Clone, Copy, Debug)]
struct Op {
    slot: usize,
    seq: u64,
}

struct Clocks {
    /// `vc[s][t]`: how far into slot `t`'s operations slot `s` is ordered.
    vc: [Clock; SLOTS],
}

impl Clocks {
    /// The clock of `slot` for work issued now: its own plus the host's.
    fn now(&self, slot: usize) -> Clock {
        let mut c = self.vc[slot];
        merge(&mut c, &self.vc[HOST]);
        c
    }
    /// Issue an operation on `slot`.
    fn issue(&mut self, slot: usize) -> Op {
        let h = self.vc[HOST];
        merge(&mut self.vc[slot], &h);
        self.vc[slot][slot] += 1;
        Op {
            slot,
            seq: self.vc[slot][slot],
        }
    }
    fn knows(&self, slot: usize, op: Op) -> bool {
        self.vc[slot][op.slot] >= op.seq || self.vc[HOST][op.slot] >= op.seq
    }
}

fn merge(into: &mut Clock, from: &Clock) {
    for (a, b) in into.iter_mut().zip(from) {
        *a = (*a).max(*b);
    }
}

struct Shared {
    checking: bool,
    clocks: Mutex<Clocks>,
    /// Keep a span per copy (`trace_copies`), drained by `take_copy_spans`.
    tracing: AtomicBool,
    spans: Mutex<Vec<CopySpan>>,
}

#[derive(Default)]
struct CellState {
    last_write: Option<Op>,
    /// Reads since the last write, the latest per slot.
    reads: Vec<Op>,
    /// Asynchronous copies in flight writing / reading this buffer.
    copying_in: u32,
    copying_out: u32,
}

/// One allocation of emulated memory, shared with the copy threads that move its bytes.
struct Cell {
    id: u64,
    device: Device,
    category: Category,
    dtype: DType,
    len: usize,
    /// u64 words, so every dtype is aligned. Owns the memory; reached only through `ptr`.
    _mem: UnsafeCell<Vec<u64>>,
    ptr: *mut u8,
    state: Mutex<CellState>,
    idle: Condvar,
    /// Held by a copy thread while it copies, so two copy threads never race on a buffer.
    busy: Mutex<()>,
    shared: Arc<Shared>,
}

// SAFETY: the bytes behind `ptr` are accessed by the calling thread only after copies in
// flight on the buffer have finished (`access`), and by copy threads only under `busy`.
unsafe impl Send for Cell {}
unsafe impl Sync for Cell {}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl Cell {
    fn new(
        device: Device,
        category: Category,
        dtype: DType,
        len: usize,
        shared: Arc<Shared>,
    ) -> Self {
        let mut mem = vec![0u64; (len * dtype.size()).div_ceil(8)];
        let ptr = mem.as_mut_ptr() as *mut u8;
        Cell {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            device,
            category,
            dtype,
            len,
            _mem: UnsafeCell::new(mem),
            ptr,
            state: Mutex::new(CellState::default()),
            idle: Condvar::new(),
            busy: Mutex::new(()),
            shared,
        }
    }

    fn describe(&self) -> String {
        format!(
            "{} {} buffer ({} x {}, {} bytes)",
            self.device,
            self.category.name(),
            self.dtype.name(),
            self.len,
            self.len * self.dtype.size()
        )
    }

    /// Check `op` (a read, or with `write` a write) against the buffer's history and record
    /// it. Returns the checking failure instead of panicking so the caller can drop its locks.
    fn order(
        &self,
        clocks: &Clocks,
        st: &mut CellState,
        op: Op,
        write: bool,
        who: &str,
    ) -> Option<String> {
        let mut err = None;
        if self.shared.checking {
            let verb = if write { "writes" } else { "reads" };
            if let Some(w) = st.last_write.filter(|&w| !clocks.knows(op.slot, w)) {
                err = Some(format!(
                    "{who} ({}) {verb} {} before waiting for {}'s write of it (op {}): record \
                     an event on that stream after the write and wait on it first",
                    slot_name(op.slot),
                    self.describe(),
                    slot_name(w.slot),
                    w.seq
                ));
            } else if write {
                if let Some(r) = st.reads.iter().find(|&&r| !clocks.knows(op.slot, r)) {
                    err = Some(format!(
                        "{who} ({}) writes {} while {}'s read of it (op {}) may be in flight: \
                         record an event on that stream after the read and wait on it first",
                        slot_name(op.slot),
                        self.describe(),
                        slot_name(r.slot),
                        r.seq
                    ));
                }
            }
        }
        if write {
            st.last_write = Some(op);
            st.reads.clear();
        } else {
            st.reads.retain(|r| r.slot != op.slot);
            st.reads.push(op);
        }
        err
    }

    /// A synchronous access by `slot` (the calling thread acting as that stream or the host).
    fn access(&self, slot: usize, write: bool) -> *mut u8 {
        let err = {
            let mut clocks = lock(&self.shared.clocks);
            let op = clocks.issue(slot);
            let mut st = lock(&self.state);
            let who = match slot {
                HOST => "CPU code",
                COMPUTE => "a kernel or transfer",
                _ => "a synchronous copy",
            };
            self.order(&clocks, &mut st, op, write, who)
        };
        if let Some(e) = err {
            panic!("two-memory check: {e}");
        }
        let mut st = lock(&self.state);
        while st.copying_in > 0 || (write && st.copying_out > 0) {
            st = self.idle.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        self.ptr
    }

    fn copy_done(&self, write: bool) {
        let mut st = lock(&self.state);
        if write {
            st.copying_in -= 1;
        } else {
            st.copying_out -= 1;
        }
        self.idle.notify_all();
    }
}

/// Emulated device or pinned memory in a [`Tensor`].
pub struct EmuBuffer(Arc<Cell>);

impl DeviceBuffer for EmuBuffer {
    fn dtype(&self) -> DType {
        self.0.dtype
    }
    fn len(&self) -> usize {
        self.0.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    /// Kernels and synchronous transfers on device memory run on the compute stream; CPU code
    /// on pinned memory runs on the host.
    fn host_ptr(&self, write: bool) -> Option<*mut u8> {
        let slot = if self.0.device == Device::Host {
            HOST
        } else {
            COMPUTE
        };
        Some(self.0.access(slot, write))
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}

struct EventInner {
    clock: Clock,
    done: Mutex<Option<Instant>>,
    cv: Condvar,
}

impl EventInner {
    fn complete(&self) {
        *lock(&self.done) = Some(Instant::now());
        self.cv.notify_all();
    }
    fn wait(&self) -> Instant {
        let mut d = lock(&self.done);
        loop {
            if let Some(t) = *d {
                return t;
            }
            d = self.cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// An event of the two-memory mode.
struct EmuEvent(Arc<EventInner>);

enum Job {
    Copy {
        src: Arc<Cell>,
        src_byte: usize,
        dst: Arc<Cell>,
        dst_byte: usize,
        bytes: usize,
    },
    Record(Arc<EventInner>),
    Wait(Arc<EventInner>),
}

fn copy_thread(stream: Stream, shared: Arc<Shared>, jobs: std::sync::mpsc::Receiver<Job>) {
    for job in jobs {
        match job {
            Job::Copy {
                src,
                src_byte,
                dst,
                dst_byte,
                bytes,
            } => {
                let start = Instant::now();
                {
                    // Lock in id order so two copy threads never deadlock.
                    let (first, second) = if src.id <= dst.id {
                        (&src, &dst)
                    } else {
                        (&dst, &src)
                    };
                    let _a = lock(&first.busy);
                    let _b = (first.id != second.id).then(|| lock(&second.busy));
                    // SAFETY: both ranges were checked against the buffers' sizes at enqueue;
                    // the calling thread stays off both buffers until `copy_done`.
                    unsafe {
                        std::ptr::copy(src.ptr.add(src_byte), dst.ptr.add(dst_byte), bytes);
                    }
                }
                if shared.tracing.load(Ordering::Relaxed) {
                    lock(&shared.spans).push(CopySpan {
                        stream,
                        start,
                        end: Instant::now(),
                        bytes: bytes as u64,
                    });
                }
                src.copy_done(false);
                dst.copy_done(true);
            }
            Job::Record(e) => e.complete(),
            Job::Wait(e) => {
                e.wait();
            }
        }
    }
}

/// The state behind a two-memory [`crate::CpuBackend`].
pub(crate) struct TwoMemory {
    shared: Arc<Shared>,
    capacity: Option<u64>,
    /// Copy streams' queues (`None` for compute, which runs on the calling thread). Behind a
    /// mutex so that enqueueing and numbering happen in one order.
    queues: Mutex<Vec<Option<Sender<Job>>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl TwoMemory {
    pub(crate) fn new(options: TwoMemoryOptions) -> Self {
        let shared = Arc::new(Shared {
            checking: options.checking,
            clocks: Mutex::new(Clocks {
                vc: [[0; SLOTS]; SLOTS],
            }),
            tracing: AtomicBool::new(false),
            spans: Mutex::new(Vec::new()),
        });
        let mut queues = vec![None];
        let mut threads = Vec::new();
        for &s in &Stream::ALL[1..] {
            let (tx, rx) = channel();
            let sh = shared.clone();
            let t = std::thread::Builder::new()
                .name(format!("ganymede-{}", s.name()))
                .spawn(move || copy_thread(s, sh, rx))
                .expect("spawning a copy thread");
            queues.push(Some(tx));
            threads.push(t);
        }
        TwoMemory {
            shared,
            capacity: options.device_capacity,
            queues: Mutex::new(queues),
            threads: Mutex::new(threads),
        }
    }

    /// A zeroed allocation on `device` (the emulated device, within capacity, or pinned host).
    pub(crate) fn alloc(
        &self,
        ledger: &Arc<Ledger>,
        device: Device,
        shape: &[usize],
        category: Category,
        dtype: DType,
    ) -> Result<Tensor, MemoryError> {
        let len: usize = shape.iter().product();
        let bytes = (len * dtype.size()) as u64;
        match self.capacity.filter(|_| device != Device::Host) {
            Some(capacity) => ledger
                .try_alloc(device, category, bytes, capacity)
                .map_err(|in_use| MemoryError::OutOfMemory {
                    device,
                    category,
                    requested: bytes,
                    in_use,
                    capacity,
                })?,
            None => ledger.alloc(device, category, bytes),
        }
        let cell = Cell::new(device, category, dtype, len, self.shared.clone());
        let buf = Buffer::Device(Box::new(EmuBuffer(Arc::new(cell))));
        Ok(Tensor::from_charged_buffer(
            buf,
            shape,
            device,
            category,
            ledger.clone(),
        ))
    }

    /// A device allocation holding `data` (a blocking upload: ordered before everything).
    pub(crate) fn upload<E: Copy>(
        &self,
        ledger: &Arc<Ledger>,
        data: &[E],
        shape: &[usize],
        category: Category,
        dtype: DType,
    ) -> Tensor {
        assert_eq!(std::mem::size_of::<E>(), dtype.size());
        let t = self
            .alloc(ledger, DEVICE, shape, category, dtype)
            .unwrap_or_else(|e| panic!("{e}"));
        let cell = emu(t.view()).expect("emulated buffer").0;
        assert_eq!(data.len(), cell.len, "upload: data/shape mismatch");
        // SAFETY: a fresh buffer no copy knows of, sized for `data`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr() as *const u8,
                cell.ptr,
                std::mem::size_of_val(data),
            )
        };
        t
    }

    fn send(&self, stream: Stream, job: Job) {
        let q = lock(&self.queues);
        q[stream.index()]
            .as_ref()
            .expect("a copy stream")
            .send(job)
            .expect("copy thread alive");
    }

    pub(crate) fn copy_async(&self, dst: ViewMut, src: View, stream: Stream) {
        assert_eq!(dst.dtype(), src.dtype(), "copy between different dtypes");
        assert_eq!(dst.len(), src.len(), "copy between different lengths");
        let size = src.dtype().size();
        let bytes = src.len() * size;
        let (d, s) = (emu_mut(&dst), emu(src));
        let slot = stream.index();
        let (Some((dc, doff)), Some((sc, soff)), false) = (&d, &s, stream == Stream::Compute)
        else {
            // Synchronous: on the compute stream, or with ordinary (pageable) host memory on
            // one side, which CUDA also copies before returning. The copy stream's earlier work
            // must be done first, since this copy runs now on the calling thread.
            if stream != Stream::Compute {
                let e = self.record_event(stream);
                e.0.wait();
            }
            let dp = match &d {
                Some((c, off)) => unsafe { c.access(slot, true).add(off * size) },
                None => plain_mut_ptr(dst),
            };
            let sp = match &s {
                Some((c, off)) => unsafe { c.access(slot, false).add(off * size) },
                None => plain_ptr(src),
            };
            // SAFETY: both ranges are `bytes` long (checked above) and no copy is in flight
            // on either (`access` waited); `copy` allows overlap within one buffer.
            unsafe { std::ptr::copy(sp, dp, bytes) };
            return;
        };
        let err = {
            let q = lock(&self.queues);
            let mut clocks = lock(&self.shared.clocks);
            let op = clocks.issue(slot);
            let err = {
                let mut st = lock(&sc.state);
                st.copying_out += 1;
                sc.order(&clocks, &mut st, op, false, "an async copy")
            };
            let err = err.or({
                let mut st = lock(&dc.state);
                st.copying_in += 1;
                dc.order(&clocks, &mut st, op, true, "an async copy")
            });
            if err.is_none() {
                q[slot]
                    .as_ref()
                    .expect("a copy stream")
                    .send(Job::Copy {
                        src: sc.clone(),
                        src_byte: soff * size,
                        dst: dc.clone(),
                        dst_byte: doff * size,
                        bytes,
                    })
                    .expect("copy thread alive");
            }
            err
        };
        if let Some(e) = err {
            // Nothing was queued: undo the in-flight counts so the buffers stay usable.
            sc.copy_done(false);
            dc.copy_done(true);
            panic!("two-memory check: {e}");
        }
    }

    pub(crate) fn record_event(&self, stream: Stream) -> EmuEventRef {
        let q = lock(&self.queues);
        let clocks = lock(&self.shared.clocks);
        let e = Arc::new(EventInner {
            clock: clocks.now(stream.index()),
            done: Mutex::new(None),
            cv: Condvar::new(),
        });
        match &q[stream.index()] {
            // Compute work is done when issued.
            None => e.complete(),
            Some(tx) => tx.send(Job::Record(e.clone())).expect("copy thread alive"),
        }
        EmuEventRef(e)
    }

    pub(crate) fn wait_event(&self, stream: Stream, event: &Event) {
        let Some(e) = inner(event) else { return };
        if stream == Stream::Compute {
            // Compute runs on the calling thread, so waiting on it blocks here.
            e.wait();
        } else {
            self.send(stream, Job::Wait(e.clone()));
        }
        let mut clocks = lock(&self.shared.clocks);
        merge(&mut clocks.vc[stream.index()], &e.clock);
    }

    pub(crate) fn synchronize_event(&self, event: &Event) {
        let Some(e) = inner(event) else { return };
        e.wait();
        let mut clocks = lock(&self.shared.clocks);
        merge(&mut clocks.vc[HOST], &e.clock);
    }

    pub(crate) fn query_event(&self, event: &Event) -> bool {
        inner(event).is_none_or(|e| lock(&e.done).is_some())
    }

    pub(crate) fn elapsed(&self, start: &Event, end: &Event) -> Duration {
        match (inner(start), inner(end)) {
            (Some(a), Some(b)) => b.wait().saturating_duration_since(a.wait()),
            _ => Event::completed_elapsed(start, end).expect("events of another backend"),
        }
    }

    /// Wait for every stream; the host is then ordered after all issued work.
    pub(crate) fn trace_copies(&self, on: bool) {
        self.shared.tracing.store(on, Ordering::Relaxed);
    }

    pub(crate) fn take_copy_spans(&self) -> Vec<CopySpan> {
        std::mem::take(&mut *lock(&self.shared.spans))
    }

    pub(crate) fn synchronize(&self) {
        for s in Stream::ALL {
            let e = self.record_event(s).into_event();
            self.synchronize_event(&e);
        }
    }
}

impl Drop for TwoMemory {
    fn drop(&mut self) {
        // Closing the queues ends the copy threads once their queued work is done.
        lock(&self.queues).clear();
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
    }
}

/// A freshly recorded event, before it is wrapped for the caller.
pub(crate) struct EmuEventRef(Arc<EventInner>);

impl EmuEventRef {
    pub(crate) fn into_event(self) -> Event {
        Event::new(EmuEvent(self.0))
    }
}

fn inner(e: &Event) -> Option<&Arc<EventInner>> {
    e.downcast::<EmuEvent>().map(|e| &e.0)
}

/// The emulated buffer and element offset behind a view, if it is one.
fn emu(v: View) -> Option<(Arc<Cell>, usize)> {
    match v {
        View::Device(d) => d
            .buffer()
            .as_any()
            .downcast_ref::<EmuBuffer>()
            .map(|b| (b.0.clone(), d.offset())),
        _ => None,
    }
}

fn emu_mut(v: &ViewMut) -> Option<(Arc<Cell>, usize)> {
    match v {
        ViewMut::Device(d) => d
            .buffer()
            .as_any()
            .downcast_ref::<EmuBuffer>()
            .map(|b| (b.0.clone(), d.offset())),
        _ => None,
    }
}

fn plain_ptr(v: View) -> *const u8 {
    match v {
        View::Host(s) => s.as_ptr() as *const u8,
        View::Host64(s) => s.as_ptr() as *const u8,
        View::HostBf16(s) => s.as_ptr() as *const u8,
        View::HostU32(s) => s.as_ptr() as *const u8,
        View::Device(d) => panic!("copy_async: {} is not host memory", d.buffer().describe()),
    }
}

fn plain_mut_ptr(v: ViewMut) -> *mut u8 {
    match v {
        ViewMut::Host(s) => s.as_mut_ptr() as *mut u8,
        ViewMut::Host64(s) => s.as_mut_ptr() as *mut u8,
        ViewMut::HostBf16(s) => s.as_mut_ptr() as *mut u8,
        ViewMut::HostU32(s) => s.as_mut_ptr() as *mut u8,
        ViewMut::Device(d) => panic!("copy_async: {} is not host memory", d.buffer().describe()),
    }
}

#[cfg(test)]
mod tests;
