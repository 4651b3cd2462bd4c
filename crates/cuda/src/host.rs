//! The kernels' host build (the CUDA C source through the shim), for checking against the CPU backend.
