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
