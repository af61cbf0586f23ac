"""Per-kernel timings of the decode step on an sm_90 GPU (the playground: validate first with
gpu_check's unit stage, then time here). Each kernel is launched `reps` times inside one CUDA
graph (so launch overhead is the in-graph ~1 us, not the 6.6 us of an eager launch from
Python) and timed with events; the GEMVs also report achieved TB/s of weight bytes.

    python3 tools/kernel_times.py /tmp/synthetic-7b.nanoqwen [--pos 600] [--reps 50]

NOT YET RUN ON A GPU (written after this session's device budget was spent).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoqwen.cuda.kernels import S_MAX_NEW, S_POS, S_TOKEN, STATE_WORDS  # noqa: E402


def time_graph(e, body, reps: int) -> float:
    """Seconds per call of body(stream_like), from one graph of `reps` calls."""
    from cuda.core import EventOptions

    gb = e.gpu.stream.create_graph_builder().begin_building()
    for _ in range(reps):
        body(gb)
    graph = gb.end_building().complete()
    graph.upload(e.gpu.stream)
    graph.launch(e.gpu.stream)  # warm-up
    opts = EventOptions(timing_enabled=True)
    e0 = e.gpu.stream.record(options=opts)
    graph.launch(e.gpu.stream)
    e1 = e.gpu.stream.record(options=opts)
    e1.sync()
    return (e1 - e0) / 1e3 / reps


def main() -> int:
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile

    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--pos", type=int, default=600)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    f = NanoqwenFile(args.file)
    e = CudaBackend(f, max_context=4096)
    cfg, k, L = f.config, e.k, e.layers[0]
    st = np.zeros(STATE_WORDS, np.int32)
    st[S_TOKEN], st[S_POS], st[S_MAX_NEW] = 1, args.pos, 1 << 30
    e.gpu.upload(e.state, st)
    pos = e.state + 4 * S_POS
    h, i, qkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size + 2 * cfg.kv_size
    wb = {"qkv": qkv * h // 2, "o": h * cfg.q_size // 2, "gate_up": 2 * i * h // 2,
          "down": h * i // 2}  # fmt: skip
    rows = []
    gemvs = {
        "qkv": lambda s: k.gemv("qkv", e.x, L.in_norm, L.qkv_w, L.qkv_s, L.qkv_b, e.qkv, qkv,
                                stream=s),
        "o": lambda s: k.gemv("o", e.attn, 0, L.o_w, L.o_s, 0, e.x, h, stream=s),
        "gate_up": lambda s: k.gemv("gate_up", e.x, L.post_norm, L.gu_w, L.gu_s, 0, e.mlp, i,
                                    stream=s),
        "down": lambda s: k.gemv("down", e.mlp, 0, L.d_w, L.d_s, 0, e.x, h, stream=s),
    }  # fmt: skip
    for name, fn in gemvs.items():
        t = time_graph(e, fn, args.reps)
        rows.append((f"gemv {name}", t, wb[name] / t / 1e12))
    small = {
        "rope_kv_write": lambda s: k.rope_kv(e.qkv, pos, e.rope, e.pages, L.kc, L.vc, e.q, 0, 0,
                                             1, stream=s),
        "attention": lambda s: k.attention(e.q, L.kc, L.vc, e.pages, pos, e.part_ml,
                                           e.part_acc, e.attn, stream=s),
        "lm_head": lambda s: k.lm_head(e.x, e.final_norm, e.lm_head, e.logits_buf, e.key,
                                       stream=s),
        "embed": lambda s: k.embed(e.state, e.embed, e.x, 1, stream=s),
    }  # fmt: skip
    for name, fn in small.items():
        t = time_graph(e, fn, args.reps)
        tb = cfg.vocab_size * h * 2 / t / 1e12 if name == "lm_head" else float("nan")
        rows.append((name, t, tb))
    e.gpu.upload(e.state, st)
    t = time_graph(e, lambda s: e._step(s, 0), 20)  # whole step incl. sampler (pos advances)
    rows.append(("decode step", t, cfg.weight_bytes_per_token() / t / 1e12))
    print(f"{e.gpu.name}  {cfg.name}  pos {args.pos}  pdl {k.pdl}  gemv {k.gemv_variant}")
    for name, t, tb in rows:
        print(f"  {name:16} {t * 1e6:9.2f} us   {tb:6.3f} TB/s")
    e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
