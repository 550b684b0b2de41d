"""Reasoning and tool-call extraction on crafted completions (no model needed)."""

import json
import re
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.detokenizer import Detokenizer
from batchgen.io.parsers import (
    ParsedMessage,
    count_reasoning_tokens,
    parse_output,
    parse_reasoning,
    parse_tool_calls,
    reasoning_style_for,
    tool_parser_for,
)

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_BEGIN, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def ds_v3_call(name: str, args: dict) -> str:
    return f"{DS_BEGIN}function{DS_SEP}{name}\n```json\n{json.dumps(args)}\n```{DS_END}"


def fn(call: dict) -> tuple[str, dict]:
    """(name, decoded arguments) of an OpenAI tool call, after checking its shape."""
    assert call["type"] == "function"
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert isinstance(call["function"]["arguments"], str)
    return call["function"]["name"], json.loads(call["function"]["arguments"])


# --------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize(
    "style, text, expected",
    [
        # deepseek_r1: the prompt opened <think>, the output only closes it
        (
            "deepseek_r1",
            "Let me think.\n</think>\n\nThe answer is 4.",
            ("Let me think.", "The answer is 4."),
        ),
        ("deepseek_r1", "<think>\nhmm\n</think>\nDone", ("hmm", "Done")),
        (
            "deepseek_r1",
            "still thinking when max_tokens hit",
            ("still thinking when max_tokens hit", None),
        ),
        ("deepseek_r1", "<think>\ncut off", ("cut off", None)),
        ("deepseek_r1", "", (None, None)),
        ("deepseek_r1", "</think>answer only", (None, "answer only")),
        # qwen3: the model opens the block itself
        ("qwen3", "<think>\nreason\n</think>\n\nanswer", ("reason", "answer")),
        ("qwen3", "<think>\n\n</think>\n\nno thinking", (None, "no thinking")),
        ("qwen3", "plain answer, thinking off", (None, "plain answer, thinking off")),
        ("qwen3", "<think>\nunterminated", ("unterminated", None)),
        ("qwen3", "opened in prompt\n</think>\n\nanswer", ("opened in prompt", "answer")),
        ("qwen3", "<think>a</think>b</think>c", ("a", "b</think>c")),
        ("think", "<think>x</think>", ("x", None)),
    ],
)
def test_think_styles(style, text, expected):
    assert parse_reasoning(text, style) == expected


def test_think_keeps_text_written_before_the_block():
    assert parse_reasoning("Sure. <think>r</think> ok", "qwen3") == ("r", "Sure.  ok")


HARMONY = (
    "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2+2 = 4.<|return|>"
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (HARMONY, ("User asks 2+2. Easy.", "2+2 = 4.")),
        (HARMONY.replace("<|return|>", ""), ("User asks 2+2. Easy.", "2+2 = 4.")),
        (HARMONY.replace("<|return|>", "<|end|>"), ("User asks 2+2. Easy.", "2+2 = 4.")),
        (
            "<|channel|>analysis<|message|>thinking and then max_tokens",
            ("thinking and then max_tokens", None),
        ),
        ("<|channel|>final<|message|>just the answer<|return|>", (None, "just the answer")),
        ("no harmony markup at all", (None, "no harmony markup at all")),
        (
            (
                "<|channel|>analysis<|message|>a<|end|>"
                "<|start|>assistant<|channel|>analysis<|message|>b<|end|>"
                "<|start|>assistant<|channel|>final<|message|>c"
            ),
            ("a\n\nb", "c"),
        ),
        # a header cut off before <|message|> contributes nothing
        ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", ("a", None)),
    ],
)
def test_harmony_reasoning(text, expected):
    assert parse_reasoning(text, "harmony") == expected


def test_unknown_style_is_a_caller_error():
    with pytest.raises(ValueError, match="unknown reasoning style"):
        parse_reasoning("x", "o1")


@pytest.mark.parametrize(
    "model_type, style, parser",
    [
        ("deepseek_v3", "deepseek_r1", "deepseek_v3"),
        ("DeepseekV3ForCausalLM", "deepseek_r1", "deepseek_v3"),
        ("qwen3", "qwen3", "hermes"),
        ("qwen3_moe", "qwen3", "hermes"),
        ("qwen2", "think", "hermes"),
        ("gpt_oss", "harmony", "harmony"),
        ("llama", "think", "llama3_json"),
        ("LlamaForCausalLM", "think", "llama3_json"),
        ("mistral", "think", None),
    ],
)
def test_pick_style_and_parser(model_type, style, parser):
    assert reasoning_style_for(model_type) == style
    assert tool_parser_for(model_type) == parser


def test_overrides():
    assert tool_parser_for("llama", override="hermes") == "hermes"
    assert tool_parser_for("qwen3", override="none") is None
    assert reasoning_style_for("qwen3", override="deepseek_r1") == "deepseek_r1"
    with pytest.raises(ValueError, match="choose one of"):
        tool_parser_for("qwen3", override="hermess")


class CharTokenizer:
    """One token per character, plus single-token think tags, like Qwen3's vocabulary."""

    special: ClassVar[dict[str, int]] = {"<think>": 1000, "</think>": 1001}

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in self.special if text.startswith(t, i)), None)
            ids.append(self.special[tag] if tag else ord(text[i]))
            i += len(tag) if tag else 1
        return ids

    def decode(self, ids, skip_special_tokens=False):
        inverse = {v: k for k, v in self.special.items()}
        return "".join(inverse.get(i, chr(i)) for i in ids)


def test_count_reasoning_tokens_uses_the_close_tag_position():
    tok = CharTokenizer()
    detok = Detokenizer(tok)
    ids = tok.encode("<think>abc</think>hello")
    assert count_reasoning_tokens(ids, detok, "qwen3") == 5  # <think> a b c </think>
    assert count_reasoning_tokens(tok.encode("<think>abcdef"), detok, "qwen3") == 7  # unterminated
    assert count_reasoning_tokens(tok.encode("hello"), detok, "qwen3") == 0
    assert count_reasoning_tokens(tok.encode("xy</think>z"), detok, "deepseek_r1") == 3


def test_count_reasoning_tokens_retokenizes_harmony():
    class Chars(CharTokenizer):
        special: ClassVar[dict[str, int]] = {}

    tok = Chars()
    assert count_reasoning_tokens(tok.encode(HARMONY), Detokenizer(tok), "harmony") == len(
        "User asks 2+2. Easy."
    )


# --------------------------------------------------------------------------- hermes


def test_hermes_several_calls_with_nested_arguments():
    args1 = {"location": "Paris", "opts": {"units": ["C", "F"], "deep": {"x": [1, {"y": None}]}}}
    text = (
        "I'll check both.\n"
        f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': args1})}\n</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "I'll check both."
    assert [fn(c) for c in calls] == [("get_weather", args1), ("get_time", {"tz": "Europe/Paris"})]
    assert calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls(text, "hermes") == (content, calls)  # ids are deterministic


def test_hermes_edge_cases():
    # last call missing </tool_call> but with complete JSON (stop token right after it)
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}', "hermes")
    assert content is None and [fn(c) for c in calls] == [("f", {"a": 1})]
    # arguments given as a JSON string, or missing
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', "hermes"
    )
    assert fn(calls[0]) == ("f", {"a": 2})
    _, calls = parse_tool_calls('<tool_call>{"name": "ping"}</tool_call>', "hermes")
    assert fn(calls[0]) == ("ping", {})
    # no markup: text unchanged, including whitespace
    assert parse_tool_calls("  just text\n", "hermes") == ("  just text\n", [])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>',  # bad JSON
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>["f"]</tool_call>',
        # cut off inside the second call
        'ok <tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "argu',
        "<tool_call>",
    ],
)
def test_hermes_malformed_keeps_whole_text(text):
    assert parse_tool_calls(text, "hermes") == (text, [])


# --------------------------------------------------------------------------- deepseek


def test_deepseek_v3_calls():
    args = {"city": "Paris", "nested": {"list": [1, 2, {"k": "v"}]}}
    text = (
        "Let me look.\n"
        + DS_CALLS_BEGIN
        + ds_v3_call("get_weather", args)
        + "\n"
        + ds_v3_call("get_time", {})
        + DS_CALLS_END
    )
    content, calls = parse_tool_calls(text, "deepseek_v3")
    assert content == "Let me look."
    assert [fn(c) for c in calls] == [("get_weather", args), ("get_time", {})]


def test_deepseek_v31_calls_without_fence():
    text = (
        f'{DS_CALLS_BEGIN}{DS_BEGIN}search{DS_SEP}{{"q": "a ``` b", "n": {{"m": 1}}}}{DS_END}'
        f'{DS_BEGIN}open{DS_SEP}{{"id": 3}}{DS_END}{DS_CALLS_END}'
    )
    content, calls = parse_tool_calls(text, "deepseek_v3")
    assert content is None
    assert [fn(c) for c in calls] == [
        ("search", {"q": "a ``` b", "n": {"m": 1}}),
        ("open", {"id": 3}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        DS_CALLS_BEGIN + ds_v3_call("f", {"a": 1})[: -len(DS_END)],  # cut off inside a call
        DS_CALLS_BEGIN
        + f"{DS_BEGIN}function{DS_SEP}f\n```json\n{{bad}}\n```{DS_END}{DS_CALLS_END}",
        DS_CALLS_BEGIN + f"{DS_BEGIN}function{DS_SEP}\n```json\n{{}}\n```{DS_END}{DS_CALLS_END}",
        DS_CALLS_BEGIN,
    ],
)
def test_deepseek_malformed_keeps_whole_text(text):
    assert parse_tool_calls(text, "deepseek_v3") == (text, [])


def test_r1_thinking_then_deepseek_calls():
    text = (
        "I should call the tool.\n</think>\n\n"
        + DS_CALLS_BEGIN
        + ds_v3_call("f", {"x": 1})
        + DS_CALLS_END
    )
    parsed = parse_output(text, reasoning_style="deepseek_r1", tool_parser="deepseek_v3")
    assert parsed.reasoning == "I should call the tool."
    assert parsed.content is None
    assert [fn(c) for c in parsed.tool_calls] == [("f", {"x": 1})]


# --------------------------------------------------------------------------- llama 3


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "o": {"u": [1]}}}'


@pytest.mark.parametrize(
    "text, prefix",
    [
        (LLAMA_CALL, None),
        ("<|python_tag|>" + LLAMA_CALL, None),
        ("Checking.<|python_tag|>" + LLAMA_CALL.replace("parameters", "arguments"), "Checking."),
    ],
)
def test_llama3_single_call(text, prefix):
    content, calls = parse_tool_calls(text, "llama3_json")
    assert content == prefix
    assert [fn(c) for c in calls] == [("get_weather", {"city": "Paris", "o": {"u": [1]}})]


def test_llama3_several_calls():
    text = (
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "; {"}};'
    )
    content, calls = parse_tool_calls(text, "llama3_json")
    assert content is None
    assert [fn(c) for c in calls] == [("a", {}), ("b", {"x": "; {"})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",  # prose: no calls, not an error
        '{"answer": 42}',  # JSON but not a call (e.g. a JSON-mode answer)
        '{"name": "a", "parameters": {}} and then prose',
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {',
        '<|python_tag|>brave_search.call(query="x")',  # built-in tool syntax is not JSON
    ],
)
def test_llama3_non_calls_keep_whole_text(text):
    assert parse_tool_calls(text, "llama3_json") == (text, [])


# --------------------------------------------------------------------------- harmony tools


def test_harmony_tool_call_and_preamble():
    text = (
        "<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location": "Paris", "x": {"y": [1]}}<|call|>'
    )
    parsed = parse_output(text, reasoning_style="harmony", tool_parser="harmony")
    assert parsed.reasoning == "Need weather."
    assert parsed.content == "Checking the weather."
    assert [fn(c) for c in parsed.tool_calls] == [
        ("get_weather", {"location": "Paris", "x": {"y": [1]}})
    ]


def test_harmony_recipient_before_channel_and_malformed_body():
    ok = "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>"
    assert [fn(c) for c in parse_tool_calls(ok, "harmony")[1]] == [("f", {})]
    bad = '<|channel|>commentary to=functions.f<|message|>{"a": <|call|>'
    assert parse_output(bad, reasoning_style="harmony", tool_parser="harmony").content == bad


# --------------------------------------------------------------------------- parse_output


def test_parse_output_thinking_first_then_tools():
    text = (
        '<think>maybe <tool_call>{"name": "ignored", "arguments": {}}</tool_call></think>\n\n'
        'Calling.\n<tool_call>{"name": "real", "arguments": {"a": [1, 2]}}</tool_call>'
    )
    parsed = parse_output(text, reasoning_style="qwen3", tool_parser="hermes")
    assert parsed.reasoning.startswith("maybe")
    assert parsed.content == "Calling."
    assert [fn(c) for c in parsed.tool_calls] == [("real", {"a": [1, 2]})]


def test_parse_output_defaults_and_unterminated_thinking():
    assert parse_output("  raw  ") == ParsedMessage(content="  raw  ")
    parsed = parse_output(
        '<think>about to call <tool_call>{"name"', reasoning_style="qwen3", tool_parser="hermes"
    )
    assert parsed == ParsedMessage(content=None, reasoning='about to call <tool_call>{"name"')


# --------------------------------------------------------------------------- never raises


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "<think>",
                "</think>",
                "<tool_call>",
                "</tool_call>",
                DS_CALLS_BEGIN,
                DS_BEGIN,
                DS_SEP,
                DS_END,
                DS_CALLS_END,
                "<|python_tag|>",
                "<|channel|>",
                "<|message|>",
                "<|end|>",
                "<|start|>",
                "to=functions.f",
                "analysis",
                "final",
                '{"name": "f"',
                ', "arguments": {}}',
                "\n```json\n",
                "```",
                ";",
                "{",
                "}",
                " ",
                "text",
            ]
        ),
        max_size=12,
    ).map("".join)
)
def test_never_raises_on_arbitrary_markup(text):
    for style in ("deepseek_r1", "qwen3", "think", "harmony"):
        for parser in ("hermes", "deepseek_v3", "llama3_json", "harmony"):
            parsed = parse_output(text, reasoning_style=style, tool_parser=parser)
            for call in parsed.tool_calls:
                fn(call)


# --------------------------------------------------------------------------- hostile outputs

DEEP = "[" * 1000 + "]" * 1000


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": ' + DEEP + '}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": ' + DEEP + '}}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"y": 1e999}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "\\ud83d"}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "\\udc00", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "Alice", "age": 30}'),  # a JSON answer, not a call
])
def test_what_strict_json_cannot_carry_stays_content(parser, text):
    """Nesting past Python's stack, NaN / Infinity, lone surrogates (orjson refuses them when
    the result line is written) and JSON without arguments: the text stays the answer."""
    from batchgen.io.results import dumps

    content, calls = parse_tool_calls(text, parser)
    assert content == text and calls == []
    dumps({"content": content})


def test_llama3_json_calls_need_their_arguments_key():
    content, calls = parse_tool_calls('{"name": "f", "parameters": {}}', "llama3_json")
    assert content is None and [fn(c) for c in calls] == [("f", {})]


@pytest.mark.parametrize("style", ["deepseek_r1", "qwen3"])
def test_tags_in_the_answer_after_a_prompt_opened_block_stay_in_the_answer(style):
    text = "Reasoning R.</think>\n\nThe tags <think> and </think> wrap thoughts. <think>B"
    assert parse_reasoning(text, style) == (
        "Reasoning R.", "The tags <think> and </think> wrap thoughts. <think>B")
