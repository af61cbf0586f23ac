"""What the decode kernels' design rests on, measured on an sm_90 GPU with nothing else running:
what a data dependency between two kernels costs, how long x takes to land behind weight copies
in flight, and how fast a ring of bulk copies streams for a given stage size.

    PYTHONPATH=. python3 dev/decode_probes.py [--links 112] [--stream-grids 128,112] [--json PATH]

Probe kernels: dev/decode_probes.cu, compiled with the generated header of no model
(registry.header(None): the geometry and the contract's enums). Timed as CUDA graphs
(harness.bench.time_graph: the Gpu's timing events, median of the timed launches). Three
tables:

  boundary   chains of `links` dependent links shaped like the decode GEMVs (264 CTAs of 288
             threads on the H200, two an SM, 110 KB of dynamic shared memory each). A link
             stages x (k halves: 3584 = hidden, 18944 = down's input) into shared memory with
             16-byte cp.async, sums it (a block reduction) and writes its 1/grid slice of the
             next x, so it depends on every CTA of the link before. Per link: launches with PDL
             and griddepcontrol.wait before x (the decode step's form); the same without the
             wait (wrong results: the launches' bound); plain stream order (no PDL); one launch
             of `links` rounds with a grid barrier (one counter: release arrive, acquire spin)
             between them.
  x behind weights
             the PDL chain, each CTA first requesting W KB of bulk copies of memory nothing
             else reads (the next kernel's weights), then x: the link's time, and the median
             and 90th percentile over CTAs of thread 0's time from the wait to x landed. Also
             with every other CTA requesting 2W: whether x waits on its own SM's copies or on
             everyone's shows in the CTAs that requested none.
  copy streams
             64 MB a launch (24 launches over fresh memory) through a 96 KB ring: one or two
             producer warps, 1, 2 or 4 bulk copies of 4 KB or one of 16 KB per mbarrier
             handshake (a consumer lane releases each slot as it lands), on decode
             attention's grid (Geometry.attn_ctas) and the GEMVs' (two CTAs an SM), or on the
             grids --stream-grids names (e.g. 112: fewer SMs than the GPU has, each streaming
             more: does the rate hold?).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from nanoqwen.cuda import jit, registry
from nanoqwen.cuda.device import Gpu
from nanoqwen.harness.bench import time_graph

GEOMETRY = registry.DEFAULT_GEOMETRY
THREADS = 288  # kProbeThreads: the GEMVs' block (GEOMETRY.gv_threads)
SMEM = GEOMETRY.gv_smem  # a GEMV CTA's: two CTAs an SM
WEIGHT_KB = (0, 16, 32, 48)  # per CTA; every other CTA then requests twice this
STREAM_BYTES = 64 << 20  # a copy-stream launch (one 32k layer's K + V is 67 MB)
STREAM_LAUNCHES = 24
RING = 96 * 1024  # the copy streams' ring (decode attention's at head dim 128)
# (copies per handshake, KB a copy): the stage sizes of decode attention (two 4 KB tiles a
# page) and of the GEMVs (7-19 KB), and larger.
STREAM_STAGES = ((1, 4), (2, 4), (4, 4), (1, 16))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", type=int, default=112, help="links a chain (4 a layer: 28 layers)")
    ap.add_argument("--stream-grids", default="",
                    help="comma list: the copy streams' CTA counts (default: decode attention's "
                         "grid and the GEMVs')")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    src = Path(__file__).with_suffix(".cu")
    names = ["probe_link", "probe_persist", "probe_stream"]
    mod = jit.compile_module(src.name, names, registry.header(None), source=src.read_text())
    gpu = Gpu()
    link, persist, stream = (mod.kernel(n) for n in names)
    for kern in (link, persist, stream):
        gpu.set_max_dynamic_smem(kern, SMEM)
    ctas = 2 * gpu.num_sms
    n = args.links
    xs = [gpu.alloc(18944 * 2, "x") for _ in range(2)]
    for x in xs:
        gpu.memset(x.ptr, 0, 18944 * 2)
    bar = gpu.alloc(4, "barrier")
    gpu.memset(bar.ptr, 0, 4)
    lat = gpu.alloc(n * ctas * 4, "x latency")
    w_link = 2 * max(WEIGHT_KB) * 1024 * (ctas // 2)  # the bytes one link may request
    w_bytes = max(n * w_link, STREAM_LAUNCHES * STREAM_BYTES)
    w = gpu.alloc(w_bytes, "weights")
    gpu.memset(w.ptr, 1, w_bytes)
    rows: list[dict] = []

    def chain(k: int, wait: bool, pdl: bool, w_cta: int = 0, w_every: int = 1) -> float:
        def body(s) -> None:
            for i in range(n):
                gpu.launch(link, (ctas, 1, 1), THREADS, xs[i % 2].ptr, xs[1 - i % 2].ptr,
                           np.int32(k), np.int32(wait), w.ptr + i * w_link, np.uint32(w_cta),
                           np.int32(w_every), lat.ptr + 4 * i * ctas, smem=SMEM, pdl=pdl,
                           stream=s)  # fmt: skip

        return 1e6 * time_graph(gpu, body, 1, timed=7) / n

    def barrier(k: int) -> float:
        def body(s) -> None:
            gpu.launch(persist, (ctas, 1, 1), THREADS, xs[0].ptr, xs[1].ptr, np.int32(k),
                       np.int32(n), bar.ptr, smem=SMEM, stream=s)  # fmt: skip

        return 1e6 * time_graph(gpu, body, 1, timed=7) / n

    def copies(grid: int, producers: int, cpi: int, kb: int) -> tuple[float, float]:
        chunk = cpi * kb * 1024
        per_cta = STREAM_BYTES // grid // chunk * chunk

        def body(s) -> None:
            for i in range(STREAM_LAUNCHES):
                gpu.launch(stream, (grid, 1, 1), THREADS, w.ptr + i * STREAM_BYTES,
                           np.int64(per_cta), np.uint32(kb * 1024), np.int32(cpi),
                           np.int32(RING // chunk), np.int32(producers), smem=RING, pdl=True,
                           stream=s)  # fmt: skip

        us = 1e6 * time_graph(gpu, body, 1, timed=5) / STREAM_LAUNCHES
        return us, per_cta * grid / us / 1e6

    print(f"{gpu.name}: {ctas} CTAs x {THREADS} threads, {SMEM >> 10} KB shared memory each, "
          f"{n} links a chain\n\nboundary (us a link)")  # fmt: skip
    print(f"{'x halves':>9} {'PDL+wait':>9} {'no wait':>8} {'no PDL':>7} {'barrier':>8}")
    for k in (0, 3584, 18944):
        r = dict(test="boundary", k=k, pdl_wait=chain(k, True, True),
                 pdl_no_wait=chain(k, False, True), no_pdl=chain(k, True, False),
                 grid_barrier=barrier(k))  # fmt: skip
        rows.append(r)
        print(f"{k:9} {r['pdl_wait']:9.2f} {r['pdl_no_wait']:8.2f} {r['no_pdl']:7.2f} "
              f"{r['grid_barrier']:8.2f}")  # fmt: skip

    print("\nx behind weights (PDL + wait; x latency: wait -> x landed, ns over CTAs)")
    print(f"{'x halves':>9} {'W KB':>5} {'CTAs':>6} {'us a link':>10} {'median':>7} {'p90':>6}"
          f" | without copies: {'median':>6} {'p90':>6}")  # fmt: skip
    for k in (3584, 18944):
        for kb in WEIGHT_KB:
            for every in (1, 2) if kb else (1,):
                if k * 2 + every * kb * 1024 > SMEM:  # x and the copies share the CTA's room
                    continue
                us = chain(k, True, True, every * kb * 1024, every)
                ns = np.empty((n, ctas), np.uint32)
                gpu.download(lat.ptr, ns)
                mine = (np.arange(ctas) % every == 0) if kb else np.ones(ctas, bool)
                a, b = ns[:, mine].ravel(), ns[:, ~mine].ravel()
                r = dict(test="x_behind_weights", k=k, kb=every * kb, every=every, us=us,
                         median_ns=float(np.median(a)),
                         p90_ns=float(np.percentile(a, 90)))  # fmt: skip
                line = (f"{k:9} {every * kb:5} {'1 in ' + str(every):>6} {us:10.2f} "
                        f"{r['median_ns']:7.0f} {r['p90_ns']:6.0f}")  # fmt: skip
                if b.size:
                    r.update(other_median_ns=float(np.median(b)),
                             other_p90_ns=float(np.percentile(b, 90)))  # fmt: skip
                    line += f" | {'':16} {r['other_median_ns']:6.0f} {r['other_p90_ns']:6.0f}"
                rows.append(r)
                print(line, flush=True)

    print(f"\ncopy streams ({STREAM_BYTES >> 20} MB a launch, {RING >> 10} KB ring)")
    print(f"{'CTAs':>5} {'producers':>9} {'per handshake':>14} {'us':>7} {'TB/s':>5}")
    grids = [int(g) for g in args.stream_grids.split(",") if g] or [GEOMETRY.attn_ctas, ctas]
    for grid in grids:
        for producers in (1, 2):
            for cpi, kb in STREAM_STAGES:
                us, tbs = copies(grid, producers, cpi, kb)
                rows.append(dict(test="copy_stream", ctas=grid, producers=producers,
                                 copies=cpi, copy_kb=kb, us=us, tb_s=tbs))  # fmt: skip
                print(f"{grid:5} {producers:9} {f'{cpi} x {kb} KB':>14} {us:7.2f} {tbs:5.2f}",
                      flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": gpu.name, "ctas": ctas, "links": n, "rows": rows}, fh, indent=1)
    gpu.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
