"""What fp16 storage of the residual stream costs on real weights, on the CPU.

    PYTHONPATH=. python3 dev/residual_precision.py FILE.nanoqwen [--windows 4] [--tokens 256]

The reference (nanoqwen.reference) runs the real model four ways over windows of stdlib code
(harness.real_text.code_windows): pure float32 (the oracle); "fp16 all", every inter-kernel
activation and the residual stream itself rounded to fp16, K too (reference.Fp16Storage(
residual=True, k_pair=False): about the engine's storage before its residual went fp32);
"fp32 residual", the stream kept in float32, the RMSNorms reading an fp16 copy, K rounded
(Fp16Storage(k_pair=False): the `--k-cache fp16` engine); "engine", that with K kept whole
(Fp16Storage(): the default engine, K as an fp16 (hi, lo) pair). For
each rounded run: top-1 agreement with the oracle, the per-position max |dlogit| / std (median,
p99, max). Then the residual stream's largest magnitude after each layer (float32 run): the fp16
headroom (fp16's largest finite value is 65504). The first layer's output is also measured with
the layer tier's metric (max |err| / rms of the reference), on real and on random ids.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness import real_text
from nanoqwen.kv_pages import PageTable
from nanoqwen.reference import Fp16Storage, ReferenceBackend, set_threads
from nanoqwen.tokenizer import Tokenizer

VARIANTS = {
    "fp32": None,
    "fp16 all": Fp16Storage(residual=True, k_pair=False),
    "fp32 residual": Fp16Storage(k_pair=False),
    "engine": Fp16Storage(),
}
FP16_MAX = 65504.0
FP16_ULP = 2.0**-11


@torch.inference_mode()
def trace(ref: ReferenceBackend, ids: list[int]) -> tuple[np.ndarray, list[torch.Tensor]]:
    """(logits float32 [T, V], the residual stream [T, H] after each layer)."""
    m, table = ref.model, PageTable()
    ref.cache.pages.reserve(table, len(ids))
    try:
        tokens = torch.tensor(ids)
        tab = torch.tensor(table.pages)
        cos, sin = m.cos[: len(ids)], m.sin[: len(ids)]
        x, xs = m.embed_tokens[tokens], []
        for i, w in enumerate(m.layers):
            x = m.block(x, w, i, 0, tab, ref.cache, cos, sin)
            xs.append(x)

        return m.logits(m.final(x)).numpy(), xs
    finally:
        ref.cache.pages.release(table)


def layer0_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    """Layer 0's error by the synthetic layer tier's metric (max |err| / rms(want)) and by the
    real one's (harness.validate_real: max |err| in fp16 ulps of max |want|; rms err / rms)."""
    err, rms = (got - want).abs().double(), float(want.double().pow(2).mean().sqrt())
    peak = float(want.abs().max())
    return (
        float(err.max()) / rms,
        float(err.max()) / (peak * FP16_ULP),
        float(err.pow(2).mean().sqrt()) / rms,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="a real .nanoqwen file")
    ap.add_argument("--windows", type=int, default=4, help="stdlib code windows")
    ap.add_argument("--tokens", type=int, default=256, help="tokens a window")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared host)")
    ap.add_argument("--near-tie", type=float, default=0.1, help="margin / std left out")
    args = ap.parse_args()
    set_threads(args.threads)
    with NanoqwenFile(args.file) as f:
        cfg = f.config
        ref = ReferenceBackend(f, max_context=args.tokens, prefix_caching=False)
        windows = real_text.code_windows(Tokenizer.from_spec(f.tokenizer), args.windows,
                                         args.tokens)  # fmt: skip
    rng = np.random.default_rng(0)
    random_ids = rng.integers(0, cfg.vocab_size, 40).tolist()
    rows: dict[str, list] = {k: [] for k in VARIANTS if k != "fp32"}
    peak = np.zeros(cfg.num_layers)
    layer0: dict[str, list[tuple]] = {k: [] for k in rows}
    seconds = dict.fromkeys(VARIANTS, 0.0)
    for ids in [*windows, random_ids]:
        base = None
        for name, storage in VARIANTS.items():
            t0 = time.perf_counter()
            with ref.model.storing(storage):
                logits, xs = trace(ref, ids)
            seconds[name] += time.perf_counter() - t0
            if storage is None:
                base, base_x0 = logits, xs[0]
                if ids is not random_ids:
                    peak = np.maximum(peak, [float(x.abs().max()) for x in xs])
                continue
            layer0[name].append(layer0_err(xs[0], base_x0))
            if ids is not random_ids:
                rows[name].append(real_text.compare(logits, base))
    print(f"{cfg.name}: {len(windows)} windows x {args.tokens} tokens of stdlib code")
    print(f"{'variant':14} {'top1':>7} {'top1>tie':>8} {'ties':>5} {'p50':>7} {'p99':>7} "
          f"{'max':>7} {'L0 code: /rms':>13} {'ulp':>5} {'rms':>8} {'L0 rand: /rms':>13} "
          f"{'ulp':>5} {'rms':>8} {'s':>5}")  # fmt: skip
    for name, r in rows.items():
        s = real_text.summary(r, args.near_tie)
        l0 = layer0[name]
        print(f"{name:14} {s['top1']:7.4f} {s['top1_clear']:8.4f} {s['near_ties']:5d} "
              f"{s['dlogit_p50']:7.4f} {s['dlogit_p99']:7.4f} {s['dlogit_max']:7.4f} "
              f"{max(e[0] for e in l0[:-1]):13.2e} {max(e[1] for e in l0[:-1]):5.2f} "
              f"{max(e[2] for e in l0[:-1]):8.2e} {l0[-1][0]:13.2e} {l0[-1][1]:5.2f} "
              f"{l0[-1][2]:8.2e} {seconds[name]:5.0f}")  # fmt: skip
    print(
        "(dlogit: per-position max |dlogit| / std vs float32; L0: layer 0's max |err| / rms(ref),"
        " max |err| in fp16 ulps of max |ref|, rms err / rms(ref))"
    )
    print("residual stream max |x| after each layer (float32, code windows), fp16 max 65504:")
    print("  " + " ".join(f"{v:.0f}" for v in peak))
    print(f"  largest {peak.max():.0f} at layer {int(peak.argmax())}: "
          f"{FP16_MAX / peak.max():.1f}x fp16 headroom")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
