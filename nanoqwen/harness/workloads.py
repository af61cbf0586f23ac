"""Real prompts for `nanoqwen bench --workload edit|fim|chat`, built from the Python standard
library's own source files (present wherever Python is), deterministic for a seed and a Python
version.

- edit: an editor's rewrite request: one function of a stdlib module, whole in the prompt, and
  an instruction whose answer is the whole function again with a change (type hints, a
  docstring, a rename). The answer repeats the prompt nearly token for token: speculation's
  best case.
- fim: fill-in-the-middle as an editor sends it: a stdlib file cut around a removed span of
  lines inside a function body; the prefix and suffix around it (the tail of what precedes,
  the head of what follows, so the prompt stays a few thousand characters).
- chat: an open question with nothing to copy: speculation's worst case (few drafts, and
  rejected ones cost a wider step).

A Prompt holds text, not token ids (LLM.prepare makes the ids with the model's tokenizer and
chat template).
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("edit", "fim", "chat")
# A function worth editing: long enough to be a real edit, short enough that prompt + answer
# stay a few hundred tokens.
FUNCTION_LINES = (8, 40)
FIM_PREFIX_CHARS = 3000  # the tail of the file before the gap
FIM_SUFFIX_CHARS = 1200  # the head of the file after it
FIM_SPAN_LINES = (1, 4)  # lines removed from a function body
EDIT_INSTRUCTIONS = (
    "Add type hints to every parameter and to the return value of this function. Output the "
    "whole function and nothing else.",
    "Add a docstring to this function that says what it does, its arguments and what it "
    "returns. Output the whole function and nothing else.",
    "Rename `{name}` to `{new}` everywhere in this function. Output the whole function and "
    "nothing else.",
)
CHAT_QUESTIONS = (
    "What is the difference between a process and a thread, and when would you use each?",
    "Explain how a hash table handles collisions.",
    "Why is floating-point addition not associative? Give an example.",
    "What are the trade-offs between SQL and NoSQL databases?",
    "How does garbage collection work in Python?",
    "Explain what a race condition is and how to avoid one.",
    "When should a team write integration tests rather than unit tests?",
    "What does Python's `{module}` module do, and when would you reach for it?",
)


@dataclass(frozen=True)
class Prompt:
    """One request: chat `messages` (edit, chat) or a `fim` (prefix, suffix) pair; `source` is
    the stdlib file it came from, `function` the function's text (edit; the removed span for
    fim)."""

    workload: str
    messages: tuple[dict[str, str], ...] | None = None
    fim: tuple[str, str] | None = None
    source: str = ""
    function: str = ""

    def prepare_args(self) -> dict:
        """LLM.prepare's keyword arguments for this prompt."""
        if self.fim is not None:
            return {"fim": self.fim}
        return {"messages": list(self.messages)}


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's top-level and package .py files, sorted (tests, IDLE, the
    generated codec tables of `encodings` and site-packages left out: not hand-written library
    code)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "encodings", "site-packages", "dist-packages",
            "__pycache__"}  # fmt: skip
    files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no Python source files under {root}")
    return sorted(files)


def functions(text: str) -> list[ast.FunctionDef]:
    """The functions and methods of a module's source with FUNCTION_LINES lines, in order."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lo, hi = FUNCTION_LINES
    found = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and lo <= node.end_lineno - node.lineno + 1 <= hi
    ]
    return sorted(found, key=lambda n: n.lineno)


def _function_text(lines: list[str], node: ast.FunctionDef) -> str:
    return textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))


def _rename(node: ast.FunctionDef) -> str | None:
    """A parameter (not self/cls) or local variable of the function to rename, or None."""
    params = [a.arg for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
    stored = [
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    ]
    names = [n for n in params + stored if len(n) > 1]
    return names[0] if names else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _pick(rng: random.Random, files: list[Path]):
    """A random (path, text, lines, function node) with a suitable function."""
    while True:
        path = rng.choice(files)
        text = _read(path)
        found = functions(text) if text else []
        if found:
            return path, text, text.splitlines(keepends=True), rng.choice(found)


def edit_prompt(rng: random.Random, files: list[Path], root: Path) -> Prompt:
    path, _, lines, node = _pick(rng, files)
    code = _function_text(lines, node)
    instruction = rng.choice(EDIT_INSTRUCTIONS)
    name = _rename(node)
    if "{name}" in instruction:
        if name is None:
            instruction = EDIT_INSTRUCTIONS[0]
        instruction = instruction.format(name=name, new=f"{name}_renamed")
    content = f"{instruction}\n\n```python\n{code}```"
    return Prompt("edit", messages=({"role": "user", "content": content},),
                  source=str(path.relative_to(root)), function=code)  # fmt: skip


def fim_prompt(rng: random.Random, files: list[Path], root: Path) -> Prompt:
    path, _, lines, node = _pick(rng, files)
    body_first, body_last = node.body[0].lineno, node.end_lineno  # 1-based, inclusive
    span = rng.randint(*FIM_SPAN_LINES)
    start = rng.randint(body_first, max(body_first, body_last - span + 1))  # 1-based
    end = min(start + span - 1, body_last)
    prefix = "".join(lines[: start - 1])[-FIM_PREFIX_CHARS:]
    suffix = "".join(lines[end:])[:FIM_SUFFIX_CHARS]
    middle = "".join(lines[start - 1 : end])
    return Prompt("fim", fim=(prefix, suffix), source=str(path.relative_to(root)),
                  function=middle)  # fmt: skip


def chat_prompt(rng: random.Random, files: list[Path], root: Path) -> Prompt:
    question = rng.choice(CHAT_QUESTIONS)
    source = ""
    if "{module}" in question:
        path = rng.choice([p for p in files if p.parent == root] or files)
        source, question = str(path.relative_to(root)), question.format(module=path.stem)
    return Prompt("chat", messages=({"role": "user", "content": question},), source=source)


BUILDERS = {"edit": edit_prompt, "fim": fim_prompt, "chat": chat_prompt}


def build(workload: str, count: int, seed: int = 0, root: Path | None = None) -> list[Prompt]:
    """`count` prompts of `workload` (WORKLOADS), the same for the same seed, stdlib and
    Python version."""
    if workload not in BUILDERS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    rng = random.Random(f"{workload}:{seed}")
    return [BUILDERS[workload](rng, files, root) for _ in range(count)]
