"""Calibration for `pack --quantizer gptq`: a sequential forward pass that quantizes the model
one layer at a time, each projection against the Hessian of the input it really sees.

    calibration_windows(tokenizer, tokens) -> int64 [W, WINDOW] token windows
    quantize_model(config, get, windows, quantizer) -> {projection name: (q, scales)}

Sequential (GPTQ's own order): layer i's inputs come from layers 0..i-1 already quantized, and
inside a layer o_proj sees the output of the quantized q/k/v, the MLP the quantized attention,
down_proj the quantized gate/up. So each projection's Hessian is that of the input it will run
with. Projections that read the same input (q/k/v; gate/up) share one Hessian and are quantized
as one stacked matrix.

Float target (asymmetric calibration, GPTAQ: Li et al. 2025, arXiv 2504.02692): the float model
runs alongside on the same windows, and each projection is quantized towards the float model's
output on the float input, not towards its float weight's output on the quantized input (what
plain sequential GPTQ matches, leaving the predecessors' error in place). GPTQ then runs on
_float_target's weight, the least-squares fit of that output on the quantized input (damped),
with the same Hessian: each projection also corrects the error its predecessors left. It costs
a second forward pass and a second K x K product per projection group; what it gains is in
docs/EXPERIMENTS.md (Quantization).

The arithmetic is the reference model's (nanoqwen.reference: rms_norm, attention through a paged
KV cache, the SwiGLU MLP) in float32 on a torch device (the CPU by default). Only one layer's
float weights are held at a time (`get` reads them on demand), plus the hidden states of the
calibration windows.

Calibration text: consecutive WINDOW-token windows of Python standard-library files
(CALIBRATION_FILES, found in the running interpreter's stdlib), the opening window of every file
first, then the second of those long enough, and so on. dev/quant_ppl.py evaluates on other
files.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .config import PAGE_TOKENS, PROJECTIONS, ModelConfig
from .errors import ConvertError
from .harness.real_text import stdlib_root, stdlib_token_ids
from .quantizers import GPTQ_DAMP, gptq_quantize
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
# 80 windows, 4.6x the widest input of the 1.5B (down_proj's K, 8960; 2.2x the 7B's 18944): a
# Hessian from few more tokens than K is rank-deficient and GPTQ fits its few directions (the
# 1.5B's gap +7.6% at 16384 tokens, +6.3% at 40960: docs/EXPERIMENTS.md, Quantization).
DEFAULT_CALIBRATION_TOKENS = 40960

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
    """int64 [tokens / WINDOW, WINDOW] calibration windows: window j of every CALIBRATION_FILES
    file long enough for it, j = 0, 1, ... (so the text spreads over every file before any
    file gives a second window)."""
    count = max(1, tokens // WINDOW)
    files = list(stdlib_token_ids(tokenizer, CALIBRATION_FILES, WINDOW))
    windows = []
    for j in range(max((len(ids) // WINDOW for ids in files), default=0)):
        for ids in files:
            if len(ids) >= (j + 1) * WINDOW:
                windows.append(ids[j * WINDOW : (j + 1) * WINDOW])
                if len(windows) == count:
                    return np.asarray(windows, dtype=np.int64)
    raise ConvertError(
        f"calibration: found {len(windows)} of {count} {WINDOW}-token windows in the Python "
        f"standard-library files under {stdlib_root()}"
    )


def _tensor(get: Getter, name: str, device) -> torch.Tensor:
    """A small tensor (norm, bias), copied: `get` may hand out read-only or shared arrays."""
    return torch.from_numpy(np.array(get(name), dtype=np.float32)).to(device)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    """x: float32 [..., K] -> X^T X, float32 [K, K] on x's device (a float64 product takes 4x
    as long at K = 8960 and GPTQ runs in float32 anyway)."""
    x = x.reshape(-1, x.shape[-1])
    return x.T @ x


def _float_target(w: torch.Tensor, x: torch.Tensor, xf: torch.Tensor, hessian, damp: float):
    """The weight whose output on the quantized model's input x best matches the float model's
    output on its own input xf: argmin_V ||x V^T - xf w^T||^2 = w + w (xf - x)^T x (x^T x)^-1
    (asymmetric calibration, GPTAQ: Li et al. 2025). Then ||x (V' - V)^T||^2, what GPTQ
    minimises for V' near V, is the float target's error up to a constant. The correction is
    damped as GPTQ's H (damp * mean diag(x^T x) on the diagonal): it is a least-squares fit of
    K columns per row, and goes to 0, leaving w, where x's energy is small.

    w: float32 [N, K]; x, xf: float32 [..., K]; hessian: x^T x [K, K]. Returns float32 [N, K]."""
    x, xf = x.reshape(-1, x.shape[-1]), xf.reshape(-1, xf.shape[-1])
    h = hessian.clone()
    h.diagonal().add_(damp * hessian.diagonal().mean())
    a = (xf - x).T @ x  # [K, K]
    return w + torch.cholesky_solve(a.T @ w.T, torch.linalg.cholesky(h)).T


def _quantize_stack(
    get: Getter, prefix: str, projs: tuple[str, ...], x, xf, out: dict, options
) -> list[torch.Tensor]:
    """GPTQ the projections `projs` of one layer (stacked: they share their input x, the
    quantized model's, [..., K]); record (q, scales) per projection in `out`; return their
    dequantized weights on x's device. xf: the float model's input, or None: the target is
    then the float weight on x, else _float_target's."""
    from .quant import dequantize

    ws = [get(prefix + p) for p in projs]
    name = prefix + "/".join(projs)
    w, hessian = np.concatenate(ws), _hessian(x)
    if xf is not None:
        damp = options.get("damp", GPTQ_DAMP)
        w_t = torch.from_numpy(w.astype(np.float32)).to(x.device)
        w = _float_target(w_t, x, xf, hessian, damp).cpu().numpy()
    q, scales = gptq_quantize(w, hessian, name, device=x.device, **options)
    deq, row = [], 0
    for p, w in zip(projs, ws, strict=True):
        rows = slice(row, row + w.shape[0])
        out[prefix + p] = (q[rows], scales[rows])
        deq.append(torch.from_numpy(dequantize(q[rows], scales[rows])).to(x.device))
        row += w.shape[0]
    return deq


def quantize_model(
    config: ModelConfig,
    get: Getter,
    windows: np.ndarray,
    progress: bool = True,
    device="cpu",
    float_target: bool = True,
    **options,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """GPTQ every projection of `config` sequentially on the calibration `windows` (int64
    [W, T], T % 16 == 0). `get(logical)` returns float32 source tensors (embed_tokens,
    layers.{i}.input_norm, layers.{i}.q_proj, ...). Returns {"layers.{i}.{proj}": (q int8
    [N, K], scales float16 [N, K/128])}. The forward pass and GPTQ run in float32 on torch
    `device` (one layer's weights and the windows' hidden states of both models live there);
    `options` go to quantizers.gptq_quantize. float_target: the float model's outputs as each
    projection's target (the module's docstring); False: plain sequential GPTQ."""
    from tqdm import tqdm

    count, t = windows.shape
    eps = config.rms_norm_eps
    embed = get("embed_tokens")
    x = torch.from_numpy(embed[windows.reshape(-1)].astype(np.float32)).view(count, t, -1)
    x = x.to(device)
    xf = x.clone() if float_target else None  # the float model's hidden states
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
        biases = [_tensor(get, p + f"{n}_proj.bias", device) for n in "qkv"]
        floats = [_tensor(get, p + n, device) for n in PROJECTIONS] if float_target else None

        def attention(h, q_w, k_w, v_w, i=i, norms=(norm1, norm2), biases=biases):
            """h: [W, T, hidden] -> o_proj's input [W, T, q_size]. o_proj = identity: the
            reference's attention then returns o_proj's input."""
            w = LayerWeights(
                *norms, q_w, k_w, v_w, *biases,
                o_proj=eye, gate_proj=None, up_proj=None, down_proj=None,
            )  # fmt: skip
            attn = torch.empty(count, t, config.q_size, device=device)
            for j in range(count):
                cache = PagedKVCache(config, len(pages), torch.float32, device)
                attn[j] = model.attention(h[j], w, i, 0, table, cache, cos, sin)
            return attn

        h = rms_norm(x, norm1, eps)
        hf = None if xf is None else rms_norm(xf, norm1, eps)
        attn = attention(h, *_quantize_stack(get, p, _QKV, h, hf, out, options))
        attn_f = None if xf is None else attention(hf, *floats[:3])
        (o_w,) = _quantize_stack(get, p, ("o_proj",), attn, attn_f, out, options)
        x = x + attn @ o_w.T
        h = rms_norm(x, norm2, eps)
        if xf is not None:
            xf = xf + attn_f @ floats[3].T
            hf = rms_norm(xf, norm2, eps)
        act = _mlp_input(h, *_quantize_stack(get, p, _GATE_UP, h, hf, out, options))
        act_f = None if xf is None else _mlp_input(hf, *floats[4:6])
        (down_w,) = _quantize_stack(get, p, ("down_proj",), act, act_f, out, options)
        x = x + act @ down_w.T
        if xf is not None:
            xf = xf + act_f @ floats[6].T
        del act, attn, act_f, attn_f, floats
    return out


def _mlp_input(h: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor) -> torch.Tensor:
    """h: [W, T, hidden] -> down_proj's input silu(h gate^T) * (h up^T): [W, T, intermediate]."""
    return torch.nn.functional.silu(h @ gate_w.T) * (h @ up_w.T)
