//! Kernels of the optimizers (fused elementwise updates).

pub trait OptimOps: Send + Sync {}
