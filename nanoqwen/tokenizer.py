"""Text <-> token ids for Qwen2.5: byte-level BPE, ChatML through the embedded template, FIM.

Design decisions, stated once:

* **No BOS.** Qwen2.5 prompts start with whatever the text or template says; `encode` adds
  nothing.
* **Raw prompts may hold control tokens; chat contents never do.** `encode(text)` encodes the
  characters `<|im_end|>` as ordinary text; `encode(text, allow_special=True)` matches every
  added token of the tokenizer as Hugging Face does. `LLM.prepare(prompt=...)` (and so the
  server's /v1/completions and `generate -p`) parses them by default, as vLLM, llama.cpp's
  server and Hugging Face do: code-completion clients (Tabby, Continue, Twinny, llm-ls) build
  FIM prompts from `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>` text, and a raw prompt
  is the caller's own text. `special_tokens="text"` opts out. Chat prompts get the safe
  behaviour per message: the template's own text may contain control tokens, message
  contents never do (`encode_chat`), so a user message cannot forge turn boundaries. Tool
  definitions and an assistant's tool calls are rendered by the template (as JSON, inside its
  own text), so they are refused when they hold control-token text. Plain text is always
  encoded as one run, so the ids equal Hugging Face's.
* **Encoding is bounded and off the GIL.** With `limit`, encoding stops once the ids pass it
  (TooManyTokens): a text too long for the context costs about `limit` tokens of work, not
  its whole length. Long text is encoded in chunks cut only where the Qwen2 pre-tokenizer
  splits anyway (`_CUT`), so the ids equal those of one encoding of the whole text; a stretch
  with no such cut (one run of letters, spaces or symbols megabytes long) is encoded whole,
  which the server's body limit bounds (~3-4 s for 4 MiB on one core). Each chunk goes
  through `encode_batch_fast`, which releases the GIL while it works (`encode` holds it), and
  long regex scans run in windows, so a big prompt never stalls the other threads of the
  process (the server's event loop among them).
* **Streaming never emits broken UTF-8.** Token ids map to raw bytes (the GPT-2 byte alphabet);
  `IncrementalDetokenizer` feeds them through an incremental UTF-8 decoder that holds back an
  incomplete multi-byte sequence until the bytes that finish it arrive.
* **Stop strings are matched on text.** `StopMatcher` holds back any tail that could be the
  start of a stop string, and cuts the text before the first stop string found.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

import jinja2
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .convert.tokenizers import QWEN2_SPLIT_REGEX
from .errors import ContextError, TokenizerError, ToolsError

ROLES = ("system", "user", "assistant", "tool")
FIM_KEYS = ("fim_prefix", "fim_suffix", "fim_middle")

CHUNK_CHARS = 16384  # text encoded per call: ~4k Qwen tokens of code, ~5 ms on one core
SCAN_WINDOW = 65536  # characters one regex search covers before other threads may run
# NFC merges at most 4 characters into one (the longest canonical decomposition, U+1FAF), so a
# text of n characters normalizes to at least n / 4.
NFC_MAX_MERGE = 4

# Positions s where the Qwen2 pre-tokenizer (NFC, then QWEN2_SPLIT_REGEX) splits the text
# anyway, so that text[:s] and text[s:] encoded apart give the ids of the whole. text[s] is
# ASCII (NFC never composes an ASCII character with what precedes it), and one of:
#   text[s-1] is a digit: a digit is a piece of its own (\p{N});
#   text[s-1] is an ASCII letter and text[s] is not a letter: the letter run ends at s;
#   text[s] is a digit and text[s-1] is not whitespace: nothing runs into a digit, and no
#     whitespace run reaches s, so no `\s+(?!\S)` looks at text[s];
#   text[s-1] is a newline and text[s] is not whitespace: the newline run ends at s.
# (Python's \S excludes a superset of the regex's whitespace.) tests/test_tokenizer_bounds.py
# checks the identity on random text and on the standard library's sources.
_CUT = re.compile(
    r"(?<=[0-9])[\x00-\x7f]|(?<=[A-Za-z])[\x00-\x40\x5b-\x60\x7b-\x7f]|(?<=\S)[0-9]|(?<=\n)[!-~]"
)

# A message content's placeholder in encode_chat's masked rendering, \ue000{nonce}:{index}\ue001
# (private-use characters; the nonce is NONCE_BYTES random bytes in hex): one pattern compiled
# once, the nonce checked after the split. A pattern holding the nonce would be compiled at
# every chat prompt (re's cache never sees a nonce twice), 0.3 ms on a 2-core CPU.
NONCE_BYTES = 8
_PLACEHOLDER = re.compile(f"\ue000([0-9a-f]{{{2 * NONCE_BYTES}}}):(\\d+)\ue001")


class TooManyTokens(ContextError):
    """The text encodes to more than `limit` tokens; encoding stopped soon after the limit."""

    def __init__(self, limit: int, message: str | None = None) -> None:
        super().__init__(message or f"the text encodes to more than {limit} tokens")
        self.limit = limit


def _search(pattern: re.Pattern, text: str, pos: int, reach: int) -> re.Match | None:
    """pattern.search(text, pos), SCAN_WINDOW characters at a time: a search through megabytes
    without a match would hold the GIL for the whole scan. `reach`: the longest match."""
    while pos < len(text):
        m = pattern.search(text, pos, pos + SCAN_WINDOW + reach)
        if m is not None and m.start() < pos + SCAN_WINDOW:
            return m
        pos += SCAN_WINDOW
    return None


def _splits_like_qwen2(spec: dict[str, Any]) -> bool:
    """Whether `spec` normalizes and pre-tokenizes as Qwen2 (what _CUT relies on)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    splits = [p for p in steps if p.get("type") == "Split"]
    return (
        spec.get("normalizer") in (None, {"type": "NFC"})
        and len(splits) == 1
        and splits[0].get("pattern") == {"Regex": QWEN2_SPLIT_REGEX}
        and splits[0].get("behavior") == "Isolated"
    )


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: the printable stand-in for each byte -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _gpt2_byte_decoder()


def check_text(text: str, what: str = "input") -> str:
    """Refuse text that is not valid Unicode (e.g. lone surrogates from undecodable argv)."""
    if not isinstance(text, str):
        raise TokenizerError(f"{what} must be a string, got {type(text).__name__}")
    if text.isascii():  # known without a scan
        return text
    for start in range(0, len(text), SCAN_WINDOW):  # in windows: megabytes would hold the GIL
        try:
            text[start : start + SCAN_WINDOW].encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(
                f"{what} is not valid UTF-8 text (undecodable character at position "
                f"{start + exc.start})"
            ) from None
    return text


def _is_byte_level(decoder: dict[str, Any] | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_is_byte_level(d) for d in decoder.get("decoders", []))


class Tokenizer:
    """A byte-level BPE tokenizer with the Qwen2.5 special tokens and chat template."""

    def __init__(
        self,
        tokenizer_json: str,
        chat_template: str | None,
        special_tokens: dict[str, int],
        eos_token_ids: Sequence[int],
    ) -> None:
        try:
            spec = json.loads(tokenizer_json)
            self._full = tokenizers.Tokenizer.from_str(tokenizer_json)
            # Same model without added tokens: the "plain text" encoder that never emits them.
            self._plain = tokenizers.Tokenizer.from_str(json.dumps({**spec, "added_tokens": []}))
        except Exception as exc:  # tokenizers raises plain Exception on a bad JSON
            raise TokenizerError(f"the embedded tokenizer.json cannot be loaded: {exc}") from None
        if not _is_byte_level(spec.get("decoder")):
            raise TokenizerError("only byte-level BPE tokenizers (Qwen2.5's kind) are supported")
        # Ids as the loaded tokenizer assigned them (it renumbers added tokens whose JSON ids
        # leave a gap after the vocabulary), so encode and decode agree with each other.
        added = self._full.get_added_tokens_decoder()
        self._added = {t.content: i for i, t in added.items()}
        self._added_ids = {i: s.encode("utf-8") for s, i in self._added.items()}
        by_length = sorted(self._added, key=len, reverse=True)  # longest match first
        self._special_re = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        self._longest_special = len(by_length[0]) if by_length else 0
        # A token covers at most this many characters of normalized text (its bytes).
        self._max_token_chars = max(map(len, self._plain.get_vocab()), default=1)
        self._cuttable = _splits_like_qwen2(spec)
        self.special_tokens = dict(special_tokens)
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self.vocab_size = self._full.get_vocab_size(with_added_tokens=True)
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_spec(cls, spec: Any) -> Tokenizer:
        """From a `fileformat.TokenizerSpec`."""
        return cls(spec.tokenizer_json, spec.chat_template, spec.special_tokens, spec.eos_token_ids)

    @classmethod
    def from_file(cls, file: Any) -> Tokenizer:
        """From an open `fileformat.NanoqwenFile`; refuses a file packed without a tokenizer."""
        if file.tokenizer is None:
            raise TokenizerError(
                f"{getattr(file, 'path', 'the model file')} has no tokenizer; re-pack it from a "
                "source that carries one (a GGUF file, or an HF directory with tokenizer.json), "
                "e.g. `nanoqwen pack SOURCE OUT.nanoqwen`"
            )
        return cls.from_spec(file.tokenizer)

    # Encoding ----------------------------------------------------------------------------
    def encode(
        self, text: str, *, allow_special: bool = False, limit: int | None = None
    ) -> list[int]:
        """Token ids of `text` (no BOS). Special-token text stays text unless `allow_special`.
        More than `limit` ids: TooManyTokens."""
        check_text(text)
        return self._encode_segments([(text, allow_special)], limit)

    def _encode_segments(
        self, segments: Iterable[tuple[str, bool]], limit: int | None = None
    ) -> list[int]:
        """Encode (text, specials_allowed) pieces; adjacent plain text is encoded as one run."""
        ids: list[int] = []
        run: list[str] = []
        for text, allowed in segments:
            pos = 0
            while allowed and (m := self._find_special(text, pos)) is not None:
                run.append(text[pos : m.start()])
                ids += self._encode_plain("".join(run), limit, len(ids))
                ids.append(self._added[m.group()])
                if limit is not None and len(ids) > limit:
                    raise TooManyTokens(limit)
                run, pos = [], m.end()
            run.append(text[pos:])
        return ids + self._encode_plain("".join(run), limit, len(ids))

    def _find_special(self, text: str, pos: int) -> re.Match | None:
        if self._special_re is None:
            return None
        return _search(self._special_re, text, pos, self._longest_special)

    def _encode_plain(self, text: str, limit: int | None = None, used: int = 0) -> list[int]:
        """Ids of `text`, added tokens never matched. TooManyTokens if `used` + the ids pass
        `limit`, at most one CHUNK_CHARS chunk after they do (module docstring)."""
        if not text:
            return []
        if limit is None or not self._cuttable:
            ids = self._encode_run(text)
        elif len(text) > (limit - used) * NFC_MAX_MERGE * self._max_token_chars:
            raise TooManyTokens(limit)  # too many characters for so few tokens
        else:
            ids, pos = [], 0
            while pos < len(text) and used + len(ids) <= limit:
                cut = None
                if len(text) - pos > CHUNK_CHARS:
                    cut = _search(_CUT, text, pos + CHUNK_CHARS, 1)
                end = len(text) if cut is None else cut.start()
                ids += self._encode_run(text[pos:end])
                pos = end
        if limit is not None and used + len(ids) > limit:
            raise TooManyTokens(limit)
        return ids

    def _encode_run(self, text: str) -> list[int]:
        # encode_batch_fast releases the GIL while it encodes (encode holds it throughout).
        return self._plain.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def special_id(self, key: str) -> int:
        try:
            return self.special_tokens[key]
        except KeyError:
            raise TokenizerError(f"the tokenizer has no {key!r} special token") from None

    def fim_prompt(self, prefix: str, suffix: str, *, limit: int | None = None) -> list[int]:
        """`<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>`, built from the ids;
        prefix and suffix stay text. More than `limit` ids: TooManyTokens."""
        pre, suf, mid = (self.special_id(k) for k in FIM_KEYS)
        p = self._encode_plain(check_text(prefix, "FIM prefix"), limit, 3)
        s = self._encode_plain(check_text(suffix, "FIM suffix"), limit, 3 + len(p))
        return [pre, *p, suf, *s, mid]

    def repo_name(self, name: str) -> list[int]:
        """`<|repo_name|>{name}\\n`: opens Qwen2.5-Coder's repo-level prompt, which lists files
        (`repo_file`) and ends with the FIM prompt of the file being edited."""
        return [self.special_id("repo_name"), *self._encode_plain(check_text(name + "\n", "repo"))]

    def repo_file(self, path: str, text: str = "") -> list[int]:
        """`<|file_sep|>{path}\\n{text}`: one file of a repo-level prompt; the file being edited
        gets no text here (its FIM prompt follows)."""
        body = check_text(f"{path}\n{text}", f"file {path!r}")
        return [self.special_id("file_sep"), *self._encode_plain(body)]

    # Chat --------------------------------------------------------------------------------
    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions (reads a `tools` variable)."""
        if not self.chat_template:
            return False
        try:
            ast = _jinja_env().parse(self.chat_template)
        except jinja2.TemplateError:
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(ast)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text the embedded chat template makes of `messages` (and `tools`)."""
        messages = self._checked_messages(messages)
        return self._render(messages, add_generation_prompt, self._checked_tools(tools))

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        reply_prefix: str = "",
        limit: int | None = None,
    ) -> list[int]:
        """Token ids of a chat: template text may hold control tokens, message contents never.
        `tools`: the function definitions the template lists (OpenAI's {"type": "function",
        "function": {...}} objects); `reply_prefix`: text the assistant's reply starts with
        (after the generation prompt; the caller's own text, control tokens allowed: a forced
        tool call). More than `limit` ids: TooManyTokens.

        Each non-empty content is rendered as a unique placeholder and encoded as plain text.
        If the template transforms contents (so the placeholders do not reproduce the real
        rendering), the whole rendering is encoded with specials allowed, as Hugging Face does.
        """
        messages = self._checked_messages(messages)
        tools = self._checked_tools(tools)
        if reply_prefix and not add_generation_prompt:
            raise TokenizerError("a reply prefix follows the generation prompt")
        text = self._render(messages, add_generation_prompt, tools)
        nonce = secrets.token_hex(NONCE_BYTES)
        # An empty content stays empty: templates test it (an assistant turn of tool calls).
        masked = [
            {**m, "content": f"\ue000{nonce}:{i}\ue001"} if m["content"] else m
            for i, m in enumerate(messages)
        ]
        # parts: template text, then (nonce, index, template text) per placeholder.
        parts = _PLACEHOLDER.split(self._render(masked, add_generation_prompt, tools))
        segments = [(parts[0], True)]
        for found, index, after in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
            if found != nonce:  # template text that looks like a placeholder
                segments = [(text, True)]
                break
            segments += [(messages[int(index)]["content"], False), (after, True)]
        if "".join(s for s, _ in segments) != text:
            segments = [(text, True)]
        return self._encode_segments([*segments, (check_text(reply_prefix), True)], limit)

    def _checked_messages(self, messages: Any) -> list[dict[str, Any]]:
        """`validate_messages`, and no tool call holding control-token text (the template
        renders calls inside its own text)."""
        messages = validate_messages(messages)
        for i, m in enumerate(messages):
            for j, call in enumerate(m.get("tool_calls", ())):
                self._check_json(call, f"messages[{i}].tool_calls[{j}]", TokenizerError)
        return messages

    def _checked_tools(self, tools: Any) -> list[dict[str, Any]] | None:
        """`tools` as the template takes them (None when there are none), each a JSON object
        without control-token text."""
        if not tools:
            return None
        if not isinstance(tools, list | tuple):
            raise ToolsError("tools must be a list of JSON objects")
        if not self.supports_tools:
            raise ToolsError("this model's chat template has no tool support")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise ToolsError(f"tools[{i}] must be an object")
            self._check_json(tool, f"tools[{i}]", ToolsError)
        return list(tools)

    def _check_json(self, value: Any, what: str, error: type[TokenizerError]) -> None:
        """Refuse a value the template renders as JSON inside its own text: one that is not
        JSON or not valid Unicode, or that holds control-token text (which would be encoded
        as the control token)."""
        try:
            text = _tojson(value)
        except (TypeError, ValueError):  # not serializable; a circular reference
            raise error(f"{what} is not JSON") from None
        try:
            check_text(text, what)
        except TokenizerError as exc:
            raise error(str(exc)) from None
        if (m := self._find_special(text, 0)) is not None:
            raise error(f"{what} holds the control-token text {m.group()!r}")

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self.chat_template:
            raise TokenizerError("the model file has no chat template; use a raw prompt or FIM")
        inv = {v: k for k, v in self._added.items()}
        try:
            # Compiled once: compiling costs milliseconds a chat request (two renders each),
            # rendering tens of microseconds; a compiled template renders from any thread.
            if self._compiled_template is None:
                self._compiled_template = _jinja_env().from_string(self.chat_template)
            return self._compiled_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=inv.get(self.special_tokens.get("bos", -1), ""),
                eos_token=inv.get(self.eos_token_ids[0], "") if self.eos_token_ids else "",
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from None

    # Decoding ----------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (special tokens: their text)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added_ids:
            raw = self._added_ids[token_id]
        else:
            piece = self._full.id_to_token(token_id) or ""
            raw = bytes(_BYTE_DECODER[c] for c in piece if c in _BYTE_DECODER)
        self._bytes_cache[token_id] = raw
        return raw

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat: a non-empty list of {role: system|user|assistant|tool, content: str}; an
    assistant message may also carry `tool_calls`, a list of {name: str, arguments: object}
    (the calls it made, each answered by a later `tool` message).

    Returns copies holding only `role`, `content` and `tool_calls` where given (the template
    sees nothing else).
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise TokenizerError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TokenizerError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise TokenizerError(f"messages[{i}].role must be one of {', '.join(ROLES)}: {role!r}")
        if not isinstance(content, str):
            raise TokenizerError(f"messages[{i}].content must be a string")
        checked = {"role": role, "content": check_text(content, f"messages[{i}].content")}
        if m.get("tool_calls"):
            if role != "assistant":
                raise TokenizerError(f"messages[{i}]: only assistant messages make tool calls")
            checked["tool_calls"] = [
                _tool_call(call, f"messages[{i}].tool_calls[{j}]")
                for j, call in enumerate(m["tool_calls"])
            ]
        out.append(checked)
    return out


def _tool_call(call: Any, what: str) -> dict[str, Any]:
    if not (
        isinstance(call, dict)
        and isinstance(call.get("name"), str)
        and isinstance(call.get("arguments"), dict)
    ):
        raise TokenizerError(f"{what} must be an object {{name: string, arguments: object}}")
    return {"name": call["name"], "arguments": call["arguments"]}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The sandbox Hugging Face renders chat templates in (trim/lstrip blocks, tojson)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env


class IncrementalDetokenizer:
    """Token ids in, text deltas out; an incomplete UTF-8 sequence is held back.

    Bytes that can never become valid UTF-8 are emitted as U+FFFD at once; `finish()` flushes
    a trailing incomplete sequence the same way.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: Iterable[int]) -> str:
        raw = b"".join(self._tokenizer.token_bytes(i) for i in token_ids)
        return self._decoder.decode(raw)

    def feed_one(self, token_id: int) -> str:
        """`feed([token_id])` without the join: the per-token path of every stream."""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Cuts streamed text before the first user stop string to complete.

    `feed(text)` returns (safe_text, stopped). Text that might be the start of a stop string is
    held back until the next feed shows it is not; `finish()` releases it at the end.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        for s in stops:
            if not isinstance(s, str) or not s:
                raise TokenizerError(f"stop strings must be non-empty strings, got {s!r}")
            check_text(s, "stop string")
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:  # most requests: nothing to match or hold back
            return text, False
        if self.stopped:
            return "", True
        buf = self._held + text
        # The stop that completes first (then the longest of those): the same cut whatever
        # pieces the text arrives in.
        hits = [(i + len(s), i) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self._held, self.stopped = "", True
            return buf[: min(hits)[1]], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    def finish(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
