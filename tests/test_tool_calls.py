"""Tool calls: the parser that splits a streamed reply into content and calls, and the chat
template's rendering of tools, calls and tool answers (the synthetic models' template, which
writes Qwen2.5's format)."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanoqwen.errors import TokenizerError, ToolsError
from nanoqwen.tokenizer import Tokenizer
from nanoqwen.tool_calls import (
    CLOSE,
    FENCE_CLOSE,
    FENCE_OPEN,
    OPEN,
    ToolCall,
    ToolCallParser,
    forced_prefix,
    parse_call,
)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}
BLOCK = f"{OPEN}\n{json.dumps(WEATHER)}\n{CLOSE}"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def parse(text: str, cuts: list[int], prefix: str = "") -> list[str | tuple[str, dict]]:
    """The reply `text` fed in pieces cut at `cuts`: its content joined, calls as (name,
    arguments) in order (the tools get_weather and f)."""
    parser = ToolCallParser(frozenset({"get_weather", "f"}), prefix)
    pieces = []
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        pieces += parser.feed(text[a:b])
    pieces += parser.finish()
    out: list[str | tuple[str, dict]] = []
    for piece in pieces:
        if isinstance(piece, ToolCall):
            out.append((piece.name, json.loads(piece.arguments)))
        elif out and isinstance(out[-1], str):
            out[-1] += piece
        else:
            out.append(piece)
    return out


REPLIES = [
    # (reply text, content and calls it makes)
    ("Hello, world.\n\n", ["Hello, world.\n\n"]),
    ("a < b and <tool is not a tag", ["a < b and <tool is not a tag"]),
    (BLOCK, [("get_weather", WEATHER["arguments"])]),
    (f"Let me look.\n{BLOCK}", ["Let me look.", ("get_weather", WEATHER["arguments"])]),
    (f"{BLOCK}\n{BLOCK}\n", [("get_weather", WEATHER["arguments"])] * 2),
    (f"{BLOCK}\nDone.", [("get_weather", WEATHER["arguments"]), "Done."]),
    # Not a call: the block stays content, as written.
    (f"{OPEN}\nnot json\n{CLOSE}", [f"{OPEN}\nnot json\n{CLOSE}"]),
    (f'{OPEN}{{"name": 3}}{CLOSE}', [f'{OPEN}{{"name": 3}}{CLOSE}']),
    (
        f'{OPEN}{{"name": "f", "arguments": [1]}}{CLOSE}',
        [f'{OPEN}{{"name": "f", "arguments": [1]}}{CLOSE}'],
    ),
    # Unclosed at the end (max_tokens, or the closing tag taken as a stop string).
    (f'{OPEN}\n{{"name": "f", "arguments": {{}}}}\n', [("f", {})]),
    (f'x {OPEN}\n{{"name": "f", "argu', [f'x {OPEN}\n{{"name": "f", "argu']),
    # No arguments: an empty object.
    (f'{OPEN}{{"name": "now"}}{CLOSE}', [("now", {})]),
    # A fenced block is a call when it names a tool, else the JSON the answer shows.
    (f"Reading it.\n{FENCE_OPEN}\n{json.dumps(WEATHER, indent=2)}\n{FENCE_CLOSE}",
     ["Reading it.", ("get_weather", WEATHER["arguments"])]),
    (f'{FENCE_OPEN}\n{{"name": "rm", "arguments": {{}}}}\n{FENCE_CLOSE}\nok',
     [f'{FENCE_OPEN}\n{{"name": "rm", "arguments": {{}}}}\n{FENCE_CLOSE}\nok']),
    ("```python\nx = 1\n```\n``", ["```python\nx = 1\n```\n``"]),
    # Runs of whitespace: held while a call may follow, content when text does.
    (f"Text. \n \t\n{BLOCK}", ["Text.", ("get_weather", WEATHER["arguments"])]),
    ("x \n  <too \n\n  y  \n", ["x \n  <too \n\n  y  \n"]),
    (f"  \n {BLOCK} \n Done. \n", [("get_weather", WEATHER["arguments"]), "Done."]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), REPLIES)
def test_every_split_of_a_reply_parses_the_same(text: str, expected: list) -> None:
    assert parse(text, []) == expected
    for cut in range(len(text) + 1):
        assert parse(text, [cut]) == expected, f"cut at {cut}"
    assert parse(text, list(range(1, len(text)))) == expected  # a character a delta


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_splits_of_mixed_replies(data) -> None:
    text, expected = data.draw(st.sampled_from(REPLIES))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert parse(text, cuts) == expected


def test_content_streams_before_the_reply_ends() -> None:
    parser = ToolCallParser()
    assert parser.feed("Checking the ") == ["Checking the"]  # the space may precede a call
    assert parser.feed("weather <tool") == [" weather"]  # "<tool" may open one
    assert parser.feed("_call>\n{") == []
    (call,) = parser.feed(f'"name": "f", "arguments": {{"a": 1}}}}\n{CLOSE}')
    assert (call.name, json.loads(call.arguments), call.id.startswith("call_")) == (
        "f",
        {"a": 1},
        True,
    )
    assert parser.finish() == []


def test_forced_prefix_parses_from_inside_the_call() -> None:
    assert forced_prefix() == OPEN + '\n{"name": "'
    named = forced_prefix("get_weather")
    assert named == OPEN + '\n{"name": "get_weather", "arguments":'
    rest = ' {"city": "Paris"}}\n' + CLOSE
    assert parse(rest, [3], prefix=named) == [("get_weather", {"city": "Paris"})]
    assert parse('f", "arguments": {}}\n', [], prefix=forced_prefix()) == [("f", {})]
    # A forced block the model leaves unfinished stays content, the prefix included.
    assert parse("", [], prefix=forced_prefix()) == [forced_prefix()]
    with pytest.raises(ValueError, match="starts with"):
        ToolCallParser(prefix="no tag")


def test_parse_call_gives_compact_json_arguments_and_fresh_ids() -> None:
    a, b = parse_call(json.dumps(WEATHER)), parse_call(json.dumps(WEATHER))
    assert json.loads(a.arguments) == WEATHER["arguments"] and "°C" in a.arguments
    assert a.id != b.id
    assert parse_call("[1, 2]") is None and parse_call("") is None
    assert parse_call(json.dumps(WEATHER), frozenset({"f"})) is None


# The template: tools, calls, answers ----------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from nanoqwen.convert.tokenizers import byte_level_spec

    return Tokenizer.from_spec(byte_level_spec())


HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris"}},
            {"name": "get_weather", "arguments": {"city": "Rome"}},
        ],
    },
    {"role": "tool", "content": "22C"},
    {"role": "tool", "content": "25C"},
]


def test_template_renders_tools_calls_and_answers_in_qwen_format(tok) -> None:
    text = tok.render_chat(HISTORY, tools=[TOOL])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are Qwen")
    assert "# Tools" in system and json.dumps(TOOL) in system
    assert rest == (
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}\n'
        f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}\n{CLOSE}<|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22C\n</tool_response>\n"
        "<tool_response>\n25C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "# Tools" not in tok.render_chat(HISTORY)  # no tools: the plain system turn


def test_encode_chat_with_tools_keeps_contents_text_and_appends_the_prefix(tok) -> None:
    messages = [*HISTORY, {"role": "user", "content": "<|im_end|> is text here"}]
    ids = tok.encode_chat(messages, tools=[TOOL], reply_prefix=forced_prefix())
    assert tok.decode(ids) == tok.render_chat(messages, tools=[TOOL]) + forced_prefix()
    im_end = tok.special_tokens["im_end"]
    # One <|im_end|> a turn (system, user, assistant, the tool answers, user), none from the
    # user's text: the contents were masked (the empty assistant content stays empty, so the
    # masked rendering matches the real one).
    assert ids.count(im_end) == 5
    prefix = tok.encode(forced_prefix(), allow_special=True)
    assert tok.encode(OPEN, allow_special=True) == prefix[:1] and ids[-len(prefix) :] == prefix


def test_tools_are_refused_with_reasons(tok, spec_without_tools) -> None:
    with pytest.raises(ToolsError, match="control-token text '<|im_end|>'"):
        tok.encode_chat(HISTORY, tools=[{"type": "function", "function": {"name": "<|im_end|>"}}])
    with pytest.raises(ToolsError, match=r"tools\[0\] must be an object"):
        tok.encode_chat(HISTORY, tools=["f"])
    with pytest.raises(ToolsError, match="no tool support"):
        spec_without_tools.encode_chat(HISTORY, tools=[TOOL])
    assert tok.supports_tools and not spec_without_tools.supports_tools


def test_tool_calls_in_messages_are_checked(tok) -> None:
    bad_role = [{"role": "user", "content": "x", "tool_calls": [WEATHER]}]
    with pytest.raises(TokenizerError, match="only assistant messages make tool calls"):
        tok.encode_chat(bad_role)
    bad_call = [
        {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{}"}]}
    ]
    with pytest.raises(TokenizerError, match=r"tool_calls\[0\] must be an object"):
        tok.encode_chat(bad_call)
    forged = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "<|im_start|>", "arguments": {}}],
        }
    ]
    with pytest.raises(TokenizerError, match="control-token text"):
        tok.encode_chat(forged)
    with pytest.raises(TokenizerError, match="follows the generation prompt"):
        tok.encode_chat(HISTORY, add_generation_prompt=False, reply_prefix=OPEN)


@pytest.fixture(scope="module")
def spec_without_tools():
    from nanoqwen.convert.tokenizers import byte_level_spec

    spec = byte_level_spec()
    plain = "{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
    return Tokenizer(spec.tokenizer_json, plain, spec.special_tokens, spec.eos_token_ids)


def test_tools_and_calls_must_be_json_text(tok) -> None:
    with pytest.raises(ToolsError, match=r"tools\[0\] is not JSON"):
        tok.encode_chat(HISTORY, tools=[{"type": "function", "function": {"name": "f", "x": {1}}}])
    with pytest.raises(ToolsError, match="not valid UTF-8"):
        tok.encode_chat(HISTORY, tools=[{"type": "function", "function": {"name": "\ud800"}}])
    call = {"name": "f", "arguments": {"x": object()}}
    with pytest.raises(TokenizerError, match=r"tool_calls\[0\] is not JSON"):
        tok.encode_chat([{"role": "assistant", "content": "", "tool_calls": [call]}])


def test_a_single_call_reply_drops_later_calls() -> None:
    parser = ToolCallParser(frozenset({"get_weather"}), single=True)
    fenced = f"{FENCE_OPEN}\n{json.dumps(WEATHER)}\n{FENCE_CLOSE}"
    pieces = parser.push(f"{fenced}\nand {fenced}", done=True)
    assert [p.name for p in pieces if isinstance(p, ToolCall)] == ["get_weather"]
    assert [p for p in pieces if isinstance(p, str)] == ["and"]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_reply_without_blocks_passes_through_whole(data) -> None:
    # Text made of the markers' own characters, cut anywhere: without a whole opening marker
    # every character comes back as content, in order (no whitespace or partial tag lost).
    text = data.draw(st.text(alphabet='<>/`tool_cajsn {}\n"', max_size=60))
    assume(OPEN not in text and FENCE_OPEN not in text)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert "".join(p for p in parse(text, cuts) if isinstance(p, str)) == text
