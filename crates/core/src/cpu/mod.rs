//! The CPU backend: host memory, f32 compute, GEMM from `matrixmultiply`, threads from rayon.
//! In its two-memory mode ([`CpuBackend::two_memory`]) it emulates a device beside pinned host
//! memory, with asynchronous copies between them (see [`two_memory`]).

mod blas;
mod gemm_avx2;
mod nn;
mod optim;
mod syrk_avx2;
pub mod two_memory;

use crate::backend::Memory;
use crate::bf16;
use crate::ledger::{Category, Device, Ledger};
use crate::phase::{HostClock, PhaseClock, PhaseTimes, StepPhase};
use crate::stream::{CopySpan, Event, MemoryError, Stream};
use crate::tensor::{Buffer, DType, Tensor, View, ViewMut};
pub use blas::{gemm_host, gemm_host_matrixmultiply, syrk_host, syrk_host_strips};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use two_memory::TwoMemory;
pub use two_memory::TwoMemoryOptions;

/// Call a kernel generic over [`crate::Scalar`] at a runtime dtype:
/// `by_dtype!(dtype, kernel(args...))` expands to `kernel::<f32>(args...)` or `kernel::<f64>(..)`.
#[macro_export]
macro_rules! by_dtype {
    ($dt:expr, $f:ident ( $($arg:expr),* $(,)? )) => {
        match $dt {
            $crate::DType::F32 => $f::<f32>($($arg),*),
            $crate::DType::F64 => $f::<f64>($($arg),*),
            $crate::DType::BF16 => panic!("the CPU backend has no bf16 kernels"),
            $crate::DType::U32 => panic!("a u32 tensor where a float one is expected"),
        }
    };
}

/// Elements below which elementwise kernels stay on one thread (thread wake-up costs more).
pub(crate) const PAR_MIN: usize = 1 << 15;

/// The CPU backend. `dtype` is the precision of every tensor it makes: f32 to train, f64 to
/// check gradients by finite differences with the very same model code.
#[derive(Clone)]
pub struct CpuBackend {
    ledger: Arc<Ledger>,
    dtype: DType,
    /// The emulated device and copy streams of the two-memory mode.
    two: Option<Arc<TwoMemory>>,
    /// f32 scratch for the A and B operands of bf16-input GEMMs, holding them rounded to bf16:
    /// grown to the largest operand seen (the first step), then reused.
    bf16_scratch: Arc<Mutex<[crate::CastSlot; 2]>>,
    /// f32 scratch for the product of a bf16-input GEMM with a bf16 C, rounded from there:
    /// grown to the longest C view seen, then reused.
    bf16_out: Arc<Mutex<Option<Tensor>>>,
    /// Whether [`crate::Gemm::unchanged`] lets a cast be reused (the default); without, every
    /// bf16-input GEMM casts its operands, the bits every promise must keep (tests hold the
    /// model's promises to that).
    cast_promises: bool,
    /// The step's phase clock: the wall clock, kernels running on the calling thread.
    phases: Arc<Mutex<PhaseClock<Instant>>>,
}

impl CpuBackend {
    fn try_zeros_of(
        &self,
        shape: &[usize],
        dtype: DType,
        category: Category,
    ) -> Result<Tensor, MemoryError> {
        if let Some(two) = &self.two {
            return two.alloc(&self.ledger, two_memory::DEVICE, shape, category, dtype);
        }
        let n = shape.iter().product();
        let buf = match dtype {
            DType::F32 => Buffer::Host(vec![0.0; n]),
            DType::F64 => Buffer::Host64(vec![0.0; n]),
            DType::BF16 => Buffer::HostBf16(vec![0; n]),
            DType::U32 => Buffer::HostU32(vec![0; n]),
        };
        Ok(self.tensor(buf, shape, category))
    }

    pub fn new(ledger: Arc<Ledger>) -> Self {
        Self {
            ledger,
            dtype: DType::F32,
            two: None,
            bf16_scratch: Default::default(),
            bf16_out: Default::default(),
            cast_promises: true,
            phases: Default::default(),
        }
    }
    /// An f64 backend, for gradient checks.
    pub fn new_f64(ledger: Arc<Ledger>) -> Self {
        Self {
            ledger,
            dtype: DType::F64,
            two: None,
            bf16_scratch: Default::default(),
            bf16_out: Default::default(),
            cast_promises: true,
            phases: Default::default(),
        }
    }
    /// An f32 backend with two memories, as a GPU has: `zeros`/`upload` allocate on an
    /// emulated device ([`Device::Gpu`]`(0)`, in host RAM, within `device_capacity`),
    /// `pinned_zeros` in host memory ([`Device::Host`]), and `copy_async` between them runs on
    /// a thread per copy stream. Kernels run on the calling thread as the compute stream. With
    /// `checking`, an access not ordered after the copies it depends on panics.
    pub fn two_memory(ledger: Arc<Ledger>, options: TwoMemoryOptions) -> Self {
        Self {
            ledger,
            dtype: DType::F32,
            two: Some(Arc::new(TwoMemory::new(options))),
            bf16_scratch: Default::default(),
            bf16_out: Default::default(),
            cast_promises: true,
            phases: Default::default(),
        }
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// This backend with [`crate::Gemm::unchanged`] honoured (`true`, the default) or ignored.
    pub fn with_cast_promises(mut self, on: bool) -> Self {
        self.cast_promises = on;
        self
    }
    fn tensor(&self, buf: Buffer, shape: &[usize], category: Category) -> Tensor {
        Tensor::from_buffer(buf, shape, Device::Host, category, self.ledger.clone())
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new(Arc::new(Ledger::new()))
    }
}

impl Memory for CpuBackend {
    fn device(&self) -> Device {
        match self.two {
            Some(_) => two_memory::DEVICE,
            None => Device::Host,
        }
    }
    fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }
    fn zeros(&self, shape: &[usize], category: Category) -> Tensor {
        self.try_zeros(shape, category)
            .unwrap_or_else(|e| panic!("{e}"))
    }
    fn try_zeros(&self, shape: &[usize], category: Category) -> Result<Tensor, MemoryError> {
        self.try_zeros_of(shape, self.dtype, category)
    }
    fn zeros_of(&self, shape: &[usize], dtype: DType, category: Category) -> Tensor {
        self.try_zeros_of(shape, dtype, category)
            .unwrap_or_else(|e| panic!("{e}"))
    }
    fn pinned_zeros(&self, shape: &[usize], category: Category) -> Tensor {
        self.pinned_zeros_of(shape, self.dtype, category)
    }
    fn pinned_zeros_of(&self, shape: &[usize], dtype: DType, category: Category) -> Tensor {
        match &self.two {
            Some(two) => two
                .alloc(&self.ledger, Device::Host, shape, category, dtype)
                .unwrap_or_else(|e| panic!("{e}")),
            None => self.zeros_of(shape, dtype, category),
        }
    }
    fn upload(&self, data: &[f32], shape: &[usize], category: Category) -> Tensor {
        if let Some(two) = &self.two {
            return two.upload(&self.ledger, data, shape, category, DType::F32);
        }
        let buf = match self.dtype {
            DType::F32 => Buffer::Host(data.to_vec()),
            DType::F64 => Buffer::Host64(data.iter().map(|&x| x as f64).collect()),
            DType::BF16 => Buffer::HostBf16(bf16::from_f32_slice(data)),
            DType::U32 => unreachable!("a backend's precision is a float type"),
        };
        self.tensor(buf, shape, category)
    }
    fn upload_f64(&self, data: &[f64], shape: &[usize], category: Category) -> Tensor {
        if self.two.is_some() {
            let d: Vec<f32> = data.iter().map(|&x| x as f32).collect();
            return self.upload(&d, shape, category);
        }
        let buf = match self.dtype {
            DType::F32 => Buffer::Host(data.iter().map(|&x| x as f32).collect()),
            DType::F64 => Buffer::Host64(data.to_vec()),
            DType::BF16 => {
                Buffer::HostBf16(data.iter().map(|&x| bf16::from_f32(x as f32)).collect())
            }
            DType::U32 => unreachable!("a backend's precision is a float type"),
        };
        self.tensor(buf, shape, category)
    }
    // The transfers below go through `host()`, which also reaches the two-memory mode's
    // emulated buffers (and checks the access there).
    fn download(&self, src: View) -> Vec<f32> {
        match src.dtype() {
            DType::F32 => src.host::<f32>().to_vec(),
            DType::F64 => src.host::<f64>().iter().map(|&x| x as f32).collect(),
            DType::BF16 => bf16::to_f32_slice(src.host_bf16()),
            DType::U32 => panic!("download of a u32 view: use download_u32"),
        }
    }
    fn download_f64(&self, src: View) -> Vec<f64> {
        match src.dtype() {
            DType::F32 => src.host::<f32>().iter().map(|&x| x as f64).collect(),
            DType::F64 => src.host::<f64>().to_vec(),
            DType::BF16 => src
                .host_bf16()
                .iter()
                .map(|&h| bf16::to_f32(h) as f64)
                .collect(),
            DType::U32 => panic!("download of a u32 view: use download_u32"),
        }
    }
    fn write(&self, dst: ViewMut, data: &[f32]) {
        match dst.dtype() {
            DType::F32 => dst.host::<f32>().copy_from_slice(data),
            DType::F64 => dst
                .host::<f64>()
                .iter_mut()
                .zip(data)
                .for_each(|(d, &s)| *d = s as f64),
            DType::BF16 => dst
                .host_bf16()
                .iter_mut()
                .zip(data)
                .for_each(|(d, &s)| *d = bf16::from_f32(s)),
            DType::U32 => panic!("write to a u32 view: use write_u32"),
        }
    }
    fn write_f64(&self, dst: ViewMut, data: &[f64]) {
        dst.host::<f64>().copy_from_slice(data)
    }
    fn upload_u32(&self, data: &[u32], shape: &[usize], category: Category) -> Tensor {
        match &self.two {
            Some(two) => two.upload(&self.ledger, data, shape, category, DType::U32),
            None => self.tensor(Buffer::HostU32(data.to_vec()), shape, category),
        }
    }
    fn write_u32(&self, dst: ViewMut, data: &[u32]) {
        dst.host_u32().copy_from_slice(data)
    }
    fn download_u32(&self, src: View) -> Vec<u32> {
        src.host_u32().to_vec()
    }
    fn copy(&self, dst: ViewMut, src: View) {
        assert_eq!(dst.dtype(), src.dtype(), "copy between different dtypes");
        match dst.dtype() {
            DType::F32 => dst.host::<f32>().copy_from_slice(src.host::<f32>()),
            DType::F64 => dst.host::<f64>().copy_from_slice(src.host::<f64>()),
            DType::BF16 => dst.host_bf16().copy_from_slice(src.host_bf16()),
            DType::U32 => dst.host_u32().copy_from_slice(src.host_u32()),
        }
    }
    fn fill(&self, dst: ViewMut, value: f32) {
        match dst.dtype() {
            DType::F32 => dst.host::<f32>().fill(value),
            DType::F64 => dst.host::<f64>().fill(value as f64),
            DType::BF16 => dst.host_bf16().fill(bf16::from_f32(value)),
            DType::U32 => dst.host_u32().fill(value as u32),
        }
    }
    fn synchronize(&self) {
        if let Some(two) = &self.two {
            two.synchronize()
        }
    }
    fn copy_async(&self, dst: ViewMut, src: View, stream: Stream) {
        match &self.two {
            Some(two) => two.copy_async(dst, src, stream),
            None => self.copy(dst, src),
        }
    }
    fn record_event(&self, stream: Stream) -> Event {
        match &self.two {
            Some(two) => two.record_event(stream).into_event(),
            None => Event::completed_now(),
        }
    }
    fn wait_event(&self, stream: Stream, event: &Event) {
        if let Some(two) = &self.two {
            two.wait_event(stream, event)
        }
    }
    fn synchronize_event(&self, event: &Event) {
        if let Some(two) = &self.two {
            two.synchronize_event(event)
        }
    }
    fn query_event(&self, event: &Event) -> bool {
        self.two.as_ref().is_none_or(|two| two.query_event(event))
    }
    fn elapsed(&self, start: &Event, end: &Event) -> Duration {
        match &self.two {
            Some(two) => two.elapsed(start, end),
            None => Event::completed_elapsed(start, end).expect("events of another backend"),
        }
    }
    fn trace_copies(&self, on: bool) {
        if let Some(two) = &self.two {
            two.trace_copies(on)
        }
    }
    fn take_copy_spans(&self) -> Vec<CopySpan> {
        self.two
            .as_ref()
            .map_or_else(Vec::new, |two| two.take_copy_spans())
    }
    fn start_phases(&self) {
        self.phase_clock().start(&HostClock)
    }
    fn phase(&self, p: StepPhase) -> Option<StepPhase> {
        self.phase_clock().mark(&HostClock, p)
    }
    fn take_phase_times(&self) -> Option<PhaseTimes> {
        self.phase_clock().take(&HostClock)
    }
}

impl CpuBackend {
    fn phase_clock(&self) -> std::sync::MutexGuard<'_, PhaseClock<Instant>> {
        self.phases.lock().unwrap_or_else(|e| e.into_inner())
    }
}
