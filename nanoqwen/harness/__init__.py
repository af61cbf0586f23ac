"""What measures the engine rather than serving it: the validation ladder (validate), the
benchmark (bench), the transformers baseline it compares against (baseline) and the prefill
kernels' checks (prefill_checks). Their protocol, tolerances and defaults live in one file,
nanoqwen/config/nanoqwen.yaml (`load_protocol`)."""

from pathlib import Path

PROTOCOL_PATH = Path(__file__).parent.parent / "config" / "nanoqwen.yaml"


def load_protocol() -> dict:
    """The yaml: `ladder` (the validation tiers and their tolerances) and `benchmark` (the
    benchmark_e2e defaults)."""
    import yaml

    return yaml.safe_load(PROTOCOL_PATH.read_text())


def import_torch_first() -> None:
    """Import torch now, in a process that will use it after the engine has built its kernels.

    On the H200 host (torch 2.11, NVRTC 13) a process that compiled kernels with NVRTC (a cold
    kernel cache) before its first `import torch` fails that import, parsing the schema of one
    of torch's own ops ("expected ident but found ')'" in "annotate(strtag) -> ()"); with torch
    imported first it does not (docs/EXPERIMENTS.md, Validation). The engine never imports
    torch, so the order is up to its callers: the ladder, the transformers baseline, the tests
    and the dev scripts that take a reference."""
    import torch  # noqa: F401
