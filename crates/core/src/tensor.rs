//! Tensors: a device buffer with a shape and a ledger category, and borrowed views of a range
//! of it ([`View`], [`ViewMut`]) that backend operations take, like llm.c's pointers plus sizes.
//!
//! Host memory is a closed set of variants (`Host`, `Host64`, `HostBf16`, `HostU32`); memory that only a
//! backend understands (a CUDA device slice, pinned host memory, the CPU backend's emulated
//! device memory) is an open [`DeviceBuffer`] trait object, so a backend in its own crate can
//! put its memory in a [`Tensor`] without editing these enums. Views of such memory are
//! [`DeviceView`]/[`DeviceViewMut`]: the buffer, an element offset and a length.

use crate::ledger::{Category, Device, Ledger};
use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

/// Memory behind a tensor. `Host64` is host memory in f64: the same model code runs on it for
/// finite-difference checks. `HostBf16` holds bf16 bit patterns (see [`crate::bf16`]).
pub enum Buffer {
    Host(Vec<f32>),
    Host64(Vec<f64>),
    HostBf16(Vec<u16>),
    /// Integer indices (token ids, routing decisions).
    HostU32(Vec<u32>),
    /// Memory owned by a backend (see [`DeviceBuffer`]).
    Device(Box<dyn DeviceBuffer>),
}

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    /// bfloat16: f32's exponent with 7 mantissa bits; stored on the host as `u16` bits.
    BF16,
    /// Unsigned 32-bit integers: index tensors (token ids, routing) that kernels read.
    U32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::BF16 => 2,
            DType::U32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::U32 => "u32",
        }
    }
}

/// Memory that a backend owns: device memory of a GPU, pinned host memory, the CPU backend's
/// emulated device memory. A backend downcasts through [`DeviceBuffer::as_any`] to its own type
/// in its kernels; everything else only needs the element type and count.
pub trait DeviceBuffer: Send + Sync + 'static {
    fn dtype(&self) -> DType;
    /// Number of elements.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The backend's concrete type.
    fn as_any(&self) -> &dyn Any;
    /// The host address of element 0 for memory the CPU can address (pinned or emulated memory),
    /// `None` for memory it cannot (a GPU's). Called once per host access of a view, after which
    /// the caller reads (or, with `write`, writes) through it: a backend may check the access
    /// against its streams here, and wait for copies in flight. The memory must be aligned for
    /// the dtype and live as long as the buffer.
    fn host_ptr(&self, write: bool) -> Option<*mut u8> {
        let _ = write;
        None
    }
    /// A short description for error messages (device, category, size).
    fn describe(&self) -> String {
        format!("{} {} elements", self.dtype().name(), self.len())
    }
}

impl Buffer {
    fn len(&self) -> usize {
        match self {
            Buffer::Host(v) => v.len(),
            Buffer::Host64(v) => v.len(),
            Buffer::HostBf16(v) => v.len(),
            Buffer::HostU32(v) => v.len(),
            Buffer::Device(b) => b.len(),
        }
    }
    fn dtype(&self) -> DType {
        match self {
            Buffer::Host(_) => DType::F32,
            Buffer::Host64(_) => DType::F64,
            Buffer::HostBf16(_) => DType::BF16,
            Buffer::HostU32(_) => DType::U32,
            Buffer::Device(b) => b.dtype(),
        }
    }
}

/// An owned tensor, charged to the ledger for as long as it lives. Its buffer may be longer
/// than its shape ([`Tensor::padded_to`]): views show the shape's elements, and
/// [`Tensor::padded_view_mut`] the whole buffer (a collective's padded rows live there).
pub struct Tensor {
    buf: Buffer,
    shape: Vec<usize>,
    /// Elements of the shape (at most the buffer's).
    len: usize,
    device: Device,
    category: Category,
    ledger: Arc<Ledger>,
}

impl Tensor {
    /// Wrap a buffer; backends call this from their allocation functions.
    pub fn from_buffer(
        buf: Buffer,
        shape: &[usize],
        device: Device,
        category: Category,
        ledger: Arc<Ledger>,
    ) -> Self {
        assert_eq!(
            buf.len(),
            shape.iter().product::<usize>(),
            "buffer/shape mismatch"
        );
        ledger.alloc(device, category, (buf.len() * buf.dtype().size()) as u64);
        Self::from_charged_buffer(buf, shape, device, category, ledger)
    }

    /// Wrap a buffer whose bytes the caller has already charged to `ledger` (with
    /// [`Ledger::try_alloc`], which checks a capacity before the memory is allocated). The
    /// tensor frees them when dropped, as for [`Tensor::from_buffer`].
    pub fn from_charged_buffer(
        buf: Buffer,
        shape: &[usize],
        device: Device,
        category: Category,
        ledger: Arc<Ledger>,
    ) -> Self {
        assert_eq!(
            buf.len(),
            shape.iter().product::<usize>(),
            "buffer/shape mismatch"
        );
        Self {
            len: buf.len(),
            buf,
            shape: shape.to_vec(),
            device,
            category,
            ledger,
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Elements of the shape.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes of the buffer, padding included (what the ledger is charged).
    pub fn bytes(&self) -> usize {
        self.buf.len() * self.buf.dtype().size()
    }
    /// Elements of the buffer, padding included.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// This buffer seen as `shape`, whose elements may be fewer than the buffer's: the rest is
    /// padding, outside every view but [`Tensor::padded_view`] / [`Tensor::padded_view_mut`].
    /// An FSDP gather receives, and a reduce-scatter sends, the padded rows of a tensor whose
    /// rows do not split evenly over the ranks, with no second buffer and no copy.
    pub fn padded_to(mut self, shape: &[usize]) -> Self {
        let n = shape.iter().product::<usize>();
        assert!(
            n <= self.buf.len(),
            "shape {shape:?} is larger than the buffer ({} elements)",
            self.buf.len()
        );
        self.shape = shape.to_vec();
        self.len = n;
        self
    }
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn category(&self) -> Category {
        self.category
    }
    /// The backend's buffer, for backends that keep their memory in a [`DeviceBuffer`].
    pub fn device_buffer(&self) -> Option<&dyn DeviceBuffer> {
        match &self.buf {
            Buffer::Device(b) => Some(&**b),
            _ => None,
        }
    }

    /// Reinterpret the shape (same number of elements).
    pub fn reshape(&mut self, shape: &[usize]) {
        assert_eq!(
            shape.iter().product::<usize>(),
            self.len(),
            "reshape changes size"
        );
        self.shape = shape.to_vec();
    }

    /// A view of the whole tensor.
    pub fn view(&self) -> View<'_> {
        self.padded_view().slice(0, self.len)
    }
    /// A mutable view of the whole tensor.
    pub fn view_mut(&mut self) -> ViewMut<'_> {
        let n = self.len;
        self.padded_view_mut().slice(0, n)
    }
    /// A view of the whole buffer, padding included.
    pub fn padded_view(&self) -> View<'_> {
        match &self.buf {
            Buffer::Host(v) => View::Host(v),
            Buffer::Host64(v) => View::Host64(v),
            Buffer::HostBf16(v) => View::HostBf16(v),
            Buffer::HostU32(v) => View::HostU32(v),
            Buffer::Device(b) => View::Device(DeviceView {
                buf: &**b,
                offset: 0,
                len: b.len(),
            }),
        }
    }
    /// A mutable view of the whole buffer, padding included.
    pub fn padded_view_mut(&mut self) -> ViewMut<'_> {
        match &mut self.buf {
            Buffer::Host(v) => ViewMut::Host(v),
            Buffer::Host64(v) => ViewMut::Host64(v),
            Buffer::HostBf16(v) => ViewMut::HostBf16(v),
            Buffer::HostU32(v) => ViewMut::HostU32(v),
            Buffer::Device(b) => ViewMut::Device(DeviceViewMut {
                buf: &**b,
                offset: 0,
                len: b.len(),
                _unique: PhantomData,
            }),
        }
    }
    /// A view of elements `off .. off + len`.
    pub fn slice(&self, off: usize, len: usize) -> View<'_> {
        self.view().slice(off, len)
    }
    pub fn slice_mut(&mut self, off: usize, len: usize) -> ViewMut<'_> {
        self.view_mut().slice(off, len)
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        self.ledger
            .free(self.device, self.category, self.bytes() as u64);
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({:?}, {}, {:?})",
            self.shape, self.device, self.category
        )
    }
}

/// A read-only view of a contiguous range of memory.
#[derive(Clone, Copy)]
pub enum View<'a> {
    Host(&'a [f32]),
    Host64(&'a [f64]),
    HostBf16(&'a [u16]),
    HostU32(&'a [u32]),
    Device(DeviceView<'a>),
}

/// A mutable view of a contiguous range of memory.
pub enum ViewMut<'a> {
    Host(&'a mut [f32]),
    Host64(&'a mut [f64]),
    HostBf16(&'a mut [u16]),
    HostU32(&'a mut [u32]),
    Device(DeviceViewMut<'a>),
}

/// Elements `offset .. offset + len` of a backend's buffer, read-only.
#[derive(Clone, Copy)]
pub struct DeviceView<'a> {
    buf: &'a dyn DeviceBuffer,
    offset: usize,
    len: usize,
}

/// Elements `offset .. offset + len` of a backend's buffer, exclusively. Made only from a
/// `&mut Tensor` (and split into disjoint ranges), so it is unique like `&mut [f32]`; the buffer
/// is reached through a shared reference because device memory is written through a pointer
/// (a CUDA device pointer, or an `UnsafeCell` in the CPU backend's emulated memory).
pub struct DeviceViewMut<'a> {
    buf: &'a dyn DeviceBuffer,
    offset: usize,
    len: usize,
    _unique: PhantomData<&'a mut ()>,
}

impl<'a> DeviceView<'a> {
    pub fn buffer(&self) -> &'a dyn DeviceBuffer {
        self.buf
    }
    /// First element, counted in elements of the dtype.
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }
    fn slice(self, off: usize, len: usize) -> Self {
        assert!(off + len <= self.len, "view slice out of range");
        Self {
            offset: self.offset + off,
            len,
            ..self
        }
    }
    /// The elements as host memory, after the backend's access checks (panics if the buffer is
    /// not host-addressable or holds another dtype).
    fn host_elems<S: Copy + 'static>(self, dtype: DType) -> &'a [S] {
        let p = host_ptr_of(self.buf, dtype, false);
        // SAFETY: `host_ptr` points at `buf.len()` elements of `dtype` (= S, checked) that live
        // as long as the buffer, which outlives 'a; the range is inside the buffer.
        unsafe { std::slice::from_raw_parts((p as *const S).add(self.offset), self.len) }
    }
}

impl<'a> DeviceViewMut<'a> {
    pub fn buffer(&self) -> &'a dyn DeviceBuffer {
        self.buf
    }
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }
    fn host_elems<S: Copy + 'static>(self, dtype: DType) -> &'a mut [S] {
        let p = host_ptr_of(self.buf, dtype, true);
        // SAFETY: as for `DeviceView::host_elems`; the view is unique over its range (it comes
        // from a `&mut Tensor`), and the memory sits behind an `UnsafeCell` or a raw pointer.
        unsafe { std::slice::from_raw_parts_mut((p as *mut S).add(self.offset), self.len) }
    }
}

fn host_ptr_of(buf: &dyn DeviceBuffer, dtype: DType, write: bool) -> *mut u8 {
    assert_eq!(
        buf.dtype(),
        dtype,
        "expected a {} view of {}",
        dtype.name(),
        buf.describe()
    );
    buf.host_ptr(write).unwrap_or_else(|| {
        panic!(
            "{} is not host memory: use the backend's kernels and copies",
            buf.describe()
        )
    })
}

/// Host element types that kernels are written over (`f32` to train, `f64` to check gradients).
pub trait Scalar:
    num_traits::Float
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + std::ops::DivAssign
    + std::iter::Sum
    + Default
    + Send
    + Sync
    + std::fmt::Debug
    + 'static
{
    const DTYPE: DType;
    fn of(v: View<'_>) -> &[Self];
    fn of_mut(v: ViewMut<'_>) -> &mut [Self];
    fn of_f64(x: f64) -> Self;
    fn as_f64(self) -> f64;
}

impl Scalar for f32 {
    const DTYPE: DType = DType::F32;
    fn of(v: View<'_>) -> &[f32] {
        match v {
            View::Host(s) => s,
            View::Device(d) => d.host_elems(DType::F32),
            _ => panic!("expected an f32 host view"),
        }
    }
    fn of_mut(v: ViewMut<'_>) -> &mut [f32] {
        match v {
            ViewMut::Host(s) => s,
            ViewMut::Device(d) => d.host_elems(DType::F32),
            _ => panic!("expected an f32 host view"),
        }
    }
    fn of_f64(x: f64) -> f32 {
        x as f32
    }
    fn as_f64(self) -> f64 {
        self as f64
    }
}

impl Scalar for f64 {
    const DTYPE: DType = DType::F64;
    fn of(v: View<'_>) -> &[f64] {
        match v {
            View::Host64(s) => s,
            View::Device(d) => d.host_elems(DType::F64),
            _ => panic!("expected an f64 host view"),
        }
    }
    fn of_mut(v: ViewMut<'_>) -> &mut [f64] {
        match v {
            ViewMut::Host64(s) => s,
            ViewMut::Device(d) => d.host_elems(DType::F64),
            _ => panic!("expected an f64 host view"),
        }
    }
    fn of_f64(x: f64) -> f64 {
        x
    }
    fn as_f64(self) -> f64 {
        self
    }
}

impl<'a> View<'a> {
    pub fn len(&self) -> usize {
        match self {
            View::Host(s) => s.len(),
            View::Host64(s) => s.len(),
            View::HostBf16(s) => s.len(),
            View::HostU32(s) => s.len(),
            View::Device(d) => d.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            View::Host(_) => DType::F32,
            View::Host64(_) => DType::F64,
            View::HostBf16(_) => DType::BF16,
            View::HostU32(_) => DType::U32,
            View::Device(d) => d.dtype(),
        }
    }
    /// Elements `off .. off + len` of this view.
    pub fn slice(self, off: usize, len: usize) -> View<'a> {
        match self {
            View::Host(s) => View::Host(&s[off..off + len]),
            View::Host64(s) => View::Host64(&s[off..off + len]),
            View::HostBf16(s) => View::HostBf16(&s[off..off + len]),
            View::HostU32(s) => View::HostU32(&s[off..off + len]),
            View::Device(d) => View::Device(d.slice(off, len)),
        }
    }
    /// The host memory behind this view, as `S` (panics on another dtype or memory the host
    /// cannot address). Only the CPU backend's kernels use it; code above the seam goes through
    /// `Memory`.
    pub fn host<S: Scalar>(self) -> &'a [S] {
        S::of(self)
    }
    /// The bf16 bits behind a bf16 view of host-addressable memory.
    pub fn host_bf16(self) -> &'a [u16] {
        match self {
            View::HostBf16(s) => s,
            View::Device(d) => d.host_elems(DType::BF16),
            _ => panic!("expected a bf16 host view"),
        }
    }
    /// The integers behind a u32 view of host-addressable memory.
    pub fn host_u32(self) -> &'a [u32] {
        match self {
            View::HostU32(s) => s,
            View::Device(d) => d.host_elems(DType::U32),
            _ => panic!("expected a u32 host view"),
        }
    }
}

impl<'a> ViewMut<'a> {
    pub fn len(&self) -> usize {
        match self {
            ViewMut::Host(s) => s.len(),
            ViewMut::Host64(s) => s.len(),
            ViewMut::HostBf16(s) => s.len(),
            ViewMut::HostU32(s) => s.len(),
            ViewMut::Device(d) => d.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            ViewMut::Host(_) => DType::F32,
            ViewMut::Host64(_) => DType::F64,
            ViewMut::HostBf16(_) => DType::BF16,
            ViewMut::HostU32(_) => DType::U32,
            ViewMut::Device(d) => d.dtype(),
        }
    }
    pub fn slice(self, off: usize, len: usize) -> ViewMut<'a> {
        match self {
            ViewMut::Host(s) => ViewMut::Host(&mut s[off..off + len]),
            ViewMut::Host64(s) => ViewMut::Host64(&mut s[off..off + len]),
            ViewMut::HostBf16(s) => ViewMut::HostBf16(&mut s[off..off + len]),
            ViewMut::HostU32(s) => ViewMut::HostU32(&mut s[off..off + len]),
            ViewMut::Device(d) => {
                assert!(off + len <= d.len, "view slice out of range");
                ViewMut::Device(DeviceViewMut {
                    offset: d.offset + off,
                    len,
                    ..d
                })
            }
        }
    }
    /// Reborrow, to pass a view on without giving it up.
    pub fn reborrow(&mut self) -> ViewMut<'_> {
        match self {
            ViewMut::Host(s) => ViewMut::Host(s),
            ViewMut::Host64(s) => ViewMut::Host64(s),
            ViewMut::HostBf16(s) => ViewMut::HostBf16(s),
            ViewMut::HostU32(s) => ViewMut::HostU32(s),
            ViewMut::Device(d) => ViewMut::Device(DeviceViewMut {
                buf: d.buf,
                offset: d.offset,
                len: d.len,
                _unique: PhantomData,
            }),
        }
    }
    /// A read-only view of the same memory, for as long as this one's borrow.
    pub fn into_view(self) -> View<'a> {
        match self {
            ViewMut::Host(s) => View::Host(s),
            ViewMut::Host64(s) => View::Host64(s),
            ViewMut::HostBf16(s) => View::HostBf16(s),
            ViewMut::HostU32(s) => View::HostU32(s),
            ViewMut::Device(d) => View::Device(DeviceView {
                buf: d.buf,
                offset: d.offset,
                len: d.len,
            }),
        }
    }
    /// A read-only view of the same memory.
    pub fn as_view(&self) -> View<'_> {
        match self {
            ViewMut::Host(s) => View::Host(s),
            ViewMut::Host64(s) => View::Host64(s),
            ViewMut::HostBf16(s) => View::HostBf16(s),
            ViewMut::HostU32(s) => View::HostU32(s),
            ViewMut::Device(d) => View::Device(DeviceView {
                buf: d.buf,
                offset: d.offset,
                len: d.len,
            }),
        }
    }
    /// Split into two disjoint views at `mid`.
    pub fn split_at(self, mid: usize) -> (ViewMut<'a>, ViewMut<'a>) {
        match self {
            ViewMut::Host(s) => {
                let (a, b) = s.split_at_mut(mid);
                (ViewMut::Host(a), ViewMut::Host(b))
            }
            ViewMut::Host64(s) => {
                let (a, b) = s.split_at_mut(mid);
                (ViewMut::Host64(a), ViewMut::Host64(b))
            }
            ViewMut::HostBf16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (ViewMut::HostBf16(a), ViewMut::HostBf16(b))
            }
            ViewMut::HostU32(s) => {
                let (a, b) = s.split_at_mut(mid);
                (ViewMut::HostU32(a), ViewMut::HostU32(b))
            }
            ViewMut::Device(d) => {
                assert!(mid <= d.len, "split point out of range");
                let a = DeviceViewMut {
                    buf: d.buf,
                    offset: d.offset,
                    len: mid,
                    _unique: PhantomData,
                };
                let b = DeviceViewMut {
                    offset: d.offset + mid,
                    len: d.len - mid,
                    ..d
                };
                (ViewMut::Device(a), ViewMut::Device(b))
            }
        }
    }
    /// See [`View::host`].
    pub fn host<S: Scalar>(self) -> &'a mut [S] {
        S::of_mut(self)
    }
    /// See [`View::host_bf16`].
    pub fn host_bf16(self) -> &'a mut [u16] {
        match self {
            ViewMut::HostBf16(s) => s,
            ViewMut::Device(d) => d.host_elems(DType::BF16),
            _ => panic!("expected a bf16 host view"),
        }
    }
    /// See [`View::host_u32`].
    pub fn host_u32(self) -> &'a mut [u32] {
        match self {
            ViewMut::HostU32(s) => s,
            ViewMut::Device(d) => d.host_elems(DType::U32),
            _ => panic!("expected a u32 host view"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Memory;
    use crate::CpuBackend;

    /// What a CUDA backend in another crate would hold: memory the host cannot address.
    struct FakeGpu {
        dtype: DType,
        len: usize,
        handle: u64,
    }

    impl DeviceBuffer for FakeGpu {
        fn dtype(&self) -> DType {
            self.dtype
        }
        fn len(&self) -> usize {
            self.len
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    #[test]
    fn foreign_device_buffer_in_tensor_and_views() {
        let ledger = Arc::new(Ledger::new());
        let gpu = Device::Gpu(1);
        let fake = FakeGpu {
            dtype: DType::BF16,
            len: 10,
            handle: 0xdead,
        };
        let mut t = Tensor::from_buffer(
            Buffer::Device(Box::new(fake)),
            &[2, 5],
            gpu,
            Category::Params,
            ledger.clone(),
        );
        assert_eq!((t.dtype(), t.bytes()), (DType::BF16, 20));
        assert_eq!(ledger.report().current(gpu, Category::Params), 20);
        let View::Device(v) = t.slice(2, 5) else {
            panic!("a device view")
        };
        assert_eq!((v.offset(), v.len(), v.dtype()), (2, 5, DType::BF16));
        let handle = |b: &dyn DeviceBuffer| b.as_any().downcast_ref::<FakeGpu>().unwrap().handle;
        assert_eq!(handle(v.buffer()), 0xdead);
        let (a, b) = t.view_mut().split_at(3);
        let (ViewMut::Device(a), ViewMut::Device(b)) = (a, b.slice(1, 2)) else {
            panic!("device views")
        };
        assert_eq!((a.offset(), a.len(), b.offset(), b.len()), (0, 3, 4, 2));
        assert_eq!(handle(b.buffer()), 0xdead);
        // Host access of memory the host cannot address is refused, naming it.
        let msg = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            t.view().host_bf16();
        }))
        .expect_err("not host memory");
        let msg = msg.downcast_ref::<String>().unwrap();
        assert!(msg.contains("bf16 10 elements is not host memory"), "{msg}");
        drop(t);
        assert_eq!(ledger.report().current(gpu, Category::Params), 0);
    }

    #[test]
    fn a_padded_tensor_shows_its_shape_and_charges_its_buffer() {
        let be = CpuBackend::default();
        let mut t = be.zeros(&[7], Category::Grads).padded_to(&[2, 3]);
        assert_eq!(
            (t.shape(), t.len(), t.capacity(), t.bytes()),
            (&[2, 3][..], 6, 7, 28)
        );
        assert_eq!(
            be.ledger().report().current(Device::Host, Category::Grads),
            28
        );
        be.fill(t.view_mut(), 1.0);
        // The view stops at the shape; the padding is untouched until written through the
        // padded view.
        assert_eq!(be.download(t.view()), [1.0; 6]);
        assert_eq!(be.download(t.padded_view()), [1., 1., 1., 1., 1., 1., 0.]);
        be.fill(t.padded_view_mut().slice(6, 1), 5.0);
        assert_eq!(be.download(t.view()).len(), 6);
        assert_eq!(be.download(t.padded_view())[6], 5.0);
        let too_large =
            std::panic::catch_unwind(|| be.zeros(&[5], Category::Grads).padded_to(&[2, 3]));
        assert!(too_large.is_err());
        drop(t);
        assert_eq!(
            be.ledger().report().current(Device::Host, Category::Grads),
            0
        );
    }

    #[test]
    fn host_bf16_tensor_through_cpu_memory_ops() {
        let be = CpuBackend::default();
        let x = [1.0f32, 1.0 + 2f32.powi(-8), 0.1, -3.0e38, 70000.0];
        let bits = crate::bf16::from_f32_slice(&x);
        let mut t = Tensor::from_buffer(
            Buffer::HostBf16(bits),
            &[5],
            Device::Host,
            Category::Params,
            be.ledger().clone(),
        );
        assert_eq!(
            be.ledger().report().current(Device::Host, Category::Params),
            10
        );
        // 1 + 2^-8 is a tie and rounds to even (1.0); 0.1 rounds up; 70000 to 70144.
        let want = [
            1.0f32,
            1.0,
            f32::from_bits(0x3dcd_0000),
            f32::from_bits(0xff62_0000),
            70144.0,
        ];
        assert_eq!(be.download(t.view()), want);
        be.write(t.slice_mut(1, 1), &[2.0]);
        be.fill(t.slice_mut(4, 1), -0.5);
        assert_eq!(t.view().host_bf16()[1..], [0x4000, 0x3dcd, 0xff62, 0xbf00]);
        let mut u = Tensor::from_buffer(
            Buffer::HostBf16(vec![0; 5]),
            &[5],
            Device::Host,
            Category::Params,
            be.ledger().clone(),
        );
        be.copy(u.view_mut(), t.view());
        assert_eq!(u.view().host_bf16(), t.view().host_bf16());
    }
}
