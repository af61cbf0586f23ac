"""The CUDA layer: `device` (cuda.core device, stream, buffers, one `check()`), `jit` (NVRTC
with an on-disk cache and the table of kernels the engine uses).

Nothing here imports cuda-core at module import time, so CPU-only code can import the package.
"""
