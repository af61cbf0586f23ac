"""The CUDA layer, everything between the engine and the driver:

    device.py    the one seam to the driver (cuda.core / cuda.bindings): device, stream,
                 buffers, launches, one check()
    jit.py       NVRTC compilation with an honest on-disk cache
    registry.py  the table of kernels and the geometry both sides of a launch agree on
    launcher.py  compile + load a set of registry specs; the one launch path
    decode.py    the decode kernels' launchers
    prefill.py   the prefill kernels' launchers
    batch.py     the batched decode step's own kernels' launchers

Nothing here imports cuda-core at module import time, so CPU-only code can import the package.
"""
