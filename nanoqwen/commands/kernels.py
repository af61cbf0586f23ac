"""Compile every decode kernel with NVRTC (no GPU needed) and print registers, static shared
memory, stack and spill bytes per kernel. Exits non-zero on a compile error or on local-memory
spills in a decode kernel. NANOQWEN_DUMP_PTX=<name> also writes that kernel's PTX."""

HELP = "compile the decode kernels and show their resources"


def add_arguments(p) -> None:
    p.add_argument("--model", default="7b", help="config preset whose dims the kernels get")


def run(args) -> int:
    from ..config import preset
    from ..cuda import jit

    cfg = preset(args.model)
    bad = 0
    print(f"{'kernel':40} {'regs':>5} {'smem':>7} {'stack':>6} {'spill':>6}   ({cfg.name}, "
          f"{jit.ARCH}, NVRTC {jit._nvrtc_version()})")  # fmt: skip
    for src, names in jit.decode_kernels(cfg).items():
        res = jit.compile_module(src, names, cfg).resources()
        for name in names:
            r = res.get(name)
            if r is None:
                print(f"{name:40} (no ptxas info)")
                bad += 1
                continue
            flag = "  SPILLS" if r.spill_bytes else ""
            bad += bool(r.spill_bytes)
            print(f"{name:40} {r.registers:5} {r.smem_bytes:7} {r.stack_bytes:6} "
                  f"{r.spill_bytes:6}{flag}")  # fmt: skip
    return 1 if bad else 0
