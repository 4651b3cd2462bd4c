//! The CPU backend: host memory, f32 compute, GEMM from `matrixmultiply`, threads from rayon.

mod blas;
mod nn;
mod optim;

use crate::backend::Memory;
use crate::ledger::{Category, Device, Ledger};
use crate::tensor::{Buffer, DType, TMut, Tensor, T};
use std::sync::Arc;

/// Call a kernel generic over [`crate::Scalar`] at a runtime dtype:
/// `by_dtype!(dtype, kernel(args...))` expands to `kernel::<f32>(args...)` or `kernel::<f64>(..)`.
#[macro_export]
macro_rules! by_dtype {
    ($dt:expr, $f:ident ( $($arg:expr),* $(,)? )) => {
        match $dt {
            $crate::DType::F32 => $f::<f32>($($arg),*),
            $crate::DType::F64 => $f::<f64>($($arg),*),
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
}

impl CpuBackend {
    pub fn new(ledger: Arc<Ledger>) -> Self {
        Self {
            ledger,
            dtype: DType::F32,
        }
    }
    /// An f64 backend, for gradient checks.
    pub fn new_f64(ledger: Arc<Ledger>) -> Self {
        Self {
            ledger,
            dtype: DType::F64,
        }
    }
    pub fn dtype(&self) -> DType {
        self.dtype
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
        Device::Host
    }
    fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }
    fn zeros(&self, shape: &[usize], category: Category) -> Tensor {
        let n = shape.iter().product();
        let buf = match self.dtype {
            DType::F32 => Buffer::Host(vec![0.0; n]),
            DType::F64 => Buffer::Host64(vec![0.0; n]),
        };
        self.tensor(buf, shape, category)
    }
    fn upload(&self, data: &[f32], shape: &[usize], category: Category) -> Tensor {
        let buf = match self.dtype {
            DType::F32 => Buffer::Host(data.to_vec()),
            DType::F64 => Buffer::Host64(data.iter().map(|&x| x as f64).collect()),
        };
        self.tensor(buf, shape, category)
    }
    fn upload_f64(&self, data: &[f64], shape: &[usize], category: Category) -> Tensor {
        let buf = match self.dtype {
            DType::F32 => Buffer::Host(data.iter().map(|&x| x as f32).collect()),
            DType::F64 => Buffer::Host64(data.to_vec()),
        };
        self.tensor(buf, shape, category)
    }
    fn download(&self, src: T) -> Vec<f32> {
        match src {
            T::Host(s) => s.to_vec(),
            T::Host64(s) => s.iter().map(|&x| x as f32).collect(),
        }
    }
    fn download_f64(&self, src: T) -> Vec<f64> {
        match src {
            T::Host(s) => s.iter().map(|&x| x as f64).collect(),
            T::Host64(s) => s.to_vec(),
        }
    }
    fn write(&self, dst: TMut, data: &[f32]) {
        match dst {
            TMut::Host(d) => d.copy_from_slice(data),
            TMut::Host64(d) => d.iter_mut().zip(data).for_each(|(d, &s)| *d = s as f64),
        }
    }
    fn copy(&self, dst: TMut, src: T) {
        match (dst, src) {
            (TMut::Host(d), T::Host(s)) => d.copy_from_slice(s),
            (TMut::Host64(d), T::Host64(s)) => d.copy_from_slice(s),
            _ => panic!("copy between different dtypes"),
        }
    }
    fn fill(&self, dst: TMut, value: f32) {
        match dst {
            TMut::Host(d) => d.fill(value),
            TMut::Host64(d) => d.fill(value as f64),
        }
    }
}
