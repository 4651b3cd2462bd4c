//! The kernels' CUDA C source, embedded for NVRTC.
