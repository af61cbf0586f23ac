"""The q/k/v GEMM with RoPE + K/V as its epilogue, checked and timed against the two launches.

Run on an sm_90 GPU:

    PYTHONPATH=. python3 dev/rope_fuse_check.py [FILE.nanoqwen ...] [--runs 10] [--rounds 4]
        [--out DIR]

(default files /tmp/s32b.nanoqwen /tmp/s7b.nanoqwen). For each model in turn (its engine built,
then closed before the next): each part runs on its own (gpu_script.run_part), so one that
fails leaves the others' results.

check: fresh random INT4 q/k/v weights of the model's shape (N = q + 2 kv, K = hidden) and
bias, fresh activations; the old path (the GEMM into qkv, then rope_kv_write) and the fused
GEMM (a RoPE tile) each into their own q buffer and K/V caches, all poisoned with NaN before
the launches, behind a scattered page table with spare pages, at (start, T) in CASES. The two
must agree bit for bit over the whole buffers (the fused epilogue rounds q/k/v to fp16 before
rotating, as rope_kv_write reads them; the spare pages and positions outside start .. start +
T - 1 stay NaN in both), and the fused output must match a PyTorch reference (fp32 GEMM, fp16
rounding, RoPE in fp32 from nanoqwen.rope's table) within ROPE_REL_TOL of max|ref|.

kernels: at M = 512 on the model's shapes, the q/k/v GEMM + rope_kv_write against the fused
GEMM, then every tile of every projection beside cuBLAS fp16 (dev/prefill_check.py's
time_shape: 20 calls queued behind a spin kernel, median of 5), the data for the GEMMs' next
step.

ttft: the TTFT of a 512-token prompt (generate() until the first token is on the host, what
`nanoqwen bench` takes; median of --runs after 3 warm-ups) with the engine's prefill fused
(Forward.fused_rope) and as two launches, interleaved over --rounds rounds in one process;
then, fused, with every RMSNorm launch skipped (wrong tokens, timing only): what fusing the
norms away could save at most.

Printed last: a table, one row a model: check PASS/FAIL (max |fused - old| in fp16 ulps is 0
when bitwise equal), TTFT old / new medians (ms) and the saving.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from prefill_check import time_ms, time_shape  # dev/, this script's directory
from ttft_profile import skipping

from nanoqwen.config import PAGE_TOKENS
from nanoqwen.engine import CudaBackend
from nanoqwen.engine.kv_cache import kv_cache_from_device
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness.gpu_script import run_part
from nanoqwen.harness.prefill_checks import (
    ROPE_REL_TOL,
    gemm_shapes,
    random_int4_weight,
    rope_reference,
    wait_or_die,
)
from nanoqwen.rope import rope_table
from nanoqwen.sampling import SamplingParams

CASES = ((0, 512), (0, 1), (13, 77), (1000, 300), (37, 513))  # (start, T): whole and part tiles
PROMPT = 512


def _poisoned(*shape) -> torch.Tensor:
    return torch.full(shape, float("nan"), device="cuda", dtype=torch.float16)


def check_case(e: CudaBackend, words, scales, deq, bias, start: int, T: int, gen) -> dict:
    """One (start, T): the fused GEMM against the two launches and the reference."""
    c, pk = e.config, e.prefill_kernels
    hd, nq, nkv = c.head_dim, c.num_heads, c.num_kv_heads
    n, k = c.q_size + 2 * c.kv_size, c.hidden_size
    pages = -(-(start + T) // PAGE_TOKENS) + 3
    table = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32)
    h = torch.randn(T, k, device="cuda", dtype=torch.float16, generator=gen)
    rope = e.forward.rope
    outs = {}
    for name in ("old", "fused"):
        q = _poisoned(T, nq, hd)
        kc, vc = _poisoned(pages, nkv, PAGE_TOKENS, hd), _poisoned(pages, nkv, PAGE_TOKENS, hd)
        qkv = _poisoned(T, n)
        torch.cuda.synchronize()
        rk = (rope, table, kc, vc, q, start)
        if name == "old":
            pk.gemm(h, words, scales, bias, qkv, T, n, k)
            ptrs = [x.data_ptr() for x in (qkv, table, kc, vc, q)]  # DecodeKernels takes ints
            e.kernels.rope_kv(ptrs[0], start, rope, *ptrs[1:], T)
        else:
            pk.gemm(h, words, scales, bias, qkv, T, n, k, rope_kv=rk)
        wait_or_die(e.gpu, f"{name} q/k/v start={start} T={T}")
        outs[name] = (q, kc, vc)
    ulps = 0
    for a, b in zip(outs["old"], outs["fused"], strict=True):
        bits_a, bits_b = a.view(torch.int16).int(), b.view(torch.int16).int()
        ulps = max(ulps, (bits_a - bits_b).abs().max().item())  # 0: bitwise equal
    # The reference: fp16(h @ deq^T + bias), rotated in fp32, at positions start .. start + T - 1.
    qkv_ref = (h.float() @ deq.float().t() + bias.float()).half().float()
    cs = torch.from_numpy(rope_table(c, start + T)).cuda().view(start + T, hd // 2, 2)[start:]
    q_ref = rope_reference(qkv_ref[:, : c.q_size].view(T, nq, hd), cs)
    k_ref = rope_reference(qkv_ref[:, c.q_size : c.q_size + c.kv_size].view(T, nkv, hd), cs)
    v_ref = qkv_ref[:, c.q_size + c.kv_size :].view(T, nkv, hd)
    q, kc, vc = outs["fused"]
    perm = table.cpu().numpy()

    def rows(cache):  # [pages, n_kv, PT, D] device layout -> the positions' rows [T, n_kv, D]
        logical = kv_cache_from_device(cache.cpu().numpy())[perm]
        return torch.from_numpy(logical.reshape(-1, nkv, hd)[start : start + T]).cuda().float()

    diffs = torch.stack([(q.float() - q_ref).abs().max(), (rows(kc) - k_ref).abs().max(),
                         (rows(vc) - v_ref).abs().max()])  # fmt: skip
    err = float("nan") if torch.isnan(diffs).any() else diffs.max().item()
    scale = max(q_ref.abs().max().item(), k_ref.abs().max().item(), v_ref.abs().max().item())
    ok = ulps == 0 and err <= ROPE_REL_TOL * scale  # NaN (an unwritten output) fails both
    return {"ok": ok, "ulps": ulps, "err": err, "scale": scale}


def check(e: CudaBackend, log) -> dict:
    c = e.config
    gen = torch.Generator(device="cuda")
    seed = int.from_bytes(os.urandom(4), "little")
    gen.manual_seed(seed)
    log(f"seed {seed}")
    n, k = c.q_size + 2 * c.kv_size, c.hidden_size
    words, scales, deq = random_int4_weight(n, k, gen)
    bias = torch.randn(n, device="cuda", dtype=torch.float16, generator=gen)
    rs = []
    for start, T in CASES:
        r = check_case(e, words, scales, deq, bias, start, T, gen)
        verdict = "ok " if r["ok"] else "BAD"
        log(f"  start={start:5d} T={T:4d}: {verdict} fused vs old {r['ulps']} ulps, "
            f"vs reference {r['err']:.3g} / max|ref| {r['scale']:.3g}")  # fmt: skip
        rs.append(r)
    rels = [r["err"] / r["scale"] for r in rs]
    return {
        "ok": all(r["ok"] for r in rs),
        "ulps": max(r["ulps"] for r in rs),
        "rel": float("nan") if any(x != x for x in rels) else max(rels),
    }


def kernels(e: CudaBackend, log) -> dict:
    """Milliseconds at M = PROMPT: q/k/v two launches vs fused, then each shape's tiles."""
    c, pk = e.config, e.prefill_kernels
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    n, k, m = c.q_size + 2 * c.kv_size, c.hidden_size, PROMPT
    words, scales, _ = random_int4_weight(n, k, gen)
    bias = torch.randn(n, device="cuda", dtype=torch.float16, generator=gen)
    h = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
    qkv = torch.empty(m, n, device="cuda", dtype=torch.float16)
    q = torch.empty(m, c.q_size, device="cuda", dtype=torch.float16)
    pages = -(-m // PAGE_TOKENS)
    kc = torch.empty(pages, c.num_kv_heads, PAGE_TOKENS, c.head_dim, device="cuda",
                     dtype=torch.float16)  # fmt: skip
    vc, table = torch.empty_like(kc), torch.arange(pages, device="cuda", dtype=torch.int32)
    ptrs = [x.data_ptr() for x in (qkv, table, kc, vc, q)]

    def two() -> None:
        pk.gemm(h, words, scales, bias, qkv, m, n, k)
        e.kernels.rope_kv(ptrs[0], 0, e.forward.rope, *ptrs[1:], m)

    def fused() -> None:
        pk.gemm(h, words, scales, bias, qkv, m, n, k, rope_kv=(e.forward.rope, *ptrs[1:], 0))

    out = {"qkv + rope_kv": time_ms(e.gpu, two), "qkv fused": time_ms(e.gpu, fused)}
    log(f"  M={m}: q/k/v GEMM + rope_kv_write {out['qkv + rope_kv'] * 1e3:.1f} us, fused "
        f"{out['qkv fused'] * 1e3:.1f} us")  # fmt: skip
    for name, shape in gemm_shapes(c).items():
        rows, _ = time_shape(pk, name, shape, gen, m)
        for shape_name, tile, ms, tf in rows:
            log(f"  {shape_name:8s} {tile:28s} {ms * 1e3:8.1f} us {tf:7.1f} TFLOP/s")
    return out


def ttft(e: CudaBackend, runs: int, rounds: int, log) -> dict:
    """TTFT at PROMPT tokens, old and fused interleaved: {name: [median a round]}."""
    ids = np.random.default_rng(0).integers(0, e.config.vocab_size, PROMPT).tolist()
    params = SamplingParams(max_tokens=1)

    def median_ms() -> float:
        times = []
        for r in range(3 + runs):
            t0 = time.perf_counter()
            for _ in e.generate(ids, params, frozenset()):
                t1 = time.perf_counter()
            if r >= 3:
                times.append(1e3 * (t1 - t0))
        return statistics.median(times)

    out = {"old": [], "fused": []}
    for _ in range(rounds):
        for name in out:
            e.forward.fused_rope = name == "fused"
            out[name].append(median_ms())
        log(f"  TTFT old {out['old'][-1]:.3f} ms, fused {out['fused'][-1]:.3f} ms")
    e.forward.fused_rope = True
    out["no_norm"] = float("nan")  # a failure here must not lose the A/B above
    try:
        with skipping(e, "rmsnorm"):
            out["no_norm"] = median_ms()
    except Exception as exc:  # noqa: BLE001
        log(f"  TTFT without the RMSNorm launches: FAILED {exc!r}")
    log(f"  TTFT fused without the RMSNorm launches {out['no_norm']:.3f} ms (timing only)")
    return out


def run_model(path: str, args, log) -> dict:
    results: dict = {}
    t0 = time.time()
    f = NanoqwenFile(path)
    e = CudaBackend(f, max_context=2048, prefix_caching=False)
    log(f"{path}: {f.config.num_layers} layers, hidden {f.config.hidden_size}; engine built in "
        f"{time.time() - t0:.1f} s")  # fmt: skip
    try:
        with torch.cuda.stream(torch.cuda.ExternalStream(int(e.gpu.stream.handle))):
            run_part("check", results, log, lambda: check(e, log))
            run_part("kernels", results, log, lambda: kernels(e, log))
        run_part("ttft", results, log, lambda: ttft(e, args.runs, args.rounds, log))
    finally:
        e.close()
        f.close()
        torch.cuda.empty_cache()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", default=["/tmp/s32b.nanoqwen", "/tmp/s7b.nanoqwen"])
    ap.add_argument("--runs", type=int, default=10, help="timed generate() calls a median")
    ap.add_argument("--rounds", type=int, default=4, help="old / fused alternations")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="log directory")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's matmul stays fp32
    torch.cuda.init()
    os.makedirs(args.out, exist_ok=True)
    fh = open(os.path.join(args.out, "rope_fuse_check.log"), "w")  # noqa: SIM115

    def log(msg: str) -> None:
        print(msg, flush=True)
        fh.write(msg + "\n")
        fh.flush()

    log(f"device {torch.cuda.get_device_name()} date {time.strftime('%Y-%m-%d %H:%M')}")
    table = {}
    for path in args.files:
        table[path] = run_part(path, {}, log, lambda p=path: run_model(p, args, log))
    log(f"\n{'model':28s} {'check':6s} {'ulps':>5s} {'rel err':>8s} {'TTFT old':>9s} "
        f"{'fused':>8s} {'saved':>7s} {'no norm':>8s}  (ms, medians of the rounds)")  # fmt: skip
    all_ok = True
    for path, res in table.items():
        chk = (res or {}).get("check")
        tt = (res or {}).get("ttft")
        ok = bool(chk and chk["ok"])
        all_ok &= ok and tt is not None
        c_txt = f"{'PASS' if ok else 'FAIL':6s} {chk['ulps']:5d} {chk['rel']:8.2e}" if chk else (
            f"{'FAIL':6s} {'-':>5s} {'-':>8s}")  # fmt: skip
        if tt:
            old, new = statistics.median(tt["old"]), statistics.median(tt["fused"])
            t_txt = f"{old:9.3f} {new:8.3f} {old - new:7.3f} {tt['no_norm']:8.3f}"
        else:
            t_txt = f"{'-':>9s} {'-':>8s} {'-':>7s} {'-':>8s}"
        log(f"{os.path.basename(path):28s} {c_txt} {t_txt}")
    log(f"RESULT {'PASS' if all_ok else 'FAIL'}")
    fh.close()
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
