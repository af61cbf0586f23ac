"""Where nanoqwen keeps files between runs: one cache directory, `$NANOQWEN_CACHE` (default
~/.cache/nanoqwen), holding the demo's downloads and the compiled kernels (`kernels/`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(sub: str = "") -> Path:
    """The cache directory, or its subdirectory `sub` (created)."""
    root = Path(os.environ.get("NANOQWEN_CACHE") or Path.home() / ".cache" / "nanoqwen")
    if not sub:
        return root
    path = root / sub
    path.mkdir(parents=True, exist_ok=True)
    return path
