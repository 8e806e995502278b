//! CUDA backend for sieve kernels.
