//! Tensors: a device buffer with a shape and a ledger category, and borrowed views of a range
//! of it ([`T`], [`TMut`]) that backend operations take, like llm.c's pointers plus sizes.

use crate::ledger::{Category, Device, Ledger};
use std::sync::Arc;

/// Device memory. A GPU backend adds variants (a cudarc device slice, pinned host memory).
/// `Host64` is host memory in f64: the same model code runs on it for finite-difference checks.
pub enum Buffer {
    Host(Vec<f32>),
    Host64(Vec<f64>),
}

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }
}

impl Buffer {
    fn len(&self) -> usize {
        match self {
            Buffer::Host(v) => v.len(),
            Buffer::Host64(v) => v.len(),
        }
    }
    fn dtype(&self) -> DType {
        match self {
            Buffer::Host(_) => DType::F32,
            Buffer::Host64(_) => DType::F64,
        }
    }
}

/// An owned f32 tensor, charged to the ledger for as long as it lives.
pub struct Tensor {
    buf: Buffer,
    shape: Vec<usize>,
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
        Self {
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
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn bytes(&self) -> usize {
        self.len() * self.buf.dtype().size()
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
    pub fn v(&self) -> T<'_> {
        match &self.buf {
            Buffer::Host(v) => T::Host(v),
            Buffer::Host64(v) => T::Host64(v),
        }
    }
    /// A mutable view of the whole tensor.
    pub fn vm(&mut self) -> TMut<'_> {
        match &mut self.buf {
            Buffer::Host(v) => TMut::Host(v),
            Buffer::Host64(v) => TMut::Host64(v),
        }
    }
    /// A view of elements `off .. off + len`.
    pub fn slice(&self, off: usize, len: usize) -> T<'_> {
        self.v().slice(off, len)
    }
    pub fn slice_mut(&mut self, off: usize, len: usize) -> TMut<'_> {
        self.vm().slice(off, len)
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

/// A read-only view of a contiguous range of device memory. A GPU backend adds a variant
/// holding a device-slice view.
#[derive(Clone, Copy)]
pub enum T<'a> {
    Host(&'a [f32]),
    Host64(&'a [f64]),
}

/// A mutable view of a contiguous range of device memory.
pub enum TMut<'a> {
    Host(&'a mut [f32]),
    Host64(&'a mut [f64]),
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
    fn of(v: T<'_>) -> &[Self];
    fn of_mut(v: TMut<'_>) -> &mut [Self];
    fn of_f64(x: f64) -> Self;
    fn as_f64(self) -> f64;
}

impl Scalar for f32 {
    const DTYPE: DType = DType::F32;
    fn of(v: T<'_>) -> &[f32] {
        match v {
            T::Host(s) => s,
            _ => panic!("expected an f32 host view"),
        }
    }
    fn of_mut(v: TMut<'_>) -> &mut [f32] {
        match v {
            TMut::Host(s) => s,
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
    fn of(v: T<'_>) -> &[f64] {
        match v {
            T::Host64(s) => s,
            _ => panic!("expected an f64 host view"),
        }
    }
    fn of_mut(v: TMut<'_>) -> &mut [f64] {
        match v {
            TMut::Host64(s) => s,
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

impl<'a> T<'a> {
    pub fn len(&self) -> usize {
        match self {
            T::Host(s) => s.len(),
            T::Host64(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            T::Host(_) => DType::F32,
            T::Host64(_) => DType::F64,
        }
    }
    /// Elements `off .. off + len` of this view.
    pub fn slice(self, off: usize, len: usize) -> T<'a> {
        match self {
            T::Host(s) => T::Host(&s[off..off + len]),
            T::Host64(s) => T::Host64(&s[off..off + len]),
        }
    }
    /// The host memory behind this view, as `S` (panics on another dtype or a device view).
    /// Only the CPU backend's kernels use it; code above the seam goes through `Memory`.
    pub fn host<S: Scalar>(self) -> &'a [S] {
        S::of(self)
    }
}

impl<'a> TMut<'a> {
    pub fn len(&self) -> usize {
        match self {
            TMut::Host(s) => s.len(),
            TMut::Host64(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            TMut::Host(_) => DType::F32,
            TMut::Host64(_) => DType::F64,
        }
    }
    pub fn slice(self, off: usize, len: usize) -> TMut<'a> {
        match self {
            TMut::Host(s) => TMut::Host(&mut s[off..off + len]),
            TMut::Host64(s) => TMut::Host64(&mut s[off..off + len]),
        }
    }
    /// Reborrow, to pass a view on without giving it up.
    pub fn rb(&mut self) -> TMut<'_> {
        match self {
            TMut::Host(s) => TMut::Host(s),
            TMut::Host64(s) => TMut::Host64(s),
        }
    }
    /// A read-only view of the same memory.
    pub fn ro(&self) -> T<'_> {
        match self {
            TMut::Host(s) => T::Host(s),
            TMut::Host64(s) => T::Host64(s),
        }
    }
    /// Split into two disjoint views at `mid`.
    pub fn split_at(self, mid: usize) -> (TMut<'a>, TMut<'a>) {
        match self {
            TMut::Host(s) => {
                let (a, b) = s.split_at_mut(mid);
                (TMut::Host(a), TMut::Host(b))
            }
            TMut::Host64(s) => {
                let (a, b) = s.split_at_mut(mid);
                (TMut::Host64(a), TMut::Host64(b))
            }
        }
    }
    /// See [`T::host`].
    pub fn host<S: Scalar>(self) -> &'a mut [S] {
        S::of_mut(self)
    }
}
