//! Row-major GEMMs of the seam as column-major cuBLAS calls.
