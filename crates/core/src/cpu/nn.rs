//! CPU kernels of the model's operations.

use super::CpuBackend;
use crate::backend::NnOps;

impl NnOps for CpuBackend {}
