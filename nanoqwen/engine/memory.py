"""Device memory at load: everything the engine will allocate, part by part, checked against
the free bytes before the first allocation.

`plan_memory(config, max_context, num_sms, geometry, speculative, lm_head, kv_tokens,
max_batch)` adds up the buffers that each part's own module sizes, each as Gpu.alloc rounds it
(device.alloc_size):

    weights            weights.weight_buffers: INT4 words and fp16 scales, stacked q/k/v and
                       gate/up, norms, biases, the fp16 embedding and lm_head (once if tied)
                       or the int8 head and its row scales (beside the embedding if tied)
    kv_cache           kv_cache.kv_cache_buffers: K and V pools for kv_tokens positions (default
                       max_context; the pool all sequences share) and the padding page, the
                       page table
    prefill_scratch    forward.prefill_scratch_buffers for a prompt of max_context tokens
                       (allocated as prompts grow; planned for the longest one)
    prefill_workspace  prefill.workspace_buffers: PrefillKernels' stream-K parts and flags,
                       attention's key-split partials
    decode_buffers     forward.decode_buffers (RoPE table, x, q, attn, mlp, logits), decode
                       attention's split scratch, the decode state and token ring
    speculation        with a SpeculativeConfig: speculate.spec_buffers (the history, the
                       verify step's rows and attention scratch); the KV pool and the RoPE
                       table then cover K positions more (speculate.kv_positions)
    batch              with max_batch > 0: batch.batch_plan (the batched decode step's rows,
                       activations, logits and attention scratch for max_batch rows)
    margin             MEMORY_MARGIN: what the driver takes beside our buffers (kernel images,
                       graphs, the stream-ordered pool's slack)

CudaBackend calls `check_memory` right after the context exists, with cuMemGetInfo's free
bytes: a model that does not fit is refused with needed against free bytes, by part, and the
longest context that would fit. On the CPU the same plan answers "does the 32B at 32k fit an
H200" (`nanoqwen memory --model 32b`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..cuda import registry
from ..cuda.decode import attention_scratch_buffers
from ..cuda.device import alloc_size
from ..cuda.prefill import workspace_buffers
from ..errors import DeviceError
from ..speculative import SpeculativeConfig
from .batch import batch_plan
from .decode_loop import loop_buffers
from .forward import decode_buffers, prefill_scratch_buffers
from .kv_cache import kv_cache_buffers
from .speculate import kv_positions, spec_buffers
from .weights import weight_bytes

MEMORY_MARGIN = 1 << 30
GIB = 1 << 30
# An H200 as the driver reports it: 132 SMs, 143771 MiB of HBM3e, of which a fresh context
# leaves about 139 GiB free (nvidia-smi and the device notes; a CPU plan's default device).
H200_SMS = 132
H200_FREE = 139 * GIB


@dataclass(frozen=True)
class MemoryPlan:
    """Device bytes by part (the module docstring's table) for one model and context."""

    model: str
    max_context: int
    parts: dict[str, int]

    @property
    def needed(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        """'35.38 GiB = weights 17.89 + kv_cache 12.01 + ...' (GiB)."""
        terms = " + ".join(f"{k} {v / GIB:.2f}" for k, v in self.parts.items())
        return f"{self.needed / GIB:.2f} GiB = {terms}"


def plan_memory(
    config: ModelConfig,
    max_context: int,
    num_sms: int = H200_SMS,
    geometry: registry.Geometry = registry.DEFAULT_GEOMETRY,
    speculative: SpeculativeConfig | None = None,
    lm_head: str = "float16",
    kv_tokens: int | None = None,
    max_batch: int = 0,
) -> MemoryPlan:
    """What CudaBackend allocates for `config` at `max_context` positions on a GPU of
    `num_sms` SMs, by part (speculative, kv_tokens, max_batch: CudaBackend's arguments, None
    kv_tokens meaning max_context; lm_head: the file's head format)."""

    def rounded(sizes) -> int:
        return sum(alloc_size(n) for n in sizes)

    positions = kv_positions(max_context, speculative)
    pool = kv_positions(kv_tokens or max_context, speculative)
    decode = (
        *decode_buffers(config, positions).values(),
        *attention_scratch_buffers(config, geometry).values(),
        *loop_buffers(max_context).values(),
    )
    parts = {
        "weights": weight_bytes(config, lm_head),
        "kv_cache": rounded(kv_cache_buffers(config, pool, geometry.k_parts)),
        "prefill_scratch": rounded(prefill_scratch_buffers(config, max_context).values()),
        "prefill_workspace": rounded(workspace_buffers(config, num_sms, geometry).values()),
        "decode_buffers": rounded(decode),
    }
    if speculative is not None:
        parts["speculation"] = rounded(spec_buffers(config, max_context, speculative, geometry))
    if max_batch:
        parts["batch"] = rounded(batch_plan(config, max_batch, max_context, geometry))
    parts["margin"] = MEMORY_MARGIN
    return MemoryPlan(config.name, max_context, parts)


def largest_context(
    config: ModelConfig,
    free: int,
    num_sms: int = H200_SMS,
    geometry: registry.Geometry = registry.DEFAULT_GEOMETRY,
    speculative: SpeculativeConfig | None = None,
    lm_head: str = "float16",
    kv_tokens: int | None = None,
    max_batch: int = 0,
) -> int:
    """The longest max_context (at most the model's max_position_embeddings) whose plan fits
    `free` bytes; 0 if not even one position does. The plan grows with the context."""
    lo, hi = 0, config.max_position_embeddings
    while lo < hi:
        mid = (lo + hi + 1) // 2
        plan = plan_memory(config, mid, num_sms, geometry, speculative, lm_head, kv_tokens,
                           max_batch)  # fmt: skip
        if plan.needed <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_memory(
    config: ModelConfig,
    max_context: int,
    free: int,
    total: int,
    num_sms: int = H200_SMS,
    geometry: registry.Geometry = registry.DEFAULT_GEOMETRY,
    speculative: SpeculativeConfig | None = None,
    lm_head: str = "float16",
    kv_tokens: int | None = None,
    max_batch: int = 0,
) -> MemoryPlan:
    """The plan, checked against `free` of `total` bytes: DeviceError (needed against free,
    by part, and the longest context that fits) when it does not fit."""
    extra = (speculative, lm_head, kv_tokens, max_batch)
    plan = plan_memory(config, max_context, num_sms, geometry, *extra)
    if plan.needed <= free:
        return plan
    largest = largest_context(config, free, num_sms, geometry, *extra)
    fix = f"max_context {largest} would fit" if largest else "no context fits"
    raise DeviceError(
        f"the {plan.model} at max_context {max_context}"
        f"{f' with a KV pool of {kv_tokens} tokens' if kv_tokens else ''} needs {plan.needed} "
        "bytes of device "
        f"memory ({plan.describe()}) but {free} of {total} bytes ({free / GIB:.2f} of "
        f"{total / GIB:.2f} GiB) are free; {fix}"
    )
