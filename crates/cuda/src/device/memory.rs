//! Memory of the CUDA backend: device and pinned buffers behind the seam's `DeviceBuffer`,
//! copies by unified address, stream-ordered free, events, the copy trace; `Memory` for
//! [`CudaBackend`].

use super::{ok, probe, CudaBackend, Streams};
use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, DevicePtr, DriverError, PinnedHostSlice};
use ganymede_core::{
    bf16, Category, CopySpan, DType, Device, DeviceBuffer, Event, Ledger, Memory, MemoryError,
    PhaseTimes, StepPhase, Stream, Tensor, View, ViewMut,
};
use std::any::Any;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which streams other than compute a buffer was used on (bit per [`Stream::index`]).
pub struct Uses(AtomicU8);

impl Uses {
    /// Marks a use on `s`; true where it is the first there.
    pub fn mark(&self, s: Stream) -> bool {
        let bit = 1 << s.index();
        self.0.fetch_or(bit, Ordering::Relaxed) & bit == 0
    }
    fn others(&self) -> impl Iterator<Item = Stream> + '_ {
        let bits = self.0.load(Ordering::Relaxed);
        Stream::ALL
            .into_iter()
            .filter(move |s| *s != Stream::Compute && bits & (1 << s.index()) != 0)
    }
}

/// Makes the context current for a drop. cudarc's `bind_to_thread` first returns (and clears)
/// an error an earlier cudarc drop stored, without binding; that error is printed (a drop has
/// nowhere else to report it) and the bind retried.
fn bind_for_drop(ctx: &CudaContext) {
    if let Err(e) = ctx.bind_to_thread() {
        eprintln!(
            "CUDA: an earlier release failed: {}",
            probe::driver_error(&e)
        );
        let _ = ctx.bind_to_thread();
    }
}

/// Device memory: `len` elements of `dtype`, allocated (and freed) on the compute stream.
pub struct DeviceMemory {
    /// None only once a graph's capture has taken it (see `Drop`).
    slice: Option<CudaSlice<u8>>,
    pub addr: u64,
    dtype: DType,
    len: usize,
    /// Mark a use on another stream here, and the free waits for that stream's work.
    pub uses: Uses,
    streams: Arc<Streams>,
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // Let go inside a graph's capture: the graph keeps it (see `Streams::keep`).
        if let Some(slice) = self.slice.take() {
            match self.streams.keep(self.addr, slice) {
                Some(slice) => self.slice = Some(slice),
                None => return,
            }
        }
        // Stream-ordered free: the slice is freed on the compute stream (cudarc's drop), so make
        // compute wait for the other streams that used it, as far as they have been issued.
        let compute = self.streams.get(Stream::Compute);
        // cudarc's free does not make the context current; a tensor may drop on any thread.
        bind_for_drop(compute.context());
        for s in self.uses.others() {
            let stream = self.streams.get(s);
            if let Ok(ev) = stream.record_event(None) {
                let _ = compute.wait(&ev);
            }
        }
    }
}

impl DeviceBuffer for DeviceMemory {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn describe(&self) -> String {
        format!(
            "CUDA device memory, {} {} elements",
            self.dtype.name(),
            self.len
        )
    }
}

/// Page-locked host memory (not write-combined: the CPU reads it), the end of asynchronous
/// copies to and from the device.
pub struct PinnedMemory {
    /// None only once a graph's capture has taken it (see `Drop`).
    slice: Option<PinnedHostSlice<u8>>,
    ptr: *mut u8,
    dtype: DType,
    len: usize,
    uses: Uses,
    streams: Arc<Streams>,
}

// SAFETY: `ptr` points into `slice`'s allocation, which lives as long as this value; access is
// ordered by the seam's events like any other memory of the backend.
unsafe impl Send for PinnedMemory {}
unsafe impl Sync for PinnedMemory {}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        // Let go inside a graph's capture: the graph keeps it, as it may copy from it.
        if let Some(slice) = self.slice.take() {
            match self.streams.keep_pinned(slice) {
                Some(slice) => self.slice = Some(slice),
                None => return,
            }
        }
        // Host memory cannot be freed in stream order: wait for the streams that copied it.
        bind_for_drop(self.streams.get(Stream::Compute).context());
        for s in Stream::ALL {
            if s == Stream::Compute || self.uses.others().any(|o| o == s) {
                let _ = self.streams.get(s).synchronize();
            }
        }
    }
}

impl DeviceBuffer for PinnedMemory {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn host_ptr(&self, _write: bool) -> Option<*mut u8> {
        Some(self.ptr)
    }
    fn describe(&self) -> String {
        format!(
            "CUDA pinned host memory, {} {} elements",
            self.dtype.name(),
            self.len
        )
    }
}

/// The seam's event: a CUDA event made with timing, so `elapsed` works on any pair.
struct SeamEvent(CudaEvent);

/// Where a view's memory is, for copies (unified addressing: one address space for both).
/// Public, with [`place`], [`place_mut`] and [`CudaBackend::alloc`], for the NCCL group
/// (`ganymede_dist::nccl`), which hands device memory to NCCL in place.
pub struct Place<'a> {
    pub addr: u64,
    pub bytes: usize,
    pub dtype: DType,
    pub len: usize,
    pub uses: Option<&'a Uses>,
    pub on_device: bool,
}

fn place_of_buffer(buf: &dyn DeviceBuffer, offset: usize, len: usize) -> Place<'_> {
    let size = buf.dtype().size();
    if let Some(d) = buf.as_any().downcast_ref::<DeviceMemory>() {
        return Place {
            addr: d.addr + (offset * size) as u64,
            bytes: len * size,
            dtype: d.dtype,
            len,
            uses: Some(&d.uses),
            on_device: true,
        };
    }
    if let Some(p) = buf.as_any().downcast_ref::<PinnedMemory>() {
        return Place {
            addr: p.ptr as u64 + (offset * size) as u64,
            bytes: len * size,
            dtype: p.dtype,
            len,
            uses: Some(&p.uses),
            on_device: false,
        };
    }
    panic!(
        "the CUDA backend was given memory of another backend: {}",
        buf.describe()
    )
}

pub fn place<'a>(v: &View<'a>) -> Place<'a> {
    let host = |addr: u64, len: usize, dtype: DType| Place {
        addr,
        bytes: len * dtype.size(),
        dtype,
        len,
        uses: None,
        on_device: false,
    };
    match *v {
        View::Host(s) => host(s.as_ptr() as u64, s.len(), DType::F32),
        View::Host64(s) => host(s.as_ptr() as u64, s.len(), DType::F64),
        View::HostBf16(s) => host(s.as_ptr() as u64, s.len(), DType::BF16),
        View::HostU32(s) => host(s.as_ptr() as u64, s.len(), DType::U32),
        View::Device(d) => place_of_buffer(d.buffer(), d.offset(), d.len()),
    }
}

pub fn place_mut<'a>(v: &mut ViewMut<'a>) -> Place<'a> {
    let host = |addr: u64, len: usize, dtype: DType| Place {
        addr,
        bytes: len * dtype.size(),
        dtype,
        len,
        uses: None,
        on_device: false,
    };
    match v {
        ViewMut::Device(d) => place_of_buffer(d.buffer(), d.offset(), d.len()),
        ViewMut::Host(s) => host(s.as_mut_ptr() as u64, s.len(), DType::F32),
        ViewMut::Host64(s) => host(s.as_mut_ptr() as u64, s.len(), DType::F64),
        ViewMut::HostBf16(s) => host(s.as_mut_ptr() as u64, s.len(), DType::BF16),
        ViewMut::HostU32(s) => host(s.as_mut_ptr() as u64, s.len(), DType::U32),
    }
}

/// Asynchronous copies being timed for the trace: events around each, placed on the host clock
/// through one base event whose host time is known.
pub(super) struct CopyTrace {
    base: CudaEvent,
    base_at: Instant,
    pending: Vec<(Stream, CudaEvent, CudaEvent, u64)>,
}

impl CudaBackend {
    /// Device memory of `len` elements of `dtype`, zeroed on the compute stream.
    pub fn alloc(&self, len: usize, dtype: DType) -> Result<DeviceMemory, DriverError> {
        let bytes = len * dtype.size();
        let compute = self.compute();
        // SAFETY: zeroed below before anything reads it; cuMemAlloc rejects 0 bytes.
        let slice = unsafe { compute.alloc::<u8>(bytes.max(1)) }?;
        let (addr, _) = slice.device_ptr(compute);
        // SAFETY: `addr` is this allocation, `bytes` within it.
        unsafe { sys::cuMemsetD8Async(addr, 0, bytes, compute.cu_stream()) }.result()?;
        self.streams.allocated(addr);
        Ok(DeviceMemory {
            slice: Some(slice),
            addr,
            dtype,
            len,
            uses: Uses(AtomicU8::new(0)),
            streams: self.streams.clone(),
        })
    }

    fn try_alloc_tensor(
        &self,
        shape: &[usize],
        dtype: DType,
        category: Category,
    ) -> Result<Tensor, MemoryError> {
        let len: usize = shape.iter().product();
        match self.alloc(len, dtype) {
            Ok(m) => Ok(Tensor::from_buffer(
                ganymede_core::Buffer::Device(Box::new(m)),
                shape,
                self.device(),
                category,
                self.ledger.clone(),
            )),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let (free, total) = self.ctx.mem_get_info().unwrap_or((0, 0));
                Err(MemoryError::OutOfMemory {
                    device: self.device(),
                    category,
                    requested: (len * dtype.size()) as u64,
                    in_use: (total - free) as u64,
                    capacity: total as u64,
                })
            }
            Err(e) => panic!("CUDA allocation: {}", probe::driver_error(&e)),
        }
    }

    /// `cuMemcpyAsync` between two places on `stream` (any direction: unified addressing).
    pub(super) fn memcpy(&self, dst: &Place, src: &Place, stream: Stream) {
        assert_eq!(
            (dst.dtype, dst.len),
            (src.dtype, src.len),
            "copy between views of different dtype or length"
        );
        if src.bytes == 0 {
            return;
        }
        // Device memory is allocated and zeroed in compute's order (and may be memory compute's
        // queued kernels have just freed), so its first use on another stream waits for compute
        // as issued so far; the seam lets a new tensor be used on any stream at once.
        let mut fresh = false;
        for p in [dst, src] {
            if let Some(u) = p.uses {
                fresh |= u.mark(stream) && p.on_device;
            }
        }
        let s = self.streams.get(stream);
        self.bind();
        if fresh && stream != Stream::Compute {
            let flags = Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
            let ready = ok(self.compute().record_event(flags), "event");
            ok(s.wait(&ready), "stream wait");
        }
        // SAFETY: both ranges were checked against their buffers when the views were made; the
        // seam's rules keep them alive and unaliased until the copy is ordered.
        ok(
            unsafe { sys::cuMemcpyAsync(dst.addr, src.addr, src.bytes, s.cu_stream()) }.result(),
            "copy",
        );
    }

    pub(super) fn sync_compute(&self) {
        self.streams.refuse_in_capture(
            "a host wait for the compute stream (a read, or a write not staged; the experts' \
             GEMMs read their row counts back unless GANYMEDE_CUDA_GROUPED=kernel)",
        );
        ok(self.compute().synchronize(), "synchronize");
    }

    /// Copy a view into a host vector of its own dtype (blocking, on the compute stream).
    fn read_raw<T: Default + Clone>(&self, src: &View, dtype: DType) -> Vec<T> {
        let p = place(src);
        assert_eq!(p.dtype, dtype);
        let mut out = vec![T::default(); p.len];
        let dst = Place {
            addr: out.as_mut_ptr() as u64,
            bytes: p.bytes,
            dtype,
            len: p.len,
            uses: None,
            on_device: false,
        };
        self.memcpy(&dst, &p, Stream::Compute);
        self.sync_compute();
        out
    }

    /// Copy host data of the view's dtype into it, on the compute stream, blocking.
    fn write_raw<T: Copy>(&self, dst: &mut ViewMut, data: &[T], dtype: DType) {
        self.write_raw_staged(dst, data, dtype, false)
    }

    /// [`Self::write_raw`], or with `staged` into device memory through a pinned slot without
    /// a host wait where the write is small (`staging`): the step's u32 and f64 writes (ids,
    /// their grouping, routing orders, aux-loss constants). f32 writes (initialisation,
    /// checkpoint loads) stay blocking and keep the slots small.
    fn write_raw_staged<T: Copy>(&self, dst: &mut ViewMut, data: &[T], dtype: DType, staged: bool) {
        let p = place_mut(dst);
        assert_eq!(p.dtype, dtype);
        // SAFETY: T is a plain integer or float; the bytes are read, not kept.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
        };
        if staged && self.stage(&p, bytes) {
            return;
        }
        let src = Place {
            addr: data.as_ptr() as u64,
            bytes: std::mem::size_of_val(data),
            dtype,
            len: data.len(),
            uses: None,
            on_device: false,
        };
        self.memcpy(&p, &src, Stream::Compute);
        self.sync_compute();
    }
}

fn to_f32(dtype: DType, be: &CudaBackend, src: &View) -> Vec<f32> {
    match dtype {
        DType::F32 => be.read_raw::<f32>(src, DType::F32),
        DType::BF16 => bf16::to_f32_slice(&be.read_raw::<u16>(src, DType::BF16)),
        DType::F64 => be
            .read_raw::<f64>(src, DType::F64)
            .into_iter()
            .map(|x| x as f32)
            .collect(),
        DType::U32 => panic!("a u32 view read as f32: use download_u32"),
    }
}

impl Memory for CudaBackend {
    fn device(&self) -> Device {
        Device::Gpu(self.ordinal)
    }
    fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }
    fn zeros(&self, shape: &[usize], category: Category) -> Tensor {
        self.zeros_of(shape, DType::F32, category)
    }
    fn zeros_of(&self, shape: &[usize], dtype: DType, category: Category) -> Tensor {
        self.try_alloc_tensor(shape, dtype, category)
            .unwrap_or_else(|e| panic!("{e}"))
    }
    fn try_zeros(&self, shape: &[usize], category: Category) -> Result<Tensor, MemoryError> {
        self.try_alloc_tensor(shape, DType::F32, category)
    }
    fn upload(&self, data: &[f32], shape: &[usize], category: Category) -> Tensor {
        let mut t = self.zeros(shape, category);
        self.write(t.view_mut(), data);
        t
    }
    fn upload_f64(&self, data: &[f64], shape: &[usize], category: Category) -> Tensor {
        // The backend computes in f32; f64 data is rounded, as its kernels would.
        let v: Vec<f32> = data.iter().map(|&x| x as f32).collect();
        self.upload(&v, shape, category)
    }
    fn download(&self, src: View) -> Vec<f32> {
        to_f32(src.dtype(), self, &src)
    }
    fn download_f64(&self, src: View) -> Vec<f64> {
        match src.dtype() {
            DType::F64 => self.read_raw::<f64>(&src, DType::F64),
            d => to_f32(d, self, &src).into_iter().map(f64::from).collect(),
        }
    }
    fn write(&self, mut dst: ViewMut, data: &[f32]) {
        assert_eq!(dst.len(), data.len(), "write of a different length");
        match dst.dtype() {
            DType::F32 => self.write_raw(&mut dst, data, DType::F32),
            DType::BF16 => self.write_raw(&mut dst, &bf16::from_f32_slice(data), DType::BF16),
            DType::F64 => {
                let v: Vec<f64> = data.iter().map(|&x| f64::from(x)).collect();
                self.write_raw(&mut dst, &v, DType::F64)
            }
            DType::U32 => panic!("f32 data written into a u32 view: use write_u32"),
        }
    }
    fn write_f64(&self, mut dst: ViewMut, data: &[f64]) {
        assert_eq!(dst.len(), data.len(), "write of a different length");
        match dst.dtype() {
            DType::F64 => self.write_raw_staged(&mut dst, data, DType::F64, true),
            _ => self.write(dst, &data.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        }
    }
    fn upload_u32(&self, data: &[u32], shape: &[usize], category: Category) -> Tensor {
        let mut t = self.zeros_of(shape, DType::U32, category);
        self.write_u32(t.view_mut(), data);
        t
    }
    fn write_u32(&self, mut dst: ViewMut, data: &[u32]) {
        assert_eq!(dst.len(), data.len(), "write of a different length");
        assert_eq!(
            dst.dtype(),
            DType::U32,
            "u32 data written into another dtype"
        );
        self.write_raw_staged(&mut dst, data, DType::U32, true)
    }
    fn download_u32(&self, src: View) -> Vec<u32> {
        self.read_raw::<u32>(&src, DType::U32)
    }
    fn copy(&self, mut dst: ViewMut, src: View) {
        self.memcpy(&place_mut(&mut dst), &place(&src), Stream::Compute)
    }
    fn fill(&self, mut dst: ViewMut, value: f32) {
        let p = place_mut(&mut dst);
        if !p.on_device || p.len == 0 {
            // Pinned or ordinary host memory: filled by the CPU once compute is done with it.
            self.sync_compute();
            let v = vec![value; p.len];
            return self.write(dst, &v);
        }
        let s = self.compute().cu_stream();
        self.bind();
        // SAFETY: the range is the view's, inside its allocation.
        let r = unsafe {
            match p.dtype {
                DType::F32 => sys::cuMemsetD32Async(p.addr, value.to_bits(), p.len, s),
                DType::BF16 => sys::cuMemsetD16Async(p.addr, bf16::from_f32(value), p.len, s),
                DType::F64 if value == 0.0 => sys::cuMemsetD8Async(p.addr, 0, p.bytes, s),
                DType::F64 => {
                    // Staged: no host wait (and a graph may hold it, the value being its own).
                    let v = vec![f64::from(value); p.len];
                    self.write_raw_staged(&mut dst, &v, DType::F64, true);
                    sys::CUresult::CUDA_SUCCESS
                }
                DType::U32 => sys::cuMemsetD32Async(p.addr, value as u32, p.len, s),
            }
        };
        ok(r.result(), "fill");
    }
    fn synchronize(&self) {
        self.streams.refuse_in_capture("a host wait (synchronize)");
        ok(self.ctx.synchronize(), "synchronize");
    }
    fn pinned_zeros(&self, shape: &[usize], category: Category) -> Tensor {
        self.pinned_zeros_of(shape, DType::F32, category)
    }
    fn pinned_zeros_of(&self, shape: &[usize], dtype: DType, category: Category) -> Tensor {
        let len: usize = shape.iter().product();
        let bytes = (len * dtype.size()).max(1);
        // Flags 0: not write-combined, so CPU reads of offloaded state are cached reads.
        // SAFETY: zeroed below before anything reads it.
        let mut slice = ok(
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) },
            "pinned allocation",
        );
        let ptr = ok(slice.as_mut_ptr(), "pinned pointer");
        // SAFETY: `bytes` bytes were just allocated at `ptr`.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        let m = PinnedMemory {
            slice: Some(slice),
            ptr,
            dtype,
            len,
            uses: Uses(AtomicU8::new(0)),
            streams: self.streams.clone(),
        };
        Tensor::from_buffer(
            ganymede_core::Buffer::Device(Box::new(m)),
            shape,
            Device::Host,
            category,
            self.ledger.clone(),
        )
    }
    fn copy_async(&self, mut dst: ViewMut, src: View, stream: Stream) {
        let (pd, ps) = (place_mut(&mut dst), place(&src));
        let mut trace = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        let Some(t) = trace.as_mut() else {
            drop(trace);
            return self.memcpy(&pd, &ps, stream);
        };
        let s = self.streams.get(stream);
        let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = ok(s.record_event(timed), "trace event");
        self.memcpy(&pd, &ps, stream);
        let end = ok(s.record_event(timed), "trace event");
        t.pending.push((stream, start, end, ps.bytes as u64));
    }
    fn trace_copies(&self, on: bool) {
        let mut trace = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        *trace = on.then(|| {
            // The base event completes when the host waits for it; its host time is then known
            // to within the wait's return, and copies are placed relative to it.
            let base = ok(
                self.compute()
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)),
                "trace event",
            );
            ok(base.synchronize(), "trace event");
            CopyTrace {
                base,
                base_at: Instant::now(),
                pending: Vec::new(),
            }
        });
    }
    fn take_copy_spans(&self) -> Vec<CopySpan> {
        let mut trace = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        let Some(t) = trace.as_mut() else {
            return Vec::new();
        };
        let at = |e: &CudaEvent| {
            let ms = ok(t.base.elapsed_ms(e), "trace elapsed");
            t.base_at + Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)
        };
        let mut spans = Vec::new();
        let mut still = Vec::new();
        for (stream, start, end, bytes) in std::mem::take(&mut t.pending) {
            if ok(end.try_is_complete(), "trace query") {
                spans.push(CopySpan {
                    stream,
                    start: at(&start),
                    end: at(&end),
                    bytes,
                });
            } else {
                still.push((stream, start, end, bytes));
            }
        }
        t.pending = still;
        spans
    }
    fn record_event(&self, stream: Stream) -> Event {
        let ev = ok(
            self.streams
                .get(stream)
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)),
            "event record",
        );
        Event::new(SeamEvent(ev))
    }
    fn wait_event(&self, stream: Stream, event: &Event) {
        ok(
            self.streams.get(stream).wait(&seam_event(event).0),
            "event wait",
        );
    }
    fn synchronize_event(&self, event: &Event) {
        self.streams
            .refuse_in_capture("a host wait (synchronize_event)");
        ok(seam_event(event).0.synchronize(), "event synchronize");
    }
    fn query_event(&self, event: &Event) -> bool {
        ok(seam_event(event).0.try_is_complete(), "event query")
    }
    fn elapsed(&self, start: &Event, end: &Event) -> Duration {
        let ms = ok(
            seam_event(start).0.elapsed_ms(&seam_event(end).0),
            "elapsed",
        );
        Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)
    }
    fn start_phases(&self) {
        CudaBackend::start_phases(self)
    }
    fn phase(&self, p: StepPhase) -> Option<StepPhase> {
        CudaBackend::phase(self, p)
    }
    fn take_phase_times(&self) -> Option<PhaseTimes> {
        CudaBackend::take_phase_times(self)
    }
    fn graph(&self, key: u64, body: &mut dyn FnMut()) -> ganymede_core::GraphRun {
        CudaBackend::graph(self, key, body)
    }
    fn forget_graph(&self, key: u64) {
        CudaBackend::forget_graph(self, key)
    }
}

fn seam_event(e: &Event) -> &SeamEvent {
    e.downcast::<SeamEvent>()
        .expect("an event recorded by another backend")
}
