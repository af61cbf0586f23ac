"""The validation ladder (config/nanoqwen.yaml): unit -> layer -> graph.

unit   every decode kernel against a numpy reference on awkward sizes, fresh random inputs,
       outputs poisoned with NaN before the launch (unwritten elements show up as NaN)
layer  one decoder block (layer 0) of the CUDA engine, token by token through the decode path,
       against nanoqwen.reference on the same file
graph  N prompts end to end: teacher-forced logits of the decode path and of the prefill path
       against the reference (top-1 agreement, max |dlogit| / std), and greedy generations equal

These layer and graph tiers are for synthetic files (random ids: the synthetic models keep clear
margins on them); real weights get theirs on real code (harness.validate_real).

Every check returns a `Check(tier, name, ok, detail)`; `run(...)` prints a table and returns
the checks. Tolerances come from the yaml with the reason next to each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..config import GROUP_SIZE, PAGE_TOKENS, ModelConfig
from ..engine.decode_loop import DecodeState
from ..engine.kv_cache import kv_cache_from_device, kv_cache_to_device, kv_tiles_to_device
from ..errors import NanoqwenError
from ..quant import dequantize_packed, quantize_rows_int8
from ..rope import rope_table


@dataclass
class Check:
    tier: str
    name: str
    ok: bool
    detail: str


def _f16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16)


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    scale = max(np.sqrt(np.mean(ref**2)), 1e-30)
    return float(np.max(np.abs(got - ref)) / scale)


class _Dev:
    """Tiny helper: device copies of numpy arrays, NaN-poisoned outputs, downloads."""

    def __init__(self, gpu):
        self.gpu, self.bufs = gpu, []

    def put(self, a: np.ndarray) -> int:
        b = self.gpu.alloc(a.nbytes, "validate")
        self.bufs.append(b)
        self.gpu.upload(b.ptr, a)
        return b.ptr

    def out(self, shape, dtype) -> tuple[int, np.ndarray]:
        host = np.empty(shape, dtype)
        b = self.gpu.alloc(host.nbytes, "validate out")
        self.bufs.append(b)
        self.gpu.memset(b.ptr, 0xFF, host.nbytes)  # all-ones bytes = NaN in fp16 and fp32
        return b.ptr, host

    def get(self, ptr: int, host: np.ndarray) -> np.ndarray:
        self.gpu.sync("validate")
        return self.gpu.download(ptr, host)

    def free(self):
        for b in self.bufs:
            b.free()
        self.bufs.clear()


# --- unit tier ---------------------------------------------------------------------------------
def _rand_int4(rng, n: int, k: int):
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint64).astype(np.uint32)
    scales = _f16(rng.uniform(0.5, 1.5, size=(n, k // GROUP_SIZE)) / (7 * np.sqrt(k)))
    return words, scales, dequantize_packed(words, scales)


def _rms(x, w, eps):
    x = x.astype(np.float32)
    return _f16(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float32))


def _rope_ref(heads: np.ndarray, rope: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """NEOX RoPE of heads [T, n, D] at positions pos [T] -> float64 (the kernels rotate in
    fp32, unrounded inputs, and round q once after; K goes into its cache whole)."""
    half = heads.shape[-1] // 2
    c, s = rope[pos, :, 0][:, None, :], rope[pos, :, 1][:, None, :]
    x1, x2 = heads[..., :half].astype(np.float64), heads[..., half:].astype(np.float64)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def _k_tol(k, tol: dict) -> float:
    """The K cache's bound: k_pair for the (hi, lo) cache (kv_cache.cuh), else one fp16
    rounding (gemv's)."""
    return tol["k_pair"] if k.geometry.k_parts == 2 else tol["gemv"]


def unit_gemv(k, dev, cfg: ModelConfig, rng, tol: dict) -> list[Check]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    cases = [("o", h, (2, 1110, h)), ("gate_up", h, (1, 17, i)), ("down", i, (2, 46, h))]
    out = []
    for kind, kdim, ns in cases:
        for n in ns:
            rows = 2 * n if kind == "gate_up" else n
            words, scales, deq = _rand_int4(rng, rows, kdim)
            x = _f16(rng.standard_normal(kdim))
            if kind == "down":  # the MLP's activations carry a few huge outliers
                x[rng.choice(kdim, 8, replace=False)] = _f16(rng.choice([-300.0, 300.0], 8))
            normw = _f16(1 + 0.1 * rng.standard_normal(kdim))
            # The residual in fp32 off the fp16 grid: a kernel that rounded it would show.
            resid = rng.standard_normal(n).astype(np.float32)
            xin = _rms(x, normw, cfg.rms_norm_eps) if kind == "gate_up" else x
            y = deq.astype(np.float64) @ xin.astype(np.float64)
            optr, host = dev.out(n, np.float16)
            if kind == "gate_up":
                g, u = y[:n], y[n:]
                ref, rptr = g / (1 + np.exp(-g)) * u, 0
            else:
                ref, rptr = resid.astype(np.float64) + y, dev.put(resid)
            k.gemv(kind, dev.put(x), dev.put(normw) if kind == "gate_up" else 0, dev.put(words),
                   dev.put(scales), optr, n, rptr)  # fmt: skip
            got, copy_ok, note = dev.get(optr, host), True, ""
            if rptr:  # the fp32 residual is the result; out must be its fp16 copy, exactly
                res = dev.get(rptr, np.empty(n, np.float32))
                copy_ok = np.array_equal(_f16(res), got)
                got, note = res, "" if copy_ok else ", fp16 copy WRONG"
            err = _rel_err(got, ref)
            lim = tol["swiglu"] if kind == "gate_up" else tol["gemv"]
            out.append(Check("unit", f"gemv {kind} N={n} K={kdim}", err <= lim and copy_ok,
                             f"{err:.2e}{note}"))  # fmt: skip
            dev.free()
    out += unit_qkv_rope(k, dev, cfg, rng, tol["gemv"], _k_tol(k, tol))
    return out


def unit_qkv_rope(k, dev, cfg: ModelConfig, rng, tol: float, k_tol: float) -> list[Check]:
    """RMSNorm + q/k/v GEMV + bias + RoPE + K/V page write against numpy, at a first-page,
    a mid-page and a page-crossing position of a scattered page table. K within k_tol (the
    (hi, lo) cache holds it far inside one fp16 rounding), q and v within tol."""
    out, h, npages, parts = [], cfg.hidden_size, 40, k.geometry.k_parts
    hq, hkv, d, n = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_size + 2 * cfg.kv_size
    rope = rope_table(cfg, npages * PAGE_TOKENS)
    table = rng.permutation(npages).astype(np.int32)
    for pos in (0, 21, npages * PAGE_TOKENS - 1):
        words, scales, deq = _rand_int4(rng, n, h)
        x = _f16(rng.standard_normal(h))
        normw = _f16(1 + 0.1 * rng.standard_normal(h))
        bias = _f16(rng.standard_normal(n))
        qkv = (deq.astype(np.float64) @ _rms(x, normw, cfg.rms_norm_eps).astype(np.float64)
               + bias)  # fmt: skip
        heads = qkv[: cfg.q_size + cfg.kv_size].reshape(1, hq + hkv, d)
        rot = _rope_ref(heads, rope, np.array([pos]))[0]
        q_ptr, qh = dev.out((hq, d), np.float16)
        kc_ptr, kc = dev.out((npages, hkv, parts, PAGE_TOKENS, d), np.float16)  # device layout
        vc_ptr, vc = dev.out((npages, hkv, 1, PAGE_TOKENS, d), np.float16)
        k.qkv_rope(dev.put(x), dev.put(normw), dev.put(words), dev.put(scales), dev.put(bias),
                   dev.put(np.array([pos], np.int32)), dev.put(rope), dev.put(table), kc_ptr,
                   vc_ptr, q_ptr)  # fmt: skip
        got_q = dev.get(q_ptr, qh)
        kc = kv_cache_from_device(dev.get(kc_ptr, kc))
        vc = kv_cache_from_device(dev.get(vc_ptr, vc))
        slot = table[pos // PAGE_TOKENS], pos % PAGE_TOKENS
        got_k, got_v = kc[slot].copy(), vc[slot].copy()
        kc[slot], vc[slot] = np.nan, np.nan
        err = max(_rel_err(got_q, rot[:hq]),
                  _rel_err(got_v, qkv[cfg.q_size + cfg.kv_size :].reshape(hkv, d)))  # fmt: skip
        k_err = _rel_err(got_k, rot[hq:])
        untouched = bool(np.isnan(kc).all() and np.isnan(vc).all())  # only the slot written
        note = f"{err:.2e}, K {k_err:.2e}, other slots {'untouched' if untouched else 'WRITTEN'}"
        ok = err <= tol and k_err <= k_tol and untouched
        out.append(Check("unit", f"qkv+rope+kv pos={pos}", ok, note))
        dev.free()
    return out


def unit_small(k, dev, cfg: ModelConfig, rng, tol: float) -> list[Check]:
    out = []
    h = cfg.hidden_size
    # 1024 random rows tiled over the vocabulary: a full random 7B table costs seconds of host
    # time for no extra coverage (the kernel's indexing is what is under test).
    embed = np.resize(_f16(rng.standard_normal((1024, h))), (cfg.vocab_size, h))
    eptr = dev.put(embed)
    for T in (1, 3, 17):
        ids = rng.integers(0, cfg.vocab_size, T).astype(np.int32)
        optr, host = dev.out((T, h), np.float16)
        rptr, rhost = dev.out((T, h), np.float32)
        k.embed(dev.put(ids), eptr, optr, rptr, T)
        got, res = dev.get(optr, host), dev.get(rptr, rhost)
        ok = np.array_equal(got, embed[ids]) and np.array_equal(res, embed[ids].astype(np.float32))
        out.append(Check("unit", f"embed T={T}", ok, "exact, fp16 x and fp32 residual"))
        x = _f16(3 * rng.standard_normal((T, h)))
        w = _f16(1 + 0.1 * rng.standard_normal(h))
        optr, host = dev.out((T, h), np.float16)
        k.rmsnorm(dev.put(x), dev.put(w), optr, T)
        err = _rel_err(dev.get(optr, host), _rms(x, w, cfg.rms_norm_eps))
        out.append(Check("unit", f"rmsnorm T={T}", err <= tol, f"{err:.2e}"))
    dev.free()
    return out


def unit_rope_attention(k, dev, cfg: ModelConfig, rng, tol: float, k_tol: float) -> list[Check]:
    """rope_kv_write (q, and v exactly, within tol of numpy; K within k_tol) and decode
    attention at single-page, page-edge and multi-cluster lengths."""
    out, parts = [], k.geometry.k_parts
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv_n, npages = cfg.q_size + 2 * cfg.kv_size, 300
    rope = rope_table(cfg, npages * PAGE_TOKENS)
    rptr = dev.put(rope)
    table = rng.permutation(npages).astype(np.int32)  # scattered pages
    tptr = dev.put(table)
    for T, pos0 in ((1, 0), (3, 14), (17, 37)):
        qkv = rng.standard_normal((T, qkv_n)).astype(np.float32)  # the q/k/v GEMM's fp32 out
        kc_ptr, kc = dev.out((npages, hkv, parts, PAGE_TOKENS, d), np.float16)  # device layout
        vc_ptr, vc = dev.out((npages, hkv, 1, PAGE_TOKENS, d), np.float16)
        q_ptr, qh = dev.out((T, hq, d), np.float16)
        k.rope_kv(dev.put(qkv), pos0, rptr, tptr, kc_ptr, vc_ptr, q_ptr, T)
        pos = pos0 + np.arange(T)
        heads = qkv[:, : cfg.q_size + cfg.kv_size].reshape(T, hq + hkv, d)
        rot = _rope_ref(heads, rope, pos)
        v_ref = qkv[:, cfg.q_size + cfg.kv_size :].reshape(T, hkv, d)
        got_q = dev.get(q_ptr, qh)
        kc = kv_cache_from_device(dev.get(kc_ptr, kc))
        vc = kv_cache_from_device(dev.get(vc_ptr, vc))
        slots = table[pos // PAGE_TOKENS], pos % PAGE_TOKENS
        k_err = _rel_err(kc[slots], rot[:, hq:])
        ok = (_rel_err(got_q, rot[:, :hq]) <= tol and k_err <= k_tol
              and np.array_equal(vc[slots], _f16(v_ref)))  # fmt: skip
        out.append(Check("unit", f"rope_kv_write T={T} pos0={pos0}", ok, f"K {k_err:.2e}"))
        dev.free()
        rptr, tptr = dev.put(rope), dev.put(table)
    S = k.geometry.attn_splits
    # Single-page and page-edge lengths (one cluster, ranks without pages up to 111), then the
    # merge over clusters (ceil(L / 16 / 128) of them, capped: 4097 and 8193); a last page
    # holding a single valid token at 17, 33, 129, 4097, 8193.
    lengths = (1, 16, 17, 33, 111, 129, 1000, 4097, 8193)
    apages = -(-max(lengths) // PAGE_TOKENS) + 7
    acache = (apages, PAGE_TOKENS, hkv, d)
    g = cfg.group_ratio
    for L in lengths:
        # K's parts: any fp16 values (the kernel sums them), so a part left out shows.
        k_parts = [_f16(rng.standard_normal(acache) / (1 + 3 * i)) for i in range(parts)]
        kc, vc = sum(p.astype(np.float64) for p in k_parts), _f16(rng.standard_normal(acache))
        q = _f16(rng.standard_normal((hq, d)))
        atable = rng.permutation(apages).astype(np.int32)  # scattered pages
        optr, host = dev.out((hq, d), np.float16)  # NaN-poisoned
        ml, _ = dev.out((hq, S, 2), np.float32)
        acc, _ = dev.out((hq, S, d), np.float32)
        cnt = dev.put(np.zeros(hkv, np.int32))  # last-CTA counters: zero once, re-armed by each
        args = (dev.put(q), dev.put(kv_tiles_to_device(k_parts)), dev.put(kv_cache_to_device(vc)),
                dev.put(atable),
                dev.put(np.array([L - 1], np.int32)), ml, acc, cnt)  # fmt: skip
        k.attention(*args, optr)
        got = dev.get(optr, host).copy()
        left = dev.get(cnt, np.empty(hkv, np.int32)).copy()
        k.gpu.memset(optr, 0xFF, host.nbytes)  # replay on the same counters (a graph would)
        k.attention(*args, optr)
        again = dev.get(optr, host)
        pos = np.arange(L)
        kk = kc[atable[pos // PAGE_TOKENS], pos % PAGE_TOKENS].astype(np.float64)  # [L, hkv, d]
        vv = vc[atable[pos // PAGE_TOKENS], pos % PAGE_TOKENS].astype(np.float64)
        ref = np.empty((hq, d))
        for hh in range(hq):
            sc = kk[:, hh // g] @ q[hh].astype(np.float64) / np.sqrt(d)
            p = np.exp(sc - sc.max())
            ref[hh] = (p / p.sum()) @ vv[:, hh // g]
        err = _rel_err(got, ref)
        replay = np.array_equal(again.view(np.uint16), got.view(np.uint16))
        ok = err <= tol and replay and not left.any()
        detail = f"{err:.2e}" + ("" if replay else ", replay differs")
        detail += f", counters left {left.tolist()}" if left.any() else ""
        out.append(Check("unit", f"attention L={L}", ok, detail))
        dev.free()
    dev.free()
    return out


def unit_lm_sample(k, dev, cfg: ModelConfig, rng, tol: float) -> list[Check]:
    out, h = [], cfg.hidden_size
    # Tiled rows (see unit_small): equal logits every 1021 rows also test the lowest-id tie rule.
    w = np.resize(_f16(rng.standard_normal((1021, h)) * 0.05), (cfg.vocab_size, h))
    wptr = dev.put(w)
    for V in (2, 34, cfg.vocab_size):
        x = _f16(rng.standard_normal(h))
        nw = _f16(1 + 0.1 * rng.standard_normal(h))
        lptr, host = dev.out(V, np.float32)
        key = dev.put(np.zeros(1, np.uint64))
        k.lm_head(dev.put(x), dev.put(nw), wptr, lptr, key, rows=V)
        ref = w[:V].astype(np.float64) @ _rms(x, nw, cfg.rms_norm_eps).astype(np.float64)
        got = dev.get(lptr, host)
        err = _rel_err(got, ref)
        out.append(Check("unit", f"lm_head V={V}", err <= tol, f"{err:.2e}"))
        if V == cfg.vocab_size:
            # The greedy pick is an eos id: done must be set.
            state = DecodeState(pos=5, max_new=10, eos=(int(np.argmax(got)),)).to_words()
            sptr, ring = dev.put(state), dev.put(np.zeros(16, np.int32))
            k.sample(lptr, key, sptr, ring, 0, 0, 0)
            st = DecodeState.from_words(dev.get(sptr, np.empty_like(state)))
            r = dev.get(ring, np.empty(16, np.int32))
            ok = r[0] == np.argmax(got) and st.pos == 6 and st.step == 1 and st.done
            out.append(Check("unit", "sample greedy + state", bool(ok), f"token {r[0]}"))
        dev.free()
        wptr = dev.put(w)
    dev.free()
    return out


def unit_lm_head_q8(k, dev, cfg: ModelConfig, rng, tol: float) -> list[Check]:
    """lm_head_argmax_q8 against the dequantized int8 head (the reference model's), rows of
    different norms so the row scales differ; the key's id must be the reference's argmax."""
    out, h = [], cfg.hidden_size
    rows = rng.uniform(0.05, 3, (1021, 1)) * rng.standard_normal((1021, h)) * 0.05
    q, scale = quantize_rows_int8(np.resize(_f16(rows), (cfg.vocab_size, h)))
    qptr, sptr = dev.put(q), dev.put(scale)
    for V in (1, 34, cfg.vocab_size):
        x = _f16(rng.standard_normal(h))
        nw = _f16(1 + 0.1 * rng.standard_normal(h))
        lptr, host = dev.out(V, np.float32)
        key = dev.put(np.zeros(1, np.uint64))
        k.lm_head_q8(dev.put(x), dev.put(nw), qptr, sptr, lptr, key, rows=V)
        xn = _rms(x, nw, cfg.rms_norm_eps).astype(np.float64)
        ref = (q[:V].astype(np.float64) @ xn) * scale[:V]
        got = dev.get(lptr, host)
        got_key = int(dev.get(key, np.empty(1, np.uint64))[0])
        err = _rel_err(got, ref)
        ok = err <= tol and 0xFFFFFFFF - (got_key & 0xFFFFFFFF) == int(np.argmax(got))
        out.append(Check("unit", f"lm_head int8 V={V}", bool(ok), f"{err:.2e}"))
    dev.free()
    return out


def _argmax_key(v: float, i: int) -> np.uint64:
    """decode_misc.cu argmax_key: the (logit, -id) order as one u64."""
    b = int(np.float32(v).view(np.uint32))
    b = (~b & 0xFFFFFFFF) if b & 0x80000000 else (b | 0x80000000)
    return np.uint64((b << 32) | (0xFFFFFFFF - i))


def unit_sampling(k, dev, cfg: ModelConfig, rng, draws: int = 4000) -> list[Check]:
    """The device sampler (temperature, top-k, top-p) against the host rule in sampling.py:
    `draws` seeds on one logits vector; every pick must be in the kept set and each kept
    token's frequency within 5 sigma of its probability (binomial), for three settings."""
    V, out = cfg.vocab_size, []
    logits = np.full(V, -60.0, np.float32)  # background mass < 1e-14: never drawn
    hot = rng.choice(V, 12, replace=False)
    logits[hot] = rng.uniform(-2.0, 2.0, 12).astype(np.float32)
    lptr, top = dev.put(logits), int(np.argmax(logits))
    key = dev.put(np.zeros(1, np.uint64))
    ring = dev.put(np.zeros(4, np.int32))
    sptr = dev.put(DecodeState().to_words())
    for temp, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)):
        order = np.lexsort((np.arange(V), -logits))  # descending, ties by id
        z = np.exp((logits[order] - logits[top]) / temp)
        keep = top_k if top_k else V
        p = z[:keep] / z[:keep].sum()
        if top_p < 1.0:
            before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
            p = p[: int((before < top_p).sum())]
        p = p / p.sum()
        kept = order[: len(p)]
        state = DecodeState(max_new=1, top_k=top_k, temperature=temp, top_p=top_p)
        counts: dict[int, int] = {}
        for seed in range(draws):
            state.seed = seed
            k.gpu.upload(sptr, state.to_words())
            k.gpu.upload(key, np.array([_argmax_key(logits[top], top)]))
            k.sample(lptr, key, sptr, ring, 0, 0, 0)
            tok = int(dev.get(ring, np.empty(4, np.int32))[0])
            counts[tok] = counts.get(tok, 0) + 1
        kept_set = set(kept.tolist())
        outside = sum(c for t, c in counts.items() if t not in kept_set)
        freq = np.array([counts.get(int(t), 0) for t in kept]) / draws
        sigma = np.sqrt(p * (1 - p) / draws) + 1e-12
        worst = float(np.max(np.abs(freq - p) / sigma))
        ok = outside == 0 and worst <= 5.0
        out.append(Check("unit", f"sample T={temp} top_k={top_k} top_p={top_p}", ok,
                         f"{len(p)} kept, worst {worst:.1f} sigma, {outside} outside"))  # fmt: skip
    dev.free()
    return out


def unit_tier(
    config: ModelConfig, tol: dict, seed: int | None = None, k_cache: str | None = None
) -> list[Check]:
    """The decode kernels against numpy, built for the K cache format `k_cache`
    (registry.K_CACHE; None: the default)."""
    from ..cuda.decode import DecodeKernels
    from ..cuda.device import Gpu
    from ..cuda.registry import DEFAULT_K_CACHE, k_cache_geometry

    rng = np.random.default_rng(seed)  # None: fresh inputs every run
    gpu = Gpu()
    k = DecodeKernels(gpu, config, k_cache_geometry(k_cache or DEFAULT_K_CACHE), pdl=False)
    dev = _Dev(gpu)
    checks = unit_gemv(k, dev, config, rng, tol)
    checks += unit_small(k, dev, config, rng, tol["elementwise"])
    checks += unit_rope_attention(k, dev, config, rng, tol["attention"], _k_tol(k, tol))
    checks += unit_lm_sample(k, dev, config, rng, tol["lm_head"])
    checks += unit_lm_head_q8(k, dev, config, rng, tol["lm_head"])
    checks += unit_sampling(k, dev, config, rng)
    gpu.close()
    return checks


# --- layer and graph tiers ---------------------------------------------------------------------
_REFERENCES: dict = {}  # one reference per (file, device, dtype): a 7B takes minutes to load


def _reference(file, device: str, dtype: str = "float32"):
    """ReferenceBackend on `device`. float16 is derived from the float32 one by converting the
    weights on the device (the reference's own loader dequantizes on the CPU: minutes for 7B);
    norms stay float32 as the reference's loader keeps them."""
    import copy
    import dataclasses

    import torch

    from ..reference import ReferenceBackend, weight_bytes

    key = (id(file), device, dtype)
    if key in _REFERENCES:
        return _REFERENCES[key]
    if device == "cuda":  # beside the engine: a deep model's float32 weights may not fit
        need, free = weight_bytes(file, getattr(torch, dtype)), torch.cuda.mem_get_info()[0]
        if need > free:
            cfg = file.config
            raise NanoqwenError(
                f"the {dtype} reference of {cfg.name} needs {need} bytes on the GPU, {free} are "
                f"free beside the engine; validate the layer and graph tiers on the same widths "
                f"at a smaller depth (nanoqwen pack --synthetic PRESET --layers 8)"
            )
    if dtype == "float32":
        ref = ReferenceBackend(file, max_context=256, device=device, prefix_caching=False)
    else:
        # fp16 GEMMs with fp32 accumulation, as our kernels do (torch may otherwise reduce
        # in fp16 on the GPU).
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        base, to = _reference(file, device), getattr(torch, dtype)
        ref = copy.copy(base)
        m = ref.model = copy.copy(base.model)
        half = {"input_norm", "post_attn_norm"}
        m.layers = [
            dataclasses.replace(w, **{f.name: getattr(w, f.name).to(to)
                                      for f in dataclasses.fields(w) if f.name not in half})
            for w in base.model.layers
        ]  # fmt: skip
        m.embed_tokens = base.model.embed_tokens.to(to)
        tied = base.model.lm_head is base.model.embed_tokens  # an int8 head is its own tensor
        m.lm_head = m.embed_tokens if tied else m.lm_head.to(to)
        ref.cache = type(base.cache)(file.config, base.cache.num_pages, to, device, False)
    _REFERENCES[key] = ref
    return ref


def layer_tier(engine, file, tol: float, tokens: int = 40, seed: int | None = None):
    """Layer 0 of the engine (decode path, token by token) vs the reference's layer 0."""
    import torch

    from ..kv_pages import PageTable

    cfg = file.config
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, tokens)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = _reference(file, dev)
    m, table = ref.model, PageTable()
    ref.cache.pages.reserve(table, tokens)
    try:
        with torch.inference_mode():
            t = torch.tensor(ids, device=dev)
            tab = torch.tensor(table.pages, device=dev)
            cos, sin = m.cos[:tokens], m.sin[:tokens]
            x = m.block(m.embed_tokens[t], m.layers[0], 0, 0, tab, ref.cache, cos, sin)
            x = x.float().cpu().numpy()
    finally:
        ref.cache.pages.release(table)
    got = np.stack([engine.decode_hidden(int(tok), i, layers=1) for i, tok in enumerate(ids)])
    err = _rel_err(got, x)
    return [Check("layer", f"layer 0, {tokens} tokens (decode path)", err <= tol, f"{err:.2e}")]


def graph_tier(engine, file, tol: dict, prompts: int, seed: int | None = None) -> list[Check]:
    """Teacher-forced logits (decode and prefill paths) + greedy generation vs the reference."""
    import torch

    from ..sampling import SamplingParams

    cfg = file.config
    rng = np.random.default_rng(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gate = tol.get("reference_dtype", "float32")
    refs = {d: _reference(file, dev, d) for d in dict.fromkeys((gate, "float32", "float16"))}
    ref = refs[gate]
    checks = []
    for path in ("decode", "prefill"):
        stats = {d: [0, 0, 0.0] for d in refs}  # agree, total, worst max|dlogit| / std
        t0 = time.perf_counter()
        try:
            for _ in range(prompts):
                ids = rng.integers(0, cfg.vocab_size, int(rng.integers(4, 48))).tolist()
                got = engine.decode_logits(ids) if path == "decode" else engine.logits(ids)
                for d, r in refs.items():
                    want = r.logits(ids).astype(np.float32)
                    st = stats[d]
                    st[0] += int((got.argmax(-1) == want.argmax(-1)).sum())
                    st[1] += len(ids)
                    st[2] = max(st[2], float(np.abs(got - want).max() / want.std()))
        except Exception as exc:  # report the failing path, keep the other
            checks.append(Check("graph", f"{path} logits", False, f"{type(exc).__name__}: {exc}"))
            continue
        for d, (agree, total, worst) in stats.items():
            rate = agree / total
            ok = rate >= tol["top1_agreement"] and worst <= tol["logit_max_over_std"]
            name = f"{path} logits x{prompts} vs {d} ref"
            if d != gate:
                name, ok = name + " (info)", True
            detail = f"top1 {rate:.4f} ({agree}/{total}), max|dlogit|/std {worst:.3f}"
            checks.append(Check("graph", name, ok, f"{detail}, {time.perf_counter() - t0:.0f}s"))
    same = near_tie = 0
    n_gen = min(prompts, 10)
    try:
        for _ in range(n_gen):
            ids = rng.integers(0, cfg.vocab_size, 16).tolist()
            p = SamplingParams(max_tokens=24)
            a = list(engine.generate(ids, p, frozenset()))
            b = list(ref.generate(ids, p, frozenset()))
            if a == b:
                same += 1
                continue
            # A divergence is allowed only at a near-tie of the reference's own top-2.
            i = next(j for j in range(len(b)) if a[j] != b[j])
            row = ref.logits(ids + b[:i])[-1]
            margin = abs(float(row[b[i]] - row[a[i]])) / float(row.std())
            near_tie += margin <= tol["near_tie_over_std"]
        ok = same + near_tie == n_gen and engine.kv_pages_in_use == 0
        detail = f"{same}/{n_gen} identical, {near_tie} split at a near-tie"
        detail += f", pages after {engine.kv_pages_in_use}"
        checks.append(Check("graph", f"greedy generate x{n_gen}", ok, detail))
    except Exception as exc:
        checks.append(Check("graph", "greedy generate", False, f"{type(exc).__name__}: {exc}"))
    return checks


def print_table(checks: list[Check]) -> None:
    width = max((len(c.name) for c in checks), default=10)
    for c in checks:
        print(f"{c.tier:6} {'PASS' if c.ok else 'FAIL'}  {c.name:{width}}  {c.detail}")
    bad = sum(not c.ok for c in checks)
    print(f"{len(checks) - bad}/{len(checks)} passed")
