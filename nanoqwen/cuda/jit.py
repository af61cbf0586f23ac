"""NVRTC compilation with an honest on-disk cache.

compile_module(source_name, names, header, *, source=None) -> Compiled
    source_name: a file in nanoqwen/kernels/ (or a label when `source` is given); names:
    kernel name expressions (extern "C" names or template instantiations such as
    "gemv_int4<3584, true, 0>"); header: the generated header prepended to the source
    (nanoqwen.cuda.registry.header: the model's dims and the kernels' geometry). No GPU is
    needed. Cached under the nanoqwen cache's `kernels/` (nanoqwen.paths), keyed on the
    source text, every header in nanoqwen/kernels/, the generated header, the options,
    the arch and the NVRTC version; a file lock guards concurrent builds of one entry.
    NANOQWEN_NO_COMPILE=1 turns a cache miss into a DeviceError (a test proves that
    serving never compiles); NANOQWEN_DUMP_PTX=<substring> writes the PTX of any module
    whose kernel names contain the substring next to the cache entry and prints its path.
Compiled: .cubin (bytes), .symbols {name expression -> mangled}, .log (ptxas -v text),
    .resources() -> {name expression: Resources(registers, smem_bytes, spill_bytes,
    stack_bytes)}, .kernel(name) -> cuda.core Kernel (needs a current device).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import paths
from ..errors import DeviceError

ARCH = "sm_90a"  # wgmma/TMA/setmaxnreg need the "a" target; we run on H100/H200 only
STD = "c++17"
KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"


def nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception:
        return "unknown"


def include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h / cuda/std headers, best first.

    $NANOQWEN_CUDA_INCLUDE, then $CUDA_HOME/include, the toolkit under /usr/local, and the
    pip wheels (nvidia/cu13/include, nvidia/cuda_runtime/include). Empty when none is found;
    NVRTC 13 then falls back to its bundled headers.
    """
    candidates = [os.environ.get("NANOQWEN_CUDA_INCLUDE", "")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates += ["/usr/local/cuda/include", *sorted(glob.glob("/usr/local/cuda-*/include"))]
    for path in sys.path:
        candidates += glob.glob(os.path.join(path, "nvidia", "*", "include"))
    found = []
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "cuda_fp16.h")) and c not in found:
            found.append(c)
    return found


@dataclass(frozen=True)
class Resources:
    registers: int
    smem_bytes: int
    spill_bytes: int
    stack_bytes: int


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, Resources]:
    """Per mangled entry: registers, static smem, spill bytes (stores+loads), stack frame."""
    out: dict[str, Resources] = {}
    entry, stack, spill = None, 0, 0
    for line in log.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            entry, stack, spill = m.group(1), 0, 0
        elif entry and (m := _PTXAS_SPILL.search(line)):
            stack, spill = int(m.group(1)), int(m.group(2)) + int(m.group(3))
        elif entry and (m := _PTXAS_REGS.search(line)):
            smem = _PTXAS_SMEM.search(line)
            out[entry] = Resources(int(m.group(1)), int(smem.group(1)) if smem else 0, spill, stack)
            entry = None
    return out


@dataclass
class Compiled:
    label: str
    cubin: bytes
    symbols: dict[str, str]
    log: str
    _object: object = field(default=None, repr=False)

    def resources(self) -> dict[str, Resources]:
        by_mangled = parse_ptxas_log(self.log)
        return {name: by_mangled[m] for name, m in self.symbols.items() if m in by_mangled}

    def kernel(self, name: str):
        """The loaded kernel of name expression `name`, looked up by its mangled name (no
        symbol_mapping: cuda.core versions differ on whether its values are str or bytes)."""
        if self._object is None:
            from cuda.core import ObjectCode

            self._object = ObjectCode.from_cubin(self.cubin, name=self.label)
        return self._object.get_kernel(self.symbols[name])


def cache_dir() -> Path:
    return paths.cache_dir("kernels")


def _options(includes: list[str]) -> list[str]:
    # 177: the generated header declares every dim; a kernel uses only some of them.
    opts = [f"-arch={ARCH}", f"--std={STD}", "-default-device", "-Xptxas=-v", "-lineinfo"]
    opts.append("--diag-suppress=177")
    opts += [f"-I{d}" for d in [str(KERNEL_DIR), *includes]]
    return opts


def _headers_text() -> str:
    return "".join(p.read_text() for p in sorted(KERNEL_DIR.glob("*.cuh")))


def compile_module(
    source_name: str, names: list[str], header: str, *, source: str | None = None
) -> Compiled:
    """Compile (or fetch from the cache) one .cu file with the given kernel instantiations."""
    text = source if source is not None else (KERNEL_DIR / source_name).read_text()
    includes = include_dirs()
    opts = _options(includes)
    key_material = json.dumps(
        [text, _headers_text(), header, opts[:-len(includes)] if includes else opts, ARCH,
         nvrtc_version(), sorted(names)]
    )  # fmt: skip
    key = hashlib.sha256(key_material.encode()).hexdigest()[:32]
    stem = Path(source_name).stem
    path = cache_dir() / f"{stem}-{key}.json"
    dump = os.environ.get("NANOQWEN_DUMP_PTX")
    want_ptx = bool(dump) and any(dump in n for n in names)
    hit = _read_cache(path)
    if hit is not None and not want_ptx:
        return hit
    lock_path = path.with_suffix(".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same module
        hit = _read_cache(path)  # lock, then re-check
        if hit is not None and not want_ptx:
            return hit
        if os.environ.get("NANOQWEN_NO_COMPILE") == "1":
            raise DeviceError(
                f"NANOQWEN_NO_COMPILE=1 but {source_name} ({', '.join(names)}) is not in the "
                f"kernel cache {cache_dir()}"
            )
        full = header + f'#line 1 "{source_name}"\n' + text
        compiled = _nvrtc(full, source_name, names, opts)
        if want_ptx:
            ptx_path = path.with_suffix(".ptx")
            ptx_path.write_bytes(_nvrtc(full, source_name, names, opts, ptx=True))
            print(f"nanoqwen: PTX of {source_name} written to {ptx_path}", file=sys.stderr)
        _write_cache(path, compiled)
        return compiled


def _nvrtc(full: str, label: str, names: list[str], opts: list[str], ptx: bool = False):
    """Compile through cuda.bindings.nvrtc directly (every option visible, the log kept)."""
    from cuda.bindings import nvrtc

    def ok(result, what):
        err, *vals = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise DeviceError(f"{what} failed for {label}: {err}")
        return vals[0] if vals else None

    prog = ok(nvrtc.nvrtcCreateProgram(full.encode(), label.encode(), 0, [], []), "create")
    try:
        for n in names:
            ok(nvrtc.nvrtcAddNameExpression(prog, n.encode()), f"add name {n}")
        bopts = [o.encode() for o in opts]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
        size = ok(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        ok(nvrtc.nvrtcGetProgramLog(prog, log), "log")
        log_text = log.decode(errors="replace").rstrip("\x00 ")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise DeviceError(f"NVRTC could not compile {label} ({err}):\n{log_text}")
        if ptx:
            size = ok(nvrtc.nvrtcGetPTXSize(prog), "ptx size")
            buf = b" " * size
            ok(nvrtc.nvrtcGetPTX(prog, buf), "ptx")
            return buf
        size = ok(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * size
        ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        symbols = {}
        for n in names:
            mangled = ok(nvrtc.nvrtcGetLoweredName(prog, n.encode()), f"lowered name {n}")
            symbols[n] = mangled.decode() if isinstance(mangled, bytes) else str(mangled)
        return Compiled(label, bytes(cubin), symbols, log_text)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _read_cache(path: Path) -> Compiled | None:
    try:
        data = json.loads(path.read_text())
        return Compiled(
            data["label"], base64.b64decode(data["cubin"]), data["symbols"], data["log"]
        )
    except (OSError, ValueError, KeyError):
        return None


def _write_cache(path: Path, compiled: Compiled) -> None:
    data = {
        "label": compiled.label,
        "cubin": base64.b64encode(compiled.cubin).decode(),
        "symbols": compiled.symbols,
        "log": compiled.log,
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
