"""Calibration for `pack --quantizer gptq`: a sequential forward pass that quantizes the model
one layer at a time, each projection against the Hessian of the input it really sees.

    calibration_windows(tokenizer, tokens) -> int64 [W, WINDOW] token windows
    quantize_model(config, get, windows, quantizer) -> {projection name: (q, scales)}

Sequential (GPTQ's own order): layer i's inputs come from layers 0..i-1 already quantized, and
inside a layer o_proj sees the output of the quantized q/k/v, the MLP the quantized attention,
down_proj the quantized gate/up. So each projection corrects the error its predecessors left,
not an error of the float model it will never run with. Projections that read the same input
(q/k/v; gate/up) share one Hessian and are quantized as one stacked matrix.

The arithmetic is the reference model's (nanoqwen.reference: rms_norm, attention through a paged
KV cache, the SwiGLU MLP) in float32 on a torch device (the CPU by default). Only one layer's
float weights are held at a time (`get` reads them on demand), plus the hidden states of the
calibration windows.

Calibration text: the opening WINDOW tokens of Python standard-library files (CALIBRATION_FILES,
found in the running interpreter's stdlib). dev/quant_ppl.py evaluates on other files.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .config import PAGE_TOKENS, ModelConfig
from .errors import ConvertError
from .harness.real_text import stdlib_root, stdlib_token_ids
from .quantizers import gptq_quantize
from .reference import LayerWeights, PagedKVCache, Qwen2Reference, rms_norm, rope_table

WINDOW = 512  # tokens per calibration window (a multiple of the 16-token KV page)
CALIBRATION_FILES = (
    "argparse.py",
    "dataclasses.py",
    "functools.py",
    "pathlib.py",
    "shutil.py",
    "textwrap.py",
    "json/decoder.py",
    "heapq.py",
    "ast.py",
    "threading.py",
    "configparser.py",
    "csv.py",
    "random.py",
    "string.py",
    "zipfile.py",
    "email/message.py",
    "calendar.py",
    "_pydecimal.py",
    "gettext.py",
    "queue.py",
    "selectors.py",
    "tempfile.py",
    "uuid.py",
    "xml/dom/minidom.py",
    "asyncio/tasks.py",
    "contextlib.py",
    "copy.py",
    "imaplib.py",
    "platform.py",
    "plistlib.py",
    "shlex.py",
    "bdb.py",
    "codecs.py",
    "dis.py",
    "doctest.py",
    "ftplib.py",
    "mimetypes.py",
    "socketserver.py",
    "trace.py",
    "warnings.py",
)
# 32 windows: more tokens than the widest input (down_proj's K: 4864 on the 0.5B, 8960 on the
# 1.5B), whose Hessian 4096 tokens leave rank-deficient (0.5B: gap +12.2% at 4096, EXPERIMENTS).
DEFAULT_CALIBRATION_TOKENS = 16384

# Logical projection groups that share one input, in the order the forward reaches them.
_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")

Getter = Callable[[str], np.ndarray]  # logical tensor name -> float32 array


def stdlib_windows(tokenizer, files: tuple[str, ...], count: int) -> np.ndarray:
    """The first WINDOW tokens of each of the first `count` of `files` (stdlib-relative paths)
    that are long enough: int64 [count, WINDOW]."""
    windows = []
    for ids in stdlib_token_ids(tokenizer, files, WINDOW):
        windows.append(ids[:WINDOW])
        if len(windows) == count:
            return np.asarray(windows, dtype=np.int64)
    raise ConvertError(
        f"calibration: found {len(windows)} of {count} {WINDOW}-token windows among the "
        f"Python standard-library files under {stdlib_root()}"
    )


def calibration_windows(tokenizer, tokens: int = DEFAULT_CALIBRATION_TOKENS) -> np.ndarray:
    """int64 [tokens / WINDOW, WINDOW] calibration windows (CALIBRATION_FILES)."""
    count = max(1, tokens // WINDOW)
    return stdlib_windows(tokenizer, CALIBRATION_FILES, count)


def _tensor(get: Getter, name: str, device) -> torch.Tensor:
    """A small tensor (norm, bias), copied: `get` may hand out read-only or shared arrays."""
    return torch.from_numpy(np.array(get(name), dtype=np.float32)).to(device)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    """x: float32 [..., K] -> X^T X, float32 [K, K] on x's device (a float64 product takes 4x
    as long at K = 8960 and GPTQ runs in float32 anyway)."""
    x = x.reshape(-1, x.shape[-1])
    return x.T @ x


def _quantize_stack(
    get: Getter, prefix: str, projs: tuple[str, ...], hessian: torch.Tensor, out: dict, options
) -> list[torch.Tensor]:
    """GPTQ the projections `projs` of one layer (stacked: they share `hessian`); record
    (q, scales) per projection in `out`; return their dequantized weights on the Hessian's
    device."""
    from .quant import dequantize

    ws = [get(prefix + p) for p in projs]
    name = prefix + "/".join(projs)
    q, scales = gptq_quantize(np.concatenate(ws), hessian, name, device=hessian.device, **options)
    deq, row = [], 0
    for p, w in zip(projs, ws, strict=True):
        rows = slice(row, row + w.shape[0])
        out[prefix + p] = (q[rows], scales[rows])
        deq.append(torch.from_numpy(dequantize(q[rows], scales[rows])).to(hessian.device))
        row += w.shape[0]
    return deq


def quantize_model(
    config: ModelConfig,
    get: Getter,
    windows: np.ndarray,
    progress: bool = True,
    device="cpu",
    **options,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """GPTQ every projection of `config` sequentially on the calibration `windows` (int64
    [W, T], T % 16 == 0). `get(logical)` returns float32 source tensors (embed_tokens,
    layers.{i}.input_norm, layers.{i}.q_proj, ...). Returns {"layers.{i}.{proj}": (q int8
    [N, K], scales float16 [N, K/128])}. The forward pass and GPTQ run in float32 on torch
    `device` (one layer's weights and the windows' hidden states live there); `options` go to
    quantizers.gptq_quantize."""
    from tqdm import tqdm

    count, t = windows.shape
    eps = config.rms_norm_eps
    embed = get("embed_tokens")
    x = torch.from_numpy(embed[windows.reshape(-1)].astype(np.float32)).view(count, t, -1)
    x = x.to(device)
    del embed
    cos, sin = rope_table(config, t, torch.float32, device)
    pages = list(range(t // PAGE_TOKENS))
    table = torch.tensor(pages, dtype=torch.int64, device=device)
    eye = torch.eye(config.q_size, device=device)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    model = Qwen2Reference.__new__(Qwen2Reference)  # only its attention: no weights loaded
    model.config = config
    layers = tqdm(range(config.num_layers), desc="gptq", unit="layer", disable=not progress)
    for i in layers:
        p = f"layers.{i}."
        norm1 = _tensor(get, p + "input_norm", device)
        norm2 = _tensor(get, p + "post_attn_norm", device)
        h = rms_norm(x, norm1, eps)
        q_w, k_w, v_w = _quantize_stack(get, p, _QKV, _hessian(h), out, options)
        # o_proj = identity: the reference's attention then returns o_proj's input.
        biases = (_tensor(get, p + f"{n}_proj.bias", device) for n in "qkv")
        w = LayerWeights(
            norm1, norm2, q_w, k_w, v_w, *biases,
            o_proj=eye, gate_proj=None, up_proj=None, down_proj=None,
        )  # fmt: skip
        attn = torch.empty(count, t, config.q_size, device=device)
        for j in range(count):
            cache = PagedKVCache(config, len(pages), torch.float32, device)
            attn[j] = model.attention(h[j], w, i, 0, table, cache, cos, sin)
        (o_w,) = _quantize_stack(get, p, ("o_proj",), _hessian(attn), out, options)
        x = x + attn @ o_w.T
        h = rms_norm(x, norm2, eps)
        gate_w, up_w = _quantize_stack(get, p, _GATE_UP, _hessian(h), out, options)
        act = torch.nn.functional.silu(h @ gate_w.T) * (h @ up_w.T)
        (down_w,) = _quantize_stack(get, p, ("down_proj",), _hessian(act), out, options)
        x = x + act @ down_w.T
        del act, attn, w
    return out
