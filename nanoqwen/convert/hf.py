"""Hugging Face Qwen2 checkpoint directories -> logical float tensors, one at a time.

A directory holds config.json, `model.safetensors` or shards listed by
`model.safetensors.index.json`, and tokenizer files. We parse the safetensors header ourselves
(8-byte little-endian length, a JSON table of dtype/shape/data_offsets, then raw row-major data)
and read one tensor's bytes with `np.fromfile`: BF16 widens to float32 by a 16-bit shift, so
neither torch nor a whole-shard map is needed and peak memory is about one float32 tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import ConfigError, ModelConfig
from ..errors import ConvertError
from .names import check_names, convert_stream, source_names
from .tokenizers import spec_from_hf_dir

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 << 20  # a safetensors header larger than 100 MiB is not a checkpoint


def read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """(data start offset, {tensor name: {dtype, shape, data_offsets}}) of one shard, with every
    entry bounds-checked against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < length <= min(_MAX_HEADER, size - 8):
            raise ConvertError(f"{path}: bad safetensors header length {length} (file {size} B)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConvertError(f"{path}: safetensors header is not JSON: {exc}") from None
    header.pop("__metadata__", None)
    start = 8 + length
    for name, entry in header.items():
        _check_entry(path, name, entry, size - start)
    return start, header


def _check_entry(path: Path, name: str, entry: dict, data_size: int) -> None:
    dtype = entry.get("dtype")
    if dtype not in _DTYPES:
        raise ConvertError(f"{path}: tensor {name} has dtype {dtype}; supported: F32, F16, BF16")
    begin, end = entry["data_offsets"]
    count = int(np.prod(entry["shape"], dtype=np.int64))
    if not 0 <= begin <= end <= data_size or end - begin != count * _DTYPES[dtype].itemsize:
        raise ConvertError(
            f"{path}: tensor {name} bytes [{begin}, {end}) do not hold shape {entry['shape']} "
            f"{dtype} within the {data_size}-byte data section"
        )


def read_tensor(path: Path, start: int, entry: dict) -> np.ndarray:
    """One tensor of a shard as float32, shaped as stored."""
    dtype = _DTYPES[entry["dtype"]]
    begin, end = entry["data_offsets"]
    raw = np.fromfile(
        path, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start + begin
    )
    if entry["dtype"] == "BF16":
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False).reshape(entry["shape"])


def shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or model.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ConvertError(f"{index}: not a safetensors index ({exc})") from None
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = [directory / "model.safetensors"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConvertError(f"{directory}: safetensors file(s) missing: {', '.join(missing)}")
    return files


def config_from_dir(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ConvertError(f"{directory}: no config.json; not a Hugging Face checkpoint")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()), name=directory.name)
    except (json.JSONDecodeError, ConfigError) as exc:
        raise ConvertError(f"{path}: {exc}") from None


def read_hf(
    directory: Path, with_tokenizer: bool = True, quantizer: str = "rtn", device: str = "cpu"
):  # fmt: skip
    """(config, tokenizer spec or None, stored-tensor iterator) for one HF directory;
    projections quantized by `quantizer` (a name of nanoqwen.quantizers.QUANTIZERS; a
    calibrated one on the torch `device`)."""
    from ..quantizers import projection_quantizer

    if not directory.is_dir():
        raise ConvertError(f"{directory}: no such checkpoint directory")
    config = config_from_dir(directory)
    tokenizer = spec_from_hf_dir(directory) if with_tokenizer else None
    located: dict[str, tuple[Path, int, dict]] = {}
    for shard in shard_files(directory):
        start, header = read_header(shard)
        for name, entry in header.items():
            if name in located:
                raise ConvertError(f"{directory}: tensor {name} appears in two shards")
            located[name] = (shard, start, entry)
    order = check_names(config, list(located), "hf", str(directory))
    logical = source_names(config, "hf")
    by_logical = {logical[name]: name for name in order}

    def items():
        for name in order:
            yield name, logical[name], read_tensor(*located[name])

    def get(name: str) -> np.ndarray:
        return read_tensor(*located[by_logical[name]])

    quantize = projection_quantizer(quantizer, config, tokenizer, get, str(directory), device)
    return config, tokenizer, convert_stream(config, items(), str(directory), quantize)
