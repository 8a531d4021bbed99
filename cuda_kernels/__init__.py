"""CUDA C++ kernels (sm_90a), built at run time with nvcc and launched through the CUDA driver API."""
