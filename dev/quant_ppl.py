"""Perplexity of each INT4 quantizer's packed model against its float32 source (CPU or GPU).

    PYTHONPATH=. python3 dev/quant_ppl.py --model 0.5b 1.5b --quantizer rtn gptq

For each model (the pinned real Q4_K_M GGUFs of nanoqwen.fetch): the source dequantized to
float32, then each quantizer's model, all run by the reference model (nanoqwen.reference) over
the same real code windows: the opening 512 tokens of each of EVAL_FILES (Python stdlib files,
disjoint from the calibration files of nanoqwen.calibrate). A quantized model holds exactly what
`pack --quantizer Q` stores: the projections packed to ValueShuffle words and fp16 scales and
dequantized back (quant.dequantize_packed, what the reference reads from a file), every other
tensor rounded to float16. Printed per quantizer: NLL per predicted token, perplexity, the
perplexity gap to the source in %, top-1 agreement with the source's argmax, quantize seconds.

Variants: rtn-signed (round to nearest on quant.signed_scales), rtn-g64 / rtn-signed-g64 (groups
of 64: quality only, the format has no such file), and GPTQ_VARIANTS: options of
calibrate.quantize_model and quantizers.gptq_quantize (gptq-plain: plain sequential GPTQ, no
float target; gptq-noact: columns in natural order; gptq-damp0.01: damping 0.01;
gptq-rtnscales: RTN's max|w| / 7 scales). Use
--threads 1 on a shared machine, --device cuda on a GPU host (--gguf then names the files when
it has no network). Every score is saved under --results; --reuse takes saved ones instead of
computing them, so parallel runs (one per quantizer, one for the source) merge into one table:
run them with --reuse, then once more with --reuse and the same arguments to print the table.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nanoqwen import calibrate
from nanoqwen.config import PROJECTIONS
from nanoqwen.convert.gguf import (
    config_from_gguf,
    dequantize_tensor,
    open_gguf,
    tokenizer_from_gguf,
)
from nanoqwen.convert.names import source_names
from nanoqwen.fetch import fetch_model
from nanoqwen.quant import (
    QMAX,
    QMIN,
    dequantize_packed,
    pack_value_shuffle,
    quantize_onto,
    quantize_pack,
    signed_scales,
)
from nanoqwen.reference import LayerWeights, PagedKVCache, Qwen2Reference, rope_table
from nanoqwen.tokenizer import Tokenizer

EVAL_FILES = (
    "collections/__init__.py",
    "typing.py",
    "inspect.py",
    "subprocess.py",
    "enum.py",
    "logging/__init__.py",
    "difflib.py",
    "tarfile.py",
    "statistics.py",
    "tokenize.py",
)
GPTQ_VARIANTS = {
    "gptq": {},
    "gptq-noact": {"act_order": False},
    "gptq-plain": {"float_target": False},
    "gptq-damp0.01": {"damp": 0.01},
    "gptq-damp0.03": {"damp": 0.03},
    "gptq-damp0.1": {"damp": 0.1},
    "gptq-damp1": {"damp": 1.0},
    "gptq-rtnscales": {"scales": "rtn"},
}
assert not set(EVAL_FILES) & set(calibrate.CALIBRATION_FILES)


def source(model: str, path: Path | None):
    """(config, tokenizer, get): get(logical) -> the GGUF tensor dequantized to float32 (read
    only: shared between calls). The GGUF at `path`, else the pinned one of nanoqwen.fetch
    (downloaded if missing)."""
    path = path or fetch_model(model, progress=False)
    reader = open_gguf(path)
    config = config_from_gguf(reader, path.stem)
    tokenizer = Tokenizer.from_spec(tokenizer_from_gguf(reader, str(path)))
    tensors = {t.name: t for t in reader.tensors}
    by_logical = {lg: name for name, lg in source_names(config, "gguf").items() if name in tensors}
    # Each tensor dequantized once (float32: 2 GB for the 0.5B, 6 GB for the 1.5B): the source,
    # every quantizer and its model read them all again, and numpy dequantizes ~25M params/s.
    get = functools.cache(lambda logical: dequantize_tensor(tensors[by_logical[logical]]))
    return config, tokenizer, get


def quantized_projections(quantizer: str, config, tokenizer, get, args) -> dict:
    """logical projection -> (qweight, scales) as `pack --quantizer` stores them."""
    names = [f"layers.{i}.{p}" for i in range(config.num_layers) for p in PROJECTIONS]
    if quantizer == "rtn":
        return {n: quantize_pack(get(n), n) for n in names}
    if quantizer == "rtn-signed":
        scales = {n: signed_scales(get(n), n) for n in names}
        return {n: (pack_value_shuffle(quantize_onto(get(n), s, n)), s) for n, s in scales.items()}
    if quantizer in ("rtn-g64", "rtn-signed-g64"):
        return {n: rtn_g64(get(n), quantizer == "rtn-signed-g64") for n in names}
    windows = calibrate.calibration_windows(tokenizer, args.calib_tokens)
    options = GPTQ_VARIANTS[quantizer]
    table = calibrate.quantize_model(config, get, windows, True, args.device, **options)
    return {n: (pack_value_shuffle(q), s) for n, (q, s) in table.items()}


def rtn_g64(w: np.ndarray, signed: bool) -> np.ndarray:
    """Round to nearest in groups of 64 along K (a finer group than the format's 128, for the
    quality half of issue #30's g64 question; no kernel reads it): float32 [N, K] dequantized,
    fp16 scales max|w| / 7, or signed_scales' rule."""
    groups = w.astype(np.float32).reshape(w.shape[0], -1, 64)
    if signed:
        raw = np.maximum(groups.max(axis=2) / QMAX, groups.min(axis=2) / QMIN)
    else:
        raw = np.abs(groups).max(axis=2) / QMAX
    scale = raw.astype(np.float16).astype(np.float32)[:, :, None]
    q = np.clip(np.rint(groups / np.where(scale > 0, scale, 1)), QMIN, QMAX)
    return (q * scale).reshape(w.shape)


def build_model(config, get, packed: dict | None, window: int, device) -> Qwen2Reference:
    """The reference model on `device` over the float32 source (packed None) or a quantizer's
    output."""

    def dense(name: str) -> torch.Tensor:
        a = get(name)
        a = a if packed is None else a.astype(np.float16)
        return torch.from_numpy(a.astype(np.float32)).to(device)

    def proj(name: str) -> torch.Tensor:
        if packed is None:
            return dense(name)
        if isinstance(packed[name], np.ndarray):  # rtn_g64: already dequantized
            return torch.from_numpy(packed[name]).to(device)
        return torch.from_numpy(dequantize_packed(*packed[name])).to(device)

    model = Qwen2Reference.__new__(Qwen2Reference)
    model.config = config
    model.embed_tokens = dense("embed_tokens")
    model.layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        model.layers.append(
            LayerWeights(
                dense(p + "input_norm"),
                dense(p + "post_attn_norm"),
                *(proj(p + n) for n in ("q_proj", "k_proj", "v_proj")),
                *(dense(p + f"{n}_proj.bias") for n in "qkv"),
                *(proj(p + n) for n in ("o_proj", "gate_proj", "up_proj", "down_proj")),
            )  # fmt: skip
        )
    model.final_norm = dense("final_norm")
    model.lm_head = model.embed_tokens if config.tie_word_embeddings else dense("lm_head")
    model.cos, model.sin = rope_table(config, window, torch.float32, device)
    return model


@torch.inference_mode()
def score(model: Qwen2Reference, windows: np.ndarray) -> tuple[float, np.ndarray]:
    """(mean NLL per predicted token, argmax int64 [W, T-1]) over the windows."""
    count, t = windows.shape
    pages = t // 16
    device = model.embed_tokens.device
    nll, top = 0.0, []
    for row in windows:
        cache = PagedKVCache(model.config, pages, torch.float32, device)
        tokens = torch.from_numpy(row).to(device)
        logits = model.logits(model.forward(tokens, 0, list(range(pages)), cache))[:-1]
        nll += torch.nn.functional.cross_entropy(logits, tokens[1:], reduction="sum").item()
        top.append(logits.argmax(-1).cpu().numpy())
    return nll / (count * (t - 1)), np.stack(top)


def run_quantizer(quantizer, config, tokenizer, get, windows, args):
    """(NLL, argmax, quantize seconds) of one quantizer's model; the seconds leave out the
    GGUF's dequantization (done here first, once a run)."""
    for i in range(config.num_layers):
        for p in PROJECTIONS:
            get(f"layers.{i}.{p}")
    started = time.perf_counter()
    packed = quantized_projections(quantizer, config, tokenizer, get, args)
    seconds = time.perf_counter() - started
    model = build_model(config, get, packed, windows.shape[1], args.device)
    return (*score(model, windows), seconds)


def run_source(config, get, windows, device):
    """(NLL, argmax, 0) of the float32 source."""
    return (*score(build_model(config, get, None, windows.shape[1], device), windows), 0.0)


def cached_score(path: Path, reuse: bool, compute) -> tuple[float, np.ndarray, float]:
    """(NLL, argmax, seconds) from `path` when `reuse` and it exists, else computed and saved."""
    if reuse and path.is_file():
        with np.load(path) as f:
            return float(f["nll"]), f["top"], float(f["seconds"])
    nll, top, seconds = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, nll=nll, top=top, seconds=seconds)
    return nll, top, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=["0.5b", "1.5b"])
    ap.add_argument("--quantizer", nargs="*", default=["rtn", "gptq"])
    ap.add_argument("--windows", type=int, default=8, help="evaluation windows of 512 tokens")
    ap.add_argument("--calib-tokens", type=int, default=calibrate.DEFAULT_CALIBRATION_TOKENS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--device", default="cpu", help="torch device of the calibration pass and the "
        "evaluation (cuda: the 1.5B in minutes); scores saved apart per device"
    )  # fmt: skip
    ap.add_argument(
        "--gguf", type=Path, nargs="+", help="the GGUF of each --model, in order (a host "
        "without network); default: the pinned files of nanoqwen.fetch"
    )  # fmt: skip
    ap.add_argument("--results", type=Path, default=Path("/tmp/quant_ppl"), help="score files")
    ap.add_argument(
        "--reuse", action="store_true", help="take scores already in --results (e.g. the "
        "source's, from a parallel run) instead of computing them; the source is scored last"
    )  # fmt: skip
    args = ap.parse_args()
    if args.gguf is not None and len(args.gguf) != len(args.model):
        ap.error(f"--gguf gives {len(args.gguf)} files for {len(args.model)} models")
    torch.set_num_threads(args.threads)
    rows = []
    for m, name in enumerate(args.model):
        config, tokenizer, get = source(name, args.gguf[m] if args.gguf else None)
        windows = calibrate.stdlib_windows(tokenizer, EVAL_FILES, args.windows)
        device = "" if args.device == "cpu" else f"-{args.device.replace(':', '')}"
        tag = f"{name}-w{args.windows}{device}"
        scores = {}
        for quantizer in args.quantizer:
            path = args.results / f"{tag}-{quantizer}-c{args.calib_tokens}.npz"
            job = functools.partial(run_quantizer, quantizer, config, tokenizer, get, windows, args)
            scores[quantizer] = cached_score(path, args.reuse, job)
            print(f"{name} {quantizer}: NLL {scores[quantizer][0]:.4f}", flush=True)
        job = functools.partial(run_source, config, get, windows, args.device)
        base_nll, base_top, _ = cached_score(args.results / f"{tag}-source.npz", args.reuse, job)
        print(f"{name} source: NLL {base_nll:.4f}", flush=True)
        rows.append((name, "source f32", base_nll, 0.0, 1.0, 0.0))
        for quantizer, (nll, top, seconds) in scores.items():
            gap = math.exp(nll - base_nll) - 1
            rows.append((name, quantizer, nll, gap, float((top == base_top).mean()), seconds))
    tokens = args.windows * 511
    print(f"\n{tokens} predicted tokens per model, {args.calib_tokens} calibration tokens")
    print(
        f"{'model':6} {'quantizer':14} {'NLL':>7} {'ppl':>7} {'gap':>7} {'top1':>6} {'quant s':>8}"
    )
    for model, q, nll, gap, agree, seconds in rows:
        print(
            f"{model:6} {q:14} {nll:7.4f} {math.exp(nll):7.3f} {100 * gap:+6.1f}% "
            f"{100 * agree:5.1f}% {seconds:8.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
