"""The SASS of every registry kernel, one file per (preset, kernel), for comparing two trees.

    PYTHONPATH=TREE python3 dev/sass_dump.py OUT [--models 7b,1.5b,0.5b,tiny] [--nvdisasm PATH]

Compiles the kernel table of each preset with NVRTC (no GPU; a private kernel cache, so
nothing stale is reused) and writes `nvdisasm -c` of each kernel to OUT/<preset>__<kernel>.sass.
`-c` prints the code without line information: a comment-only edit leaves every file as it
was, any changed instruction shows. Compare two trees with `diff -r OUT1 OUT2`. nvdisasm comes
from the pip wheel nvidia-cuda-nvdisasm (found under site-packages/nvidia/cu*/bin) unless given.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def find_nvdisasm() -> str:
    import nvidia

    for root in nvidia.__path__:
        for path in glob.glob(os.path.join(root, "cu*", "bin", "nvdisasm")):
            return path
    sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm")


def functions(disassembly: str) -> dict[str, str]:
    """nvdisasm's listing split by function: {mangled name: its code}."""
    out, name, lines = {}, None, []
    for line in disassembly.splitlines():
        m = re.match(r"\s*//-+ \.text\.(\S+)\s+-+", line)
        if m:
            if name:
                out[name] = "\n".join(lines)
            name, lines = m.group(1), []
        elif name is not None:
            lines.append(line)
    if name:
        out[name] = "\n".join(lines)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--models", default="7b,1.5b,0.5b,tiny", help="presets, comma-separated")
    ap.add_argument("--nvdisasm", default=None, help="path of nvdisasm")
    args = ap.parse_args()
    os.environ["NANOQWEN_CACHE"] = tempfile.mkdtemp(prefix="sass-cache-")
    from nanoqwen.config import preset
    from nanoqwen.cuda import registry

    nvdisasm = args.nvdisasm or find_nvdisasm()
    args.out.mkdir(parents=True, exist_ok=True)
    count = 0
    for model in args.models.split(","):
        cfg = preset(model)
        specs = registry.kernel_table(cfg)
        for source, compiled in registry.compile_specs(specs, cfg).items():
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(compiled.cubin)
                cubin.flush()
                listing = subprocess.run([nvdisasm, "-c", cubin.name], capture_output=True,
                                         text=True, check=True).stdout  # fmt: skip
            by_name = functions(listing)
            for expression in registry.sources(specs)[source]:
                safe = re.sub(r"[^A-Za-z0-9_]+", "_", expression)
                code = by_name[compiled.symbols[expression]]
                (args.out / f"{model}__{safe}.sass").write_text(code)
                count += 1
    print(f"{count} kernels written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
