//! Kernels of the model's operations (forward and backward of each), llm.c style.

pub trait NnOps: Send + Sync {}
