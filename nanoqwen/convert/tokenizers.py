"""Tokenizer sections for .nanoqwen files: from an HF directory, from GGUF metadata, or a small
byte-level one for synthetic models.

Every source ends as a `fileformat.TokenizerSpec`: a Hugging Face `tokenizers` JSON document
(byte-level BPE, the Qwen2 pre-tokenizer), the ChatML template, the special-token ids keyed as in
docs/DESIGN.md, and the ids generation stops on. GGUF files carry the vocabulary as token
strings + merges + token types (1 normal, 3 control, 4 user-defined, 5 unused padding); we
rebuild the tokenizer.json that Qwen2.5 ships: NFC, a regex Split, ByteLevel without its own
regex, a ByteLevel decoder, and the control/user-defined tokens as added tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConvertError
from ..fileformat import TokenizerSpec

# The Qwen2 pre-tokenizer split (tokenizer.json of Qwen2.5 and llama.cpp's "qwen2" pre).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5's 22 added tokens at their real ids; True = "special" (a control token).
QWEN25_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (151643 + i, text, special)
    for i, (text, special) in enumerate(
        [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True)]
        + [(f"<|{t}|>", True) for t in ("object_ref_start", "object_ref_end", "box_start")]
        + [(f"<|{t}|>", True) for t in ("box_end", "quad_start", "quad_end", "vision_start")]
        + [(f"<|{t}|>", True) for t in ("vision_end", "vision_pad", "image_pad", "video_pad")]
        + [("<tool_call>", False), ("</tool_call>", False)]
        + [(f"<|{t}|>", True) for t in ("fim_prefix", "fim_middle", "fim_suffix", "fim_pad")]
        + [("<|repo_name|>", True), ("<|file_sep|>", True)]
    )
)

# docs/DESIGN.md special_tokens keys -> token text (bos and pad are <|endoftext|> in Qwen2.5).
SPECIAL_KEYS: dict[str, str] = {
    "bos": "<|endoftext|>",
    "pad": "<|endoftext|>",
    "endoftext": "<|endoftext|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "fim_prefix": "<|fim_prefix|>",
    "fim_middle": "<|fim_middle|>",
    "fim_suffix": "<|fim_suffix|>",
    "fim_pad": "<|fim_pad|>",
    "repo_name": "<|repo_name|>",
    "file_sep": "<|file_sep|>",
}

# A ChatML template for synthetic models, in Qwen2.5's format: its default system prompt, and
# with `tools` its "# Tools" system section, assistant calls as <tool_call> blocks and tool
# answers as <tool_response> blocks in a user turn (nanoqwen.tool_calls).
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\' }}'
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or loop_messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop_messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' "
    "+ (call['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _byte_level(**extra) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, **extra}


def bpe_tokenizer_json(
    vocab: dict[str, int], merges: list[str], added: list[tuple[int, str, bool]], where: str
) -> str:
    """A Qwen2-style byte-level BPE tokenizer.json.

    vocab: byte-level token string -> id (regular tokens only), ids exactly 0..len-1;
    merges: "left right" strings in rank order; added: (id, text, special) tokens matched
    before BPE, ids following the vocabulary without gaps (`tokenizers` numbers added tokens
    from the vocabulary size on, whatever ids the JSON states).
    """
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ConvertError(f"{where}: regular token ids are not exactly 0..{len(vocab) - 1}")
    added = sorted(added)
    ids = [token_id for token_id, _, _ in added]
    if ids != list(range(len(vocab), len(vocab) + len(added))):
        raise ConvertError(
            f"{where}: added token ids {ids[:3]}... do not follow the {len(vocab)} regular tokens"
        )
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for i, text, special in added
        ],  # fmt: skip
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN2_SPLIT_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                _byte_level(use_regex=False),
            ],
        },  # fmt: skip
        "post_processor": _byte_level(use_regex=False),
        "decoder": _byte_level(use_regex=False),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },  # fmt: skip
    }
    return json.dumps(doc, ensure_ascii=False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by ByteLevel."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_level_spec() -> TokenizerSpec:
    """A small tokenizer for synthetic models: 256 byte tokens (ids 0..255), the merge
    "Ġ Ġ" (two spaces, id 256), and the 22 Qwen2.5 specials at their real ids.

    Ids 257..151642 are placeholders "[id]" that no merge produces: encoding never yields them,
    decoding shows them (a random model generates any id).
    """
    chars = _bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    vocab["ĠĠ"] = 256
    first_added = QWEN25_ADDED_TOKENS[0][0]
    vocab |= {f"[{i}]": i for i in range(257, first_added)}
    text = bpe_tokenizer_json(vocab, ["Ġ Ġ"], list(QWEN25_ADDED_TOKENS), "byte-level tokenizer")
    return make_spec(text, CHATML_TEMPLATE, "synthetic byte-level tokenizer")


def make_spec(
    tokenizer_json: str, chat_template: str | None, where: str, eos_ids: tuple[int, ...] = ()
) -> TokenizerSpec:
    """Validate `tokenizer_json` with `tokenizers` and find the special ids by their text.

    eos_token_ids: `eos_ids` if given, else (im_end, endoftext).
    """
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise ConvertError(f"{where}: tokenizer does not load: {exc}") from None
    special: dict[str, int] = {}
    for key, text in SPECIAL_KEYS.items():
        token_id = tok.token_to_id(text)
        if token_id is None:
            raise ConvertError(f"{where}: tokenizer lacks the special token {text}")
        special[key] = token_id
    eos = tuple(eos_ids) or (special["im_end"], special["endoftext"])
    return TokenizerSpec(tokenizer_json, chat_template, special, eos)


def spec_from_gguf_fields(fields: dict, where: str) -> TokenizerSpec:
    """GGUF tokenizer metadata (already decoded to Python values) -> TokenizerSpec.

    fields: key -> value for tokenizer.ggml.{model, pre, tokens, merges, token_type,
    eos_token_id} and optionally tokenizer.chat_template.
    """
    model, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre not in ("qwen2", None):
        raise ConvertError(
            f"{where}: tokenizer {model!r}/{pre!r} is not the Qwen2 byte-level BPE (gpt2/qwen2)"
        )
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or []
    if len(tokens) != len(types):
        raise ConvertError(f"{where}: {len(tokens)} tokens but {len(types)} token types")
    vocab, added = {}, []
    for token_id, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == 1:
            vocab[text] = token_id
        elif kind in (3, 4):
            added.append((token_id, text, kind == 3))
    merges = list(fields.get("tokenizer.ggml.merges") or [])
    text = bpe_tokenizer_json(vocab, merges, added, where)
    eos = fields.get("tokenizer.ggml.eos_token_id")
    spec = make_spec(text, fields.get("tokenizer.chat_template"), where)
    if eos is not None and eos not in spec.eos_token_ids:
        spec = TokenizerSpec(text, spec.chat_template, spec.special_tokens, (eos,))
    return spec


def spec_from_hf_dir(directory: Path) -> TokenizerSpec:
    """tokenizer.json + tokenizer_config.json (chat_template) + generation_config.json
    (eos_token_id, when present) -> TokenizerSpec."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ConvertError(f"{directory}: no tokenizer.json (pass --no-tokenizer to pack without)")
    cfg = _read_json(directory / "tokenizer_config.json") or {}
    eos = (_read_json(directory / "generation_config.json") or {}).get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
    text = path.read_text(encoding="utf-8")
    return make_spec(text, cfg.get("chat_template"), str(path), eos_ids)


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{path}: invalid JSON: {exc}") from None
