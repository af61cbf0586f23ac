"""Plan the device memory of a preset at a context, as the engine's load does
(nanoqwen/engine/memory.py), without a GPU: bytes by part (weights, KV cache, prefill scratch
for a max_context prompt, prefill workspace, decode buffers, the batched step's buffers,
margin), the total against the
free bytes given (default: an H200's ~139 GiB), and the longest context that fits. Exits
non-zero when the plan does not fit."""

from __future__ import annotations

import argparse

from .argtypes import int_range
from .generate import add_k_cache_argument

HELP = "plan device memory for a preset and context against free bytes (no GPU needed)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="7b", help="config preset")
    p.add_argument("--context", type=int_range(1), default=32768, help="max_context positions")
    p.add_argument("--free-gib", type=float, default=None,
                   help="free device memory to plan against, GiB (default: an H200's, "
                   "engine.memory.H200_FREE)")  # fmt: skip
    p.add_argument("--lm-head", choices=("fp16", "int8"), default="fp16",
                   help="the head's storage (pack --lm-head)")  # fmt: skip
    p.add_argument(
        "--kv-tokens",
        type=int_range(1),
        default=None,
        help="KV pool positions shared by every sequence (default: --context)",
    )
    p.add_argument(
        "--max-batch",
        type=int_range(0, 16),
        default=16,
        help="most sequences of one batched decode step (0: no batch path)",
    )
    p.add_argument("--sms", type=int_range(1), default=None,
                   help="SMs of the GPU (default: an H200's, engine.memory.H200_SMS)")  # fmt: skip
    add_k_cache_argument(p)


def run(args: argparse.Namespace) -> int:
    from ..backend import check_max_context
    from ..config import preset
    from ..cuda.registry import k_cache_geometry
    from ..engine.memory import GIB, H200_FREE, H200_SMS, largest_context, plan_memory

    cfg = preset(args.model)
    check_max_context(args.context, cfg)
    free = H200_FREE if args.free_gib is None else int(args.free_gib * GIB)
    sms = args.sms or H200_SMS
    lm_head = {"fp16": "float16", "int8": "int8"}[args.lm_head]
    max_batch = args.max_batch if lm_head == "float16" else 0  # as CudaBackend
    extra = {"geometry": k_cache_geometry(args.k_cache), "lm_head": lm_head,
             "kv_tokens": args.kv_tokens, "max_batch": max_batch}  # fmt: skip
    plan = plan_memory(cfg, args.context, sms, **extra)
    print(f"{cfg.name} ({args.lm_head} lm_head, {args.k_cache} K cache) at max_context "
          f"{args.context} on {sms} SMs:")  # fmt: skip
    for part, n in plan.parts.items():
        print(f"  {part:18} {n:15,d} bytes {n / GIB:8.2f} GiB")
    print(f"  {'needed':18} {plan.needed:15,d} bytes {plan.needed / GIB:8.2f} GiB")
    print(f"  {'free':18} {free:15,d} bytes {free / GIB:8.2f} GiB")
    fits = plan.needed <= free
    largest = largest_context(cfg, free, sms, **extra)
    print(f"{'fits' if fits else 'does NOT fit'}; the longest context that fits: {largest}")
    return 0 if fits else 1
