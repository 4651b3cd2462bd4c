//! The kernels' CUDA C source, embedded for NVRTC.

/// (file name, CUDA C source) of every kernel file. Empty until the kernels land.
pub const SOURCES: &[(&str, &str)] = &[];
