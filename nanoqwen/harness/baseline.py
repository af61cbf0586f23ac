"""`nanoqwen bench --baseline transformers`: Hugging Face transformers on the same shapes.

The baseline is `transformers.Qwen2ForCausalLM` built from `ModelConfig.to_hf()` with RANDOM
weights, bf16, directly on the GPU (the same shapes as our file, not its weights: the speed of
a dense bf16 forward does not depend on the values), transformers' defaults otherwise: sdpa
attention, the dynamic KV cache, no torch.compile. Same protocol as `bench.run_bench`: batch
1, a random prompt of `prompt_len` ids, greedy generation of exactly `gen_len` tokens
(min_new_tokens = max_new_tokens, no eos), `warmup` untimed runs then `runs` timed runs.

What is measured: host timestamps from a streamer. transformers' generate() hands the streamer
the prompt once (`put(input_ids.cpu())`, before prefill) and then every new token as
`put(tokens.cpu())`: `.cpu()` of a CUDA tensor waits for the device, so each stamp is the time
the token is on the host, exactly what our engine's stamps are (token read from the mapped
host ring). TTFT: generate() called -> first generated token on the host; ITL: median gap
between consecutive generated tokens over all gaps of all timed runs.

torch and transformers are imported lazily; `unavailable()` says why the baseline cannot run.
"""

from __future__ import annotations

import gc
import time

import numpy as np

NAME = "transformers"


class TokenTimer:
    """A transformers streamer (the `BaseStreamer` interface: put / end) that timestamps every
    generated token. The first `put` is the prompt and is not a token; later puts carry one
    token per sequence (batch 1). `clock` is injectable for tests."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.stamps: list[float] = []
        self.prompt_at: float | None = None
        self.ended_at: float | None = None

    def put(self, value) -> None:
        now = self.clock()
        if self.prompt_at is None:
            self.prompt_at = now
            return
        n = int(np.asarray(value).size)  # tensors convert; batch 1 -> one token per put
        self.stamps += [now] * max(n, 1)

    def end(self) -> None:
        self.ended_at = self.clock()

    def ttft(self, t0: float) -> float:
        """Seconds from `t0` (generate() called) to the first generated token."""
        if not self.stamps:
            raise RuntimeError("no generated token was streamed")
        return self.stamps[0] - t0

    def gaps(self) -> np.ndarray:
        """Seconds between consecutive generated tokens."""
        return np.diff(np.asarray(self.stamps, dtype=np.float64))


def _streamer_class():
    """TokenTimer as a real `BaseStreamer` subclass (transformers imported here, lazily)."""
    from transformers.generation.streamers import BaseStreamer

    class HFTokenTimer(TokenTimer, BaseStreamer):
        pass

    return HFTokenTimer


def unavailable(device: str = "cuda") -> str | None:
    """None when the baseline can run on `device`, else the reason it cannot."""
    try:
        import torch
        import transformers  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return f"torch/transformers not importable: {type(exc).__name__}: {exc}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def _dtype_kwarg(transformers) -> str:
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def build_model(config, device: str = "cuda", dtype: str = "bfloat16"):
    """Qwen2ForCausalLM of `config`'s shapes, random weights, created on `device` in `dtype`."""
    import torch
    import transformers

    hf = dict(config.to_hf())
    hf.pop("torch_dtype", None)
    hf_cfg = transformers.Qwen2Config(**hf)
    torch_dtype = getattr(torch, dtype)
    kw = {_dtype_kwarg(transformers): torch_dtype, "attn_implementation": "sdpa"}
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM._from_config(hf_cfg, **kw)
    return model.eval()


def run_baseline(
    config, prompt_len=512, gen_len=128, warmup=1, runs=3, seed=0, device="cuda", dtype="bfloat16"
) -> dict:
    """Time transformers' greedy generation of `config`'s shapes (see the module docstring).
    Frees the model (and torch's cached GPU memory) before returning."""
    import torch
    import transformers

    model = build_model(config, device, dtype)
    try:
        gen_cfg = transformers.GenerationConfig(
            do_sample=False,
            max_new_tokens=gen_len,
            min_new_tokens=gen_len,
            eos_token_id=None,
            pad_token_id=0,
            bos_token_id=None,
        )
        timer_cls = _streamer_class()
        rng = np.random.default_rng(seed)
        ttfts, gaps, walls = [], [], []
        for r in range(warmup + runs):
            ids = rng.integers(0, config.vocab_size, prompt_len)
            x = torch.tensor(ids[None, :], dtype=torch.long, device=device)
            timer = timer_cls()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen_cfg,
                               streamer=timer)  # fmt: skip
            if len(timer.stamps) != gen_len:
                raise RuntimeError(f"run {r}: {len(timer.stamps)} tokens, expected {gen_len}")
            if r >= warmup:
                ttfts.append(timer.ttft(t0))
                g = timer.gaps()
                gaps += list(g)
                if gen_len > 1:
                    walls.append((timer.stamps[-1] - timer.stamps[0]) / (gen_len - 1))
        itl = float(np.median(gaps)) if gaps else float("nan")
        name = torch.cuda.get_device_name() if device.startswith("cuda") else device
        return {
            "name": NAME,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "device": name,
            "dtype": dtype,
            "attn_implementation": "sdpa",
            "weights": "random (same shapes)",
            "prompt_len": prompt_len,
            "gen_len": gen_len,
            "warmup": warmup,
            "runs": runs,
            "ttft_ms": 1e3 * float(np.median(ttfts)),
            "itl_ms": 1e3 * itl,
            "itl_wall_ms": 1e3 * float(np.median(walls)) if walls else float("nan"),
            "tokens_per_s": 1.0 / itl,
        }
    finally:
        del model
        gc.collect()  # HF modules can hold reference cycles; free the weights now
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def compare(ours: dict, theirs: dict) -> dict:
    """Speed-ups of ours over the baseline (> 1: we are faster)."""
    return {
        "speedup_itl": theirs["itl_ms"] / ours["itl_ms"],
        "speedup_ttft": theirs["ttft_ms"] / ours["ttft_ms"],
    }


def print_baseline(b: dict) -> None:
    if "skipped" in b:
        print(f"baseline {b.get('name', NAME)}: skipped ({b['skipped']})")
        return
    if "error" in b:
        print(f"baseline {b.get('name', NAME)}: FAILED ({b['error']})")
        return
    print(f"baseline transformers {b['transformers']} (torch {b['torch']}, {b['dtype']}, "
          f"{b['attn_implementation']}, {b['weights']}) on {b['device']}")  # fmt: skip
    for k in ("ttft_ms", "itl_ms", "itl_wall_ms", "tokens_per_s"):
        print(f"  {k:14} {b[k]:10.3f}")
    if "speedup_itl" in b:
        print(f"  nanoqwen / transformers: inter-token latency {b['speedup_itl']:.2f}x faster, "
              f"TTFT {b['speedup_ttft']:.2f}x faster")  # fmt: skip


def bench_baseline(config, ours: dict, warmup=1, runs=3, device="cuda", dtype="bfloat16") -> dict:
    """The `baseline` entry of bench's JSON: the baseline's result with the speed-ups over
    `ours` (bench.run_bench's result: same prompt_len and gen_len), {"skipped": reason} when
    torch/transformers/CUDA are missing, or {"error": message} when the run itself failed."""
    reason = unavailable(device)
    if reason:
        return {"name": NAME, "skipped": reason}
    try:
        b = run_baseline(config, ours["prompt_len"], ours["gen_len"], warmup, runs,
                         device=device, dtype=dtype)  # fmt: skip
    except Exception as exc:  # e.g. out of memory: report it, keep our own result
        return {"name": NAME, "error": f"{type(exc).__name__}: {exc}"}
    b.update(compare(ours, b))
    return b
