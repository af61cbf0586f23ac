"""Run the validation ladder (nanoqwen/config/nanoqwen.yaml) on an sm_90 GPU: unit (each
kernel vs numpy on awkward sizes), layer (one decoder block vs the reference), graph (prompts
end to end vs the reference). A file of real weights (pack's metadata: source_format hf or
gguf) runs the layer and graph tiers on real code with the gates of ladder.*.real
(harness.validate_real). Exits non-zero if any check fails."""

from .argtypes import int_range
from .generate import add_k_cache_argument

HELP = "validate the CUDA kernels and engine against the reference"


def add_arguments(p) -> None:
    p.add_argument("file", help=".nanoqwen model file (its config sets the kernel dims)")
    p.add_argument("--tier", choices=("unit", "layer", "graph", "all"), default="all",
                   help="which rung(s) of the ladder")  # fmt: skip
    p.add_argument(
        "--prompts",
        type=int_range(1),
        default=None,
        help="graph tier prompts of a synthetic file; None = the count in config/nanoqwen.yaml "
        "(a real file's code windows are set there)",
    )
    add_k_cache_argument(p)
    p.add_argument(
        "--seed",
        type=int_range(0),
        default=None,
        help="seed of the random inputs; None = fresh inputs each run",
    )


def run(args) -> int:
    from ..engine import CudaBackend
    from ..fileformat import NanoqwenFile
    from ..harness import import_torch_first, load_protocol
    from ..harness import validate as v
    from ..harness import validate_real as vr
    from ..harness.real_text import is_real

    if args.tier != "unit":
        import_torch_first()  # the layer and graph tiers' reference runs after the kernels build
    ladder = load_protocol()["ladder"]
    checks = []
    with NanoqwenFile(args.file) as f:
        real = is_real(f)  # real weights: real code and the gates of ladder.*.real
        if args.tier in ("unit", "all"):
            checks += v.unit_tier(f.config, ladder["unit"]["tolerances"], args.seed, args.k_cache)
        if args.tier in ("layer", "graph", "all"):
            engine = CudaBackend(f, max_context=4096, k_cache=args.k_cache)
            try:
                if args.tier in ("layer", "all") and real:
                    checks += vr.real_layer_tier(engine, f, ladder["layer"]["real"])
                elif args.tier in ("layer", "all"):
                    checks += v.layer_tier(engine, f, ladder["layer"]["tolerance"], seed=args.seed)
                if args.tier in ("graph", "all") and real:
                    checks += vr.real_graph_tier(engine, f, ladder["graph"]["real"])
                elif args.tier in ("graph", "all"):
                    n = args.prompts or ladder["graph"]["prompts"]
                    checks += v.graph_tier(engine, f, ladder["graph"], n, args.seed)
            finally:
                engine.close()
    v.print_table(checks)
    return 0 if all(c.ok for c in checks) else 1
