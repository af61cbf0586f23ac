"""The CUDA engine: our kernels driving one Qwen2 model on one sm_90 GPU.

    weights.py      the weights on the device (q/k/v and gate/up stacked at upload)
    kv_cache.py     the paged KV pool, its page table and its device layout
    decode_loop.py  the decode state, the host ring and the one-graph generation loop
    forward.py      the forward pass: the decode step and the prefill
    batch.py        the batched decode step: B sequences, one token each, one weight pass
    backend.py      CudaBackend: load, generate, logits; the seam validate, bench and dev use

Importing it needs no GPU and no cuda-core (the CUDA layer imports the driver lazily).
"""

from .backend import CudaBackend

__all__ = ["CudaBackend"]
