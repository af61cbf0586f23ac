"""Converters: HF checkpoint directories, GGUF files and synthetic presets -> .nanoqwen.

    pack_source(source, out, progress=True, with_tokenizer=True, quantizer="rtn",
                lm_head="float16") -> PackSummary
    pack_synthetic(preset, out, seed=0, tokenizer_from=None, progress=True, layers=None,
                   lm_head="float16") -> PackSummary

`lm_head="int8"` stores the head as int8 rows with a float32 scale a row
(quant.quantize_rows_int8) in place of the fp16 `lm_head`; a tied model keeps its fp16
`embed_tokens` for the lookup and gets the int8 head beside it. A `.nanoqwen` SOURCE with an
fp16 head is re-packed as it is but for the head (its other tensors are already quantized).

Every path streams one tensor at a time into `fileformat.write_nanoqwen` (atomic: on any
error the old output survives). `names.py` holds the one HF/GGUF -> nanoqwen name map and the
shared storing step (INT4 for the seven projections, float16 for the rest).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import preset as get_preset
from ..errors import ConvertError
from ..fileformat import TokenizerSpec, write_nanoqwen
from ..quant import LM_HEAD_FORMATS, quantize_rows_int8


@dataclass(frozen=True)
class PackSummary:
    """What a pack wrote: path, tensor count, file size in bytes, wall seconds."""

    path: Path
    tensors: int
    bytes: int
    seconds: float

    def line(self) -> str:
        return (
            f"wrote {self.path}: {self.tensors} tensors, {self.bytes / 1e9:.3f} GB "
            f"in {self.seconds:.1f} s"
        )


def _write(out, config, tensors, tokenizer, metadata, progress, started, lm_head) -> PackSummary:
    out = Path(out)
    if lm_head not in LM_HEAD_FORMATS:
        raise ConvertError(f"lm_head {lm_head!r} is not one of {', '.join(LM_HEAD_FORMATS)}")
    if lm_head != "float16":
        tensors = _int8_head(config, tensors)
        metadata = {**metadata, "lm_head": lm_head}
    write_nanoqwen(out, config, tensors, tokenizer, metadata, progress=progress, lm_head=lm_head)
    count = len(config.tensor_shapes(lm_head))
    return PackSummary(out, count, out.stat().st_size, time.perf_counter() - started)


def _int8_head(config, tensors: Iterable[tuple[str, np.ndarray]]):
    """The stream with the fp16 head replaced by `lm_head.q8` + `lm_head.scale`: quantized
    from `lm_head`, or from `embed_tokens` (passed on too, for the lookup) when tied."""
    source = "embed_tokens" if config.tie_word_embeddings else "lm_head"
    for name, array in tensors:
        if name != "lm_head":  # a tied source's lm_head (equal to the embedding) is dropped
            yield name, array
        if name == source:
            q, scale = quantize_rows_int8(array)
            yield "lm_head.q8", q
            yield "lm_head.scale", scale


def pack_source(
    source: str | os.PathLike[str], out: str | os.PathLike[str], progress: bool = True,
    with_tokenizer: bool = True, quantizer: str = "rtn", lm_head: str = "float16",
    device: str = "cpu",
) -> PackSummary:  # fmt: skip
    """Pack an HF checkpoint directory or a .gguf file into `out`, its projections quantized
    by `quantizer` (nanoqwen.quantizers.QUANTIZERS; recorded in the metadata as "quantizer";
    a calibrated one runs on the torch `device`), its head in `lm_head` format; or re-pack a
    .nanoqwen file with an fp16 head into `out` with its head in `lm_head` format (everything
    else copied).

    with_tokenizer=False packs an HF directory without its tokenizer; a GGUF file without
    tokenizer metadata packs without one.
    """
    started = time.perf_counter()
    src = Path(source)
    if src.is_file() and src.suffix.lower() == ".nanoqwen":
        return _repack(src, out, progress, lm_head, started)
    if src.is_dir():
        from .hf import read_hf

        config, tokenizer, tensors = read_hf(src, with_tokenizer, quantizer, device)
        kind = "hf"
    elif src.is_file() and src.suffix.lower() == ".gguf":
        from .gguf import read_gguf

        config, tokenizer, tensors = read_gguf(src, quantizer, device)
        kind = "gguf"
    elif src.exists():
        raise ConvertError(f"{src}: not a Hugging Face checkpoint directory or a .gguf file")
    else:
        raise ConvertError(f"{src}: no such file or directory")
    metadata = {"source": str(src.resolve()), "source_format": kind, "quantizer": quantizer}
    return _write(out, config, tensors, tokenizer, metadata, progress, started, lm_head)


def _repack(src: Path, out, progress: bool, lm_head: str, started: float) -> PackSummary:
    """A .nanoqwen file with an fp16 head, copied to `out` with its head in `lm_head`."""
    from ..fileformat import NanoqwenFile

    if Path(out).resolve() == src.resolve():
        raise ConvertError(f"{src}: re-packing needs an output other than the source")
    with NanoqwenFile(src) as f:
        if f.lm_head != "float16":
            raise ConvertError(f"{src}: its head is {f.lm_head}; re-pack from the fp16 source")
        tensors = ((name, f.tensor(name)) for name in f.config.tensor_shapes())
        metadata = {**f.metadata, "repacked_from": str(src.resolve())}
        return _write(out, f.config, tensors, f.tokenizer, metadata, progress, started, lm_head)


def load_tokenizer(path: str | os.PathLike[str]) -> TokenizerSpec:
    """The tokenizer of a .nanoqwen file, a .gguf file or an HF checkpoint directory."""
    src = Path(path)
    if src.is_dir():
        from .tokenizers import spec_from_hf_dir

        return spec_from_hf_dir(src)
    if src.suffix.lower() == ".gguf":
        from .gguf import open_gguf, tokenizer_from_gguf

        spec = tokenizer_from_gguf(open_gguf(src), str(src))
    elif not src.is_file():
        raise ConvertError(f"{src}: no such tokenizer source")
    else:
        from ..fileformat import NanoqwenFile

        with NanoqwenFile(src) as f:
            spec = f.tokenizer
    if spec is None:
        raise ConvertError(f"{src}: the file carries no tokenizer")
    return spec


def pack_synthetic(
    preset: str, out: str | os.PathLike[str], seed: int = 0,
    tokenizer_from: str | os.PathLike[str] | None = None, progress: bool = True,
    layers: int | None = None, lm_head: str = "float16",
) -> PackSummary:  # fmt: skip
    """Pack random weights with exactly `preset`'s shapes (see synthetic.py) into `out`.

    The tokenizer is a small byte-level one with the Qwen2.5 specials at their real ids, or
    the one of `tokenizer_from` (a .nanoqwen, .gguf or HF directory). `layers`: the preset's
    widths at that depth (config name "<preset>-<layers>l"): every kernel shape of the preset,
    with a float32 reference that fits beside the engine (the 32B's takes 131 GB at 64 layers,
    22 GB at 8).
    """
    from .synthetic import synthetic_tensors
    from .tokenizers import byte_level_spec

    started = time.perf_counter()
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConvertError(f"synthetic seed must be an integer in [0, 2^63), got {seed!r}")
    config = get_preset(preset)
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ConvertError(f"synthetic layers must be a positive integer, got {layers!r}")
        config = dataclasses.replace(config, name=f"{config.name}-{layers}l", num_layers=layers)
    tokenizer = byte_level_spec() if tokenizer_from is None else load_tokenizer(tokenizer_from)
    metadata = {"source": f"synthetic:{config.name}", "source_format": "synthetic"}
    metadata["seed"] = str(seed)
    tensors = synthetic_tensors(config, seed)
    return _write(out, config, tensors, tokenizer, metadata, progress, started, lm_head)
