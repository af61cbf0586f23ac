"""Pack a model into a .nanoqwen file: INT4 g128 projections (ValueShuffle), fp16 elsewhere.

Sources: a Hugging Face Qwen2 checkpoint directory (safetensors in bf16/fp16/fp32), a GGUF file
(F32/F16/BF16/Q8_0/Q4_K/Q5_0/Q6_K, dequantized then re-quantized), a .nanoqwen file with an
fp16 head (re-packed with `--lm-head`), or `--synthetic PRESET`
(random weights with exactly the preset's shapes, seeded). Tensors stream one at a time, and
the output is written atomically: on any error an existing OUT is left as it was.
"""

from __future__ import annotations

import argparse

from ..errors import ConvertError
from ..quantizers import DEFAULT_QUANTIZER, NEEDS_CALIBRATION, QUANTIZERS
from .argtypes import int_range

LM_HEAD_CHOICES = {"fp16": "float16", "int8": "int8"}  # --lm-head -> the file's format name
HELP = "convert an HF checkpoint, a GGUF file or a synthetic preset to .nanoqwen"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        nargs="?",
        default=None,
        help="HF checkpoint directory, .gguf file or .nanoqwen file (omit with --synthetic)",
    )
    p.add_argument("-o", "--output", required=True, default=None, help="output .nanoqwen path")
    p.add_argument(
        "--synthetic",
        metavar="PRESET",
        default=None,
        help="write random weights for a preset (tiny, 0.5b, 1.5b, 3b, 7b, 14b, 32b)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of --synthetic weights")
    p.add_argument(
        "--layers",
        type=int_range(1),
        default=None,
        help="with --synthetic: this many layers at the preset's widths (every kernel shape; a "
        "reference model that fits beside the engine for validate); None = the preset's",
    )
    p.add_argument(
        "--tokenizer-from",
        metavar="PATH",
        default=None,
        help="with --synthetic: embed the tokenizer of this .nanoqwen/.gguf/HF directory "
        "instead of the small byte-level one",
    )
    p.add_argument(
        "--no-tokenizer",
        action="store_true",
        default=False,
        help="pack an HF directory without its tokenizer",
    )
    p.add_argument(
        "--quantizer",
        choices=QUANTIZERS,
        default=DEFAULT_QUANTIZER,
        help="how a SOURCE's projections are rounded onto the INT4 grid (the file format is "
        "the same): rtn = round to nearest, fast (the 7B in minutes); gptq = GPTQ error "
        "feedback calibrated on Python stdlib source through float32 forward passes of the "
        "float and the quantized model, towards the float model's outputs, onto sign-aware "
        "scales, opt-in: slow on the CPU (7B estimated ~16 h on one core; the 1.5B in 2 "
        "minutes with --device cuda); on the real 1.5B it cuts rtn's perplexity gap to the "
        "GGUF from +14.7%% to +6.3%% (docs/EXPERIMENTS.md). "
        "--synthetic weights are always rtn",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device of --quantizer gptq's calibration pass: cpu (the default) or cuda "
        "(the real 1.5B's GPTQ in ~1.5 min on an H200; float32 sums in another order, so codes "
        "not bit-identical to the CPU's)",
    )
    p.add_argument(
        "--lm-head",
        choices=LM_HEAD_CHOICES,
        default="fp16",
        help="the head's storage: fp16 (the default) or int8 (one float32 scale a vocabulary "
        "row): half the bytes the decode step's lm_head reads; a tied model keeps its fp16 "
        "embedding for the lookup and gets the int8 head beside it; speculative decoding "
        "needs fp16. On the real 0.5B, int8 keeps the fp16 head's top-1 on 99.2%% of tokens "
        "at +0.04%% perplexity (dev/lm_head_quality.py). A SOURCE .nanoqwen with an fp16 "
        "head is re-packed with this head",
    )
    p.add_argument(
        "--no-progress", action="store_true", default=False, help="hide the progress bar"
    )


def run(args: argparse.Namespace) -> int:
    from ..convert import pack_source, pack_synthetic

    progress = not args.no_progress
    lm_head = LM_HEAD_CHOICES[args.lm_head]
    if args.synthetic is not None:
        if args.source is not None:
            raise ConvertError(f"give either SOURCE ({args.source}) or --synthetic, not both")
        if args.quantizer != "rtn" or args.device != "cpu":
            raise ConvertError("--synthetic weights are quantized with rtn only (no --device)")
        summary = pack_synthetic(
            args.synthetic, args.output, args.seed, args.tokenizer_from, progress, args.layers,
            lm_head,
        )  # fmt: skip
    else:
        if args.source is None:
            raise ConvertError("give a SOURCE (HF directory or .gguf file) or --synthetic PRESET")
        if args.device != "cpu" and args.quantizer not in NEEDS_CALIBRATION:
            raise ConvertError(
                f"--device applies to a calibrated quantizer ({', '.join(NEEDS_CALIBRATION)}), "
                f"not --quantizer {args.quantizer}"
            )
        if args.tokenizer_from is not None or args.layers is not None:
            raise ConvertError("--tokenizer-from and --layers apply to --synthetic only")
        summary = pack_source(
            args.source,
            args.output,
            progress,
            not args.no_tokenizer,
            args.quantizer,
            lm_head,
            args.device,
        )
    print(summary.line())
    return 0
