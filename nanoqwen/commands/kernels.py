"""Compile every kernel of the registry (nanoqwen/cuda/registry.py: the decode step's and the
prefill's) with NVRTC for sm_90a, no GPU needed, and print each one's block, dynamic shared
memory, registers, static shared memory, stack and spill bytes, then the tunables the kernels
were built with, by source file. Exits non-zero on a compile error or on local-memory spills.
--k-cache picks the K cache format's geometry (registry.K_CACHE) and --set NAME=VALUE builds a
variant of it (e.g. --set kGvEarlyStages=2);
NANOQWEN_DUMP_PTX=<name> also writes that kernel's PTX."""

from .generate import add_k_cache_argument

HELP = "compile every kernel and show its resources (no GPU needed)"


def add_arguments(p) -> None:
    p.add_argument("--model", default="7b", help="config preset whose dims the kernels get")
    add_k_cache_argument(p)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a geometry value (registry.Geometry, C name)")  # fmt: skip


def _overrides(items: list[str]) -> dict[str, int]:
    from ..errors import NanoqwenError

    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise NanoqwenError(f"--set wants NAME=INTEGER, got {item!r}")
        out[name] = int(value)
    return out


def _wrapped(text: str) -> None:
    import textwrap

    print(textwrap.fill(text, 100, initial_indent="  ", subsequent_indent="    "))


def run(args) -> int:
    from ..config import preset
    from ..errors import NanoqwenError

    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError as exc:
        raise NanoqwenError(
            f"compiling kernels needs NVRTC from the cuda extra ({exc}); install it with "
            "pip install 'nanoqwen[cuda]'"
        ) from None
    from ..cuda import jit, registry

    cfg = preset(args.model)
    try:
        geometry = registry.k_cache_geometry(args.k_cache).override(_overrides(args.set))
    except ValueError as exc:
        raise NanoqwenError(str(exc)) from None
    specs = registry.kernel_table(cfg, geometry)
    modules = registry.compile_specs(specs, cfg, geometry)
    width = max(len(s.expression) for s in specs)
    where = f"({cfg.name}, {jit.ARCH}, NVRTC {jit.nvrtc_version()})"
    print(f"{'kernel':{width}} {'block':>5} {'dyn smem':>8} {'regs':>5} {'smem':>6} "
          f"{'stack':>5} {'spill':>5}   {where}")  # fmt: skip
    bad = 0
    for s in specs:
        r = modules[s.source].resources().get(s.expression)
        if r is None:
            print(f"{s.expression:{width}} (no ptxas report)")
            bad += 1
            continue
        flag = "  SPILLS" if r.spill_bytes else ""
        bad += bool(r.spill_bytes)
        print(f"{s.expression:{width}} {s.threads:5} {s.smem:8} {r.registers:5} "
              f"{r.smem_bytes:6} {r.stack_bytes:5} {r.spill_bytes:5}{flag}")  # fmt: skip
    values = geometry.constants()
    print("tunables (registry.Geometry; --set NAME=VALUE builds a variant):")
    used: set[str] = set()
    for source in registry.sources(specs):
        names = dict.fromkeys(n for s in specs if s.source == source for n in s.tunables)
        used |= set(names)
        _wrapped(f"{source}: " + ", ".join(f"{n}={values[n]}" for n in names))
    _wrapped("launchers only: " + ", ".join(f"{n}={v}" for n, v in values.items() if n not in used))
    return 1 if bad else 0
