//! CPU kernels of the optimizers.

use super::CpuBackend;
use crate::backend::OptimOps;

impl OptimOps for CpuBackend {}
