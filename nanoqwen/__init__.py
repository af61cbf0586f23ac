"""nanoqwen: a bare-metal INT4 inference runtime for Qwen2.5-Coder on NVIDIA Hopper."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `nanoqwen.LLM` without importing torch or CUDA at package import.
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(f"module 'nanoqwen' has no attribute {name!r}")
