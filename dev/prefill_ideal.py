"""Our time to first token against the same prefill in dense fp16 on cuBLAS and torch's flash
attention, with the SM clock each request ran at (run on an sm_90 GPU).

    PYTHONPATH=. python3 dev/prefill_ideal.py FILE.nanoqwen [--prompt-len 512] [--runs 10]
        [--pause-ms 0,1000] [--layers-kept 8]

The dense chain is what a prefill of FILE's shapes costs with fp16 weights and vendor kernels
and no launch gaps: per layer RMSNorm, the q/k/v GEMM + bias, RoPE, causal attention with GQA
(F.scaled_dot_product_attention), the o GEMM + residual, RMSNorm, the gate/up GEMM, SwiGLU, the
down GEMM + residual; then the final RMSNorm, lm_head for the last token and its argmax; all
captured in one CUDA graph. Its weights are random fp16, `--layers-kept` distinct layers
cycled through the model's depth (a layer's weights are far larger than L2, so reuse saves no
DRAM traffic). Both are timed the same way, on the host from the call to the token (ours:
generate(max_tokens=1) on a fresh random prompt, as `nanoqwen bench` takes its TTFT; the
chain: replay + synchronize), alternating, with `pause` ms of idle before each request: 0 keeps
the GPU at its sustained power limit, a long pause lets it cool between requests. Printed with
each row: the median of the requests' mean SM clocks (the bench's ClockSampler).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from nanoqwen.engine import CudaBackend
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness.bench import ClockSampler
from nanoqwen.sampling import SamplingParams


def dense_prefill(config, tokens: int, layers_kept: int):
    """A CUDA graph of the dense fp16 prefill of `tokens` tokens at config's shapes; returns
    replay()."""
    c, dev, f16 = config, "cuda", torch.float16
    h, d, hq, hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    qkv_n = (hq + 2 * hkv) * d

    def w(*shape):
        return (torch.randn(*shape, device=dev, dtype=f16) * shape[-1] ** -0.5).contiguous()

    layers = [
        {
            "qkv": w(qkv_n, h),
            "qkv_b": w(qkv_n) * 0.1,
            "o": w(h, hq * d),
            "gate_up": w(2 * c.intermediate_size, h),
            "down": w(h, c.intermediate_size),
            "n1": torch.ones(h, device=dev, dtype=f16),
            "n2": torch.ones(h, device=dev, dtype=f16),
        }
        for _ in range(layers_kept)
    ]
    lm_head, final_norm = w(c.vocab_size, h), torch.ones(h, device=dev, dtype=f16)
    pos = torch.arange(tokens, device=dev, dtype=torch.float32)
    inv = c.rope_theta ** (-torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(f16), torch.cat([ang.sin()] * 2, -1).to(f16)
    x0 = torch.randn(tokens, h, device=dev, dtype=f16)
    eps = c.rms_norm_eps

    def rope(t):  # [heads, T, D]
        half = t.shape[-1] // 2
        rot = torch.cat([-t[..., half:], t[..., :half]], -1)
        return t * cos + rot * sin

    def forward():
        x = x0.clone()
        for i in range(c.num_layers):
            L = layers[i % layers_kept]
            a = F.rms_norm(x, (h,), L["n1"], eps)
            qkv = torch.addmm(L["qkv_b"], a, L["qkv"].t())
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
            q = rope(q.view(tokens, hq, d).transpose(0, 1))
            k = rope(k.view(tokens, hkv, d).transpose(0, 1))
            v = v.view(tokens, hkv, d).transpose(0, 1)
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                               enable_gqa=True)  # fmt: skip
            x = x + o[0].transpose(0, 1).reshape(tokens, hq * d) @ L["o"].t()
            a = F.rms_norm(x, (h,), L["n2"], eps)
            g, u = (a @ L["gate_up"].t()).chunk(2, -1)
            x = x + (F.silu(g) * u) @ L["down"].t()
        logits = F.rms_norm(x[-1:], (h,), final_norm, eps) @ lm_head.t()
        return logits.argmax(-1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph.replay


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--pause-ms", default="0,1000", help="idle before each request, per row")
    ap.add_argument("--layers-kept", type=int, default=8)
    args = ap.parse_args()
    torch.cuda.init()
    f = NanoqwenFile(args.file)
    engine = CudaBackend(f, max_context=4 * args.prompt_len + 64)
    rng = np.random.default_rng(0)
    vocab, params = engine.config.vocab_size, SamplingParams(max_tokens=1)

    def ours() -> None:
        ids = rng.integers(0, vocab, args.prompt_len).tolist()
        for _ in engine.generate(ids, params, frozenset()):
            pass

    replay = dense_prefill(engine.config, args.prompt_len, args.layers_kept)

    def dense() -> None:
        replay()
        torch.cuda.synchronize()

    print(f"{'pause ms':>8} {'what':<22} {'TTFT ms, median':>15} {'min':>8} {'SM MHz':>8}")
    for pause in (float(p) for p in args.pause_ms.split(",")):
        times = {"ours": [], "dense fp16 (cuBLAS)": []}
        mhz = {name: [] for name in times}
        with ClockSampler(engine.gpu, period=0.002) as clocks:
            for r in range(3 + args.runs):
                for name, call in (("ours", ours), ("dense fp16 (cuBLAS)", dense)):
                    time.sleep(pause / 1e3)
                    t0 = time.perf_counter()
                    call()
                    t1 = time.perf_counter()
                    if r >= 3:
                        times[name].append(1e3 * (t1 - t0))
                        mhz[name].append(clocks.mean(t0, t1) or float("nan"))
        for name, ms in times.items():
            print(
                f"{pause:>8.0f} {name:<22} {statistics.median(ms):>15.3f} {min(ms):>8.3f} "
                f"{statistics.median(mhz[name]):>8.0f}"
            )
    engine.close()
    f.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
