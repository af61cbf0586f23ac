"""What an int8 lm_head costs in quality (on the CPU, or a GPU with --device cuda): top-1
agreement with the fp16 head and the perplexity delta, over real code.

    PYTHONPATH=. python3 dev/lm_head_quality.py [FILE] [--windows 8] [--threads 2] [--device cpu]

FILE: a packed real model with an fp16 head (default: the 0.5B that `nanoqwen demo --model
0.5b` packs into the cache). The reference model (nanoqwen.reference, float32) runs each window
once to its final hidden states (after the final RMSNorm); every head then scores the same
hidden states, so the only difference between rows is the head:

    fp16          the file's head (the tied embedding for 0.5B-3B), what the engine reads today
    int8 row      quant.quantize_rows_int8: one float32 scale a vocabulary row (`pack --lm-head
                  int8`, what lm_head_argmax_q8 reads)
    int8 g128     one float32 scale a group of 128 along H, the finer alternative

Windows: the opening 512 tokens of dev/quant_ppl.py's EVAL_FILES (Python stdlib source). Printed
per head: NLL per predicted token, perplexity, its delta against fp16 in %, top-1 agreement
with the fp16 head's argmax, and the largest |logit - fp16 logit|. The reference pass takes
most of the time (~5 min for the 0.5B's 4096 tokens on two shared cores); its hidden states are
kept under --hidden-cache, so a second run scores the heads only.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from quant_ppl import EVAL_FILES  # noqa: E402

from nanoqwen import calibrate  # noqa: E402
from nanoqwen.fileformat import NanoqwenFile  # noqa: E402
from nanoqwen.paths import cache_dir  # noqa: E402
from nanoqwen.quant import GROUP_SIZE, Q8_MAX, dequantize_rows_int8, quantize_rows_int8  # noqa: E402
from nanoqwen.reference import PagedKVCache, ReferenceBackend  # noqa: E402
from nanoqwen.tokenizer import Tokenizer  # noqa: E402

DEFAULT_FILE = "qwen2.5-coder-0.5b-instruct.nanoqwen"


def int8_groups(w: np.ndarray, group: int = GROUP_SIZE) -> np.ndarray:
    """w float [V, H] through symmetric int8 with a float32 scale per `group` columns of a row,
    dequantized: float32 [V, H]."""
    v, h = w.shape
    g = w.astype(np.float32).reshape(v, h // group, group)
    scale = np.abs(g).max(axis=2, keepdims=True) / Q8_MAX
    q = np.clip(np.rint(g / np.where(scale > 0, scale, 1)), -Q8_MAX, Q8_MAX)
    return (q * scale).reshape(v, h).astype(np.float32)


@torch.inference_mode()
def hidden_states(ref: ReferenceBackend, windows: np.ndarray) -> list[torch.Tensor]:
    """The final hidden states float32 [T, H] of each window, teacher-forced, on the CPU."""
    model, out = ref.model, []
    pages = windows.shape[1] // 16
    for row in windows:
        cache = PagedKVCache(model.config, pages, torch.float32, ref.device)
        tokens = torch.from_numpy(row).to(ref.device)
        out.append(model.forward(tokens, 0, list(range(pages)), cache).float().cpu())
    return out


@torch.inference_mode()
def score(head: torch.Tensor | None, hidden, windows, base):
    """(NLL per predicted token, argmax [W, T-1], largest |logit - base logit|) of one head
    (None: the base logits themselves)."""
    nll, tops, worst = 0.0, [], 0.0
    for i, (h, row) in enumerate(zip(hidden, windows, strict=True)):
        logits = base[i] if head is None else (h[:-1] @ head.T).float()  # [T-1, V]
        target = torch.from_numpy(row[1:]).to(logits.device)
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        tops.append(logits.argmax(-1).cpu().numpy())
        if base is not None:
            worst = max(worst, (logits - base[i]).abs().max().item())
    return nll / (windows.shape[0] * (windows.shape[1] - 1)), np.stack(tops), worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", nargs="?", type=Path, default=cache_dir() / DEFAULT_FILE,
                    help="a packed real model with an fp16 head")  # fmt: skip
    ap.add_argument("--windows", type=int, default=8, help="windows of 512 tokens")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--device", default="cpu", help="torch device of the reference and heads")
    ap.add_argument("--hidden-cache", type=Path, default=Path("/tmp/lm_head_quality"),
                    help="where the reference's hidden states are kept between runs")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with NanoqwenFile(args.file) as f:
        if f.lm_head != "float16":
            sys.exit(f"{args.file}: its head is {f.lm_head}; give the fp16 file")
        tokenizer = Tokenizer.from_spec(f.tokenizer)
        windows = calibrate.stdlib_windows(tokenizer, EVAL_FILES, args.windows)
        w16 = f.tensor("embed_tokens" if f.config.tie_word_embeddings else "lm_head")
        saved = args.hidden_cache / f"{args.file.stem}-w{args.windows}.pt"
        if saved.is_file():  # the reference pass is most of the time; the heads are cheap
            hidden = torch.load(saved)
        else:
            ref = ReferenceBackend(f, max_context=windows.shape[1], device=args.device)
            hidden = hidden_states(ref, windows)
            saved.parent.mkdir(parents=True, exist_ok=True)
            torch.save(hidden, saved)
        print(f"{f.config.name}: {windows.size} tokens through the reference in "
              f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
        hidden = [h.to(args.device) for h in hidden]
        fp16 = torch.from_numpy(w16.astype(np.float32)).to(args.device)
        base_logits = [(h[:-1] @ fp16.T).float() for h in hidden]
        heads = {
            "fp16": None,
            "int8 row": torch.from_numpy(dequantize_rows_int8(*quantize_rows_int8(w16))),
            "int8 g128": torch.from_numpy(int8_groups(w16)),
        }
        heads = {k: None if w is None else w.to(args.device) for k, w in heads.items()}
        rows = {name: score(w, hidden, windows, base_logits) for name, w in heads.items()}
    base_nll, base_top, _ = rows["fp16"]
    predicted = windows.shape[0] * (windows.shape[1] - 1)
    print(f"\n{args.file.name}: {predicted} predicted tokens, {len(windows)} stdlib windows "
          f"({time.perf_counter() - started:.0f} s)")  # fmt: skip
    print(f"{'head':12} {'NLL':>7} {'ppl':>8} {'delta':>8} {'top1 vs fp16':>13} {'max dlogit':>11}")
    for name, (nll, top, worst) in rows.items():
        delta = 100 * (math.exp(nll - base_nll) - 1)
        agree = 100 * float((top == base_top).mean())
        print(f"{name:12} {nll:7.4f} {math.exp(nll):8.3f} {delta:+7.3f}% {agree:12.2f}% "
              f"{worst:11.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
