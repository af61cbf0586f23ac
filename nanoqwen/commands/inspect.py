"""Describe a .nanoqwen file: config, quantization, tokenizer, tensor table, sizes.

Opening the file validates its header (bounds, shapes, overlaps); --verify also reads every
byte and checks each tensor's CRC32, exiting non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

from .argtypes import int_range

HELP = "describe a .nanoqwen file (config, quant, tokenizer, tensors); --verify checksums"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="the .nanoqwen file to describe")
    p.add_argument(
        "--verify",
        action="store_true",
        default=False,
        help="read the whole file and check every checksum (progress bar on stderr)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        default=False,
        help="print one JSON document (with the full tensor table) instead of text",
    )
    p.add_argument(
        "--largest",
        type=int_range(0),
        default=5,
        help="how many of the largest tensors to list in the text output",
    )


def run(args: argparse.Namespace) -> int:
    from ..fileformat import NanoqwenFile

    with NanoqwenFile(args.file) as f:
        summary = summarize(f)
        if args.verify:
            f.verify(progress=True)  # FormatError -> exit 2 (cli.main)
            summary["verified"] = True
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_text(summary, args.largest))
    return 0


def _tokenizer_vocab(tokenizer_json: str) -> int | str:
    """Distinct token ids in tokenizer.json (model vocab + added tokens), or why unknown."""
    try:
        data = json.loads(tokenizer_json)
        ids = set(data["model"]["vocab"].values())
        ids |= {t["id"] for t in data.get("added_tokens", [])}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unknown (tokenizer.json: {type(exc).__name__}: {str(exc)[:80]})"
    return len(ids)


def summarize(f: Any) -> dict[str, Any]:
    """Everything `inspect` shows, as JSON-ready data. f: an open NanoqwenFile."""
    by_dtype: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    per_layer: dict[int, int] = defaultdict(int)
    for t in f.tensors.values():
        by_dtype[t.dtype]["count"] += 1
        by_dtype[t.dtype]["bytes"] += t.nbytes
        if t.name.startswith("layers."):
            per_layer[int(t.name.split(".")[1])] += t.nbytes
    tok = f.tokenizer
    return {
        "file": str(f.path),
        "file_size": f.file_size,
        "format_version": f.version,
        "layout_id": f.layout_id,
        "config": f.config.to_dict(),
        "quant": dict(f.quant.__dict__),
        "tokenizer": None
        if tok is None
        else {
            "vocab_size": _tokenizer_vocab(tok.tokenizer_json),
            "json_bytes": len(tok.tokenizer_json.encode("utf-8")),
            "chat_template": tok.chat_template is not None,
            "eos_token_ids": list(tok.eos_token_ids),
            "special_tokens": tok.special_tokens,
        },
        "metadata": f.metadata,
        "tensor_bytes": sum(t.nbytes for t in f.tensors.values()),
        "by_dtype": dict(by_dtype),
        "per_layer_bytes": [per_layer[i] for i in sorted(per_layer)],
        "lm_head": f.lm_head,
        "decode_bytes_per_token": f.config.weight_bytes_per_token(f.lm_head),
        "tensors": [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset,
             "nbytes": t.nbytes, "crc32": f"{t.checksum:08x}"}
            for t in f.tensors.values()
        ],
    }  # fmt: skip


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _layers_line(per_layer: list[int]) -> str:
    """Runs of equal per-layer sizes: '28 x 233.05 MiB' or 'layers 0-1: ..., 2: ...'."""
    if per_layer and len(set(per_layer)) == 1:
        return f"{len(per_layer)} x {_size(per_layer[0])} ({per_layer[0]:,} bytes)"
    return ", ".join(f"{i}: {_size(b)}" for i, b in enumerate(per_layer))


def format_text(s: dict[str, Any], largest: int) -> str:
    """The summary as aligned text for people."""
    c, q, tok = s["config"], s["quant"], s["tokenizer"]
    lines = [
        f"file        {s['file']}  ({_size(s['file_size'])}, {s['file_size']:,} bytes)",
        f"format      version {s['format_version']}, layout_id {s['layout_id']} (ValueShuffle)",
        f"model       {c['name']}: vocab {c['vocab_size']}, hidden {c['hidden_size']}, "
        f"mlp {c['intermediate_size']}, layers {c['num_layers']}, heads {c['num_heads']} "
        f"({c['num_kv_heads']} kv) x {c['head_dim']}, rope_theta {c['rope_theta']:g}, "
        f"eps {c['rms_norm_eps']:g}, max_pos {c['max_position_embeddings']}, "
        f"tied {'yes' if c['tie_word_embeddings'] else 'no'}",
        f"quant       INT{q['bits']} {'symmetric' if q['symmetric'] else 'asymmetric'}, "
        f"group {q['group_size']}, scales {q['scale_dtype']}",
        "lm_head     "
        + ("int8 rows, a float32 scale a row (lm_head.q8, lm_head.scale)"
           if s["lm_head"] == "int8" else
           "fp16 (the embedding table: tied)" if c["tie_word_embeddings"] else "fp16"),
    ]  # fmt: skip
    if tok is None:
        lines.append("tokenizer   none")
    else:
        lines.append(
            f"tokenizer   vocab {tok['vocab_size']}, {_size(tok['json_bytes'])} JSON, chat "
            f"template {'yes' if tok['chat_template'] else 'no'}, eos {tok['eos_token_ids']}, "
            f"{len(tok['special_tokens'])} special tokens"
        )
    meta = ", ".join(f"{k}={v}" for k, v in sorted(s["metadata"].items()))
    lines.append(f"metadata    {meta or 'none'}")
    dtypes = ", ".join(
        f"{d} x{v['count']} ({_size(v['bytes'])})" for d, v in sorted(s["by_dtype"].items())
    )
    lines.append(f"tensors     {len(s['tensors'])}: {dtypes}; {_size(s['tensor_bytes'])} in all")
    for t in sorted(s["tensors"], key=lambda t: -t["nbytes"])[:largest]:
        lines.append(
            f"  largest   {t['name']:<32} {t['dtype']:<8} {t['shape']} {_size(t['nbytes'])}"
        )
    lines.append(f"per layer   {_layers_line(s['per_layer_bytes'])}")
    step = s["decode_bytes_per_token"]
    lines.append(f"decode step reads {_size(step)} ({step:,} bytes) of weights per token")
    if s.get("verified"):
        lines.append(f"verify      all {len(s['tensors'])} tensor checksums OK")
    return "\n".join(lines)
