"""What reasoning and tool-using chat models need around their answers: where a think block
starts (the prompt may open or close it), answers a grammar wrote, harmony answers without a
call, and earlier tool calls rendered back through the chat template."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from batchgen.config import OutputConfig
from batchgen.core import Completion, FinishedRequest, FinishReason, SamplingParams
from batchgen.io.intake import PendingRequest
from batchgen.io.parsers import parse_output
from batchgen.io.templates import render_chat

USER = [{"role": "user", "content": "What is the weather in Zürich?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
DS_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


@pytest.fixture(scope="module")
def tokenizer():
    from tiny_models import embedded_tokenizer

    return embedded_tokenizer()


def answer(tokenizer, model_type, text, extra=None, prompt="<|im_start|>assistant\n", **out):
    """choices[0] and usage of the result line of a chat answer `text` to a prompt ending with
    `prompt`."""
    from batchgen.runner.worker.outputs import OutputFormatter

    loaded = SimpleNamespace(tokenizer=tokenizer, name="m",
                             hf_config=SimpleNamespace(model_type=model_type))
    spec = SimpleNamespace(config=SimpleNamespace(output=OutputConfig(**out)), batch_id="b",
                           created=1, system_fingerprint=None)
    prompt_ids = tokenizer.encode("Hi" + prompt, add_special_tokens=False)
    pending = PendingRequest("c1", 1, "chat", USER, None, SamplingParams(max_tokens=64),
                             extra or {}, prompt_ids)
    ids = tokenizer.encode(text, add_special_tokens=False)
    body = OutputFormatter(spec, loaded).success(pending, FinishedRequest(
        "c1", len(prompt_ids), [Completion(0, ids, FinishReason.STOP, text=text)]))
    body = body["response"]["body"]
    return body["choices"][0], body["usage"]


@pytest.mark.parametrize("extra, text", [
    ({"tools": [WEATHER], "tool_choice": "required"}, DS_CALL),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object"}}}}, '{"answer": 42}'),
])
def test_an_answer_a_grammar_wrote_holds_no_reasoning(tokenizer, extra, text):
    """DeepSeek-R1 (reasoning style deepseek_r1: a text without </think> is all reasoning): a
    forced call or a JSON response_format is the answer from its first token, never reasoning."""
    choice, usage = answer(tokenizer, "deepseek_v3", text, extra,
                           prompt="<｜Assistant｜><think>\n", parse_thinking=True)
    message = choice["message"]
    assert "reasoning_content" not in message and "completion_tokens_details" not in usage
    if "tools" in extra:
        assert choice["finish_reason"] == "tool_calls" and message["content"] is None
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    else:
        assert message["content"] == text


def test_a_json_answer_mentioning_think_tags_is_not_split(tokenizer):
    text = '{"html": "a</think>b"}'
    choice, _ = answer(tokenizer, "qwen3", text, {"response_format": {"type": "json_object"}},
                       parse_thinking=True)
    assert choice["message"] == {"role": "assistant", "content": text, "refusal": None}


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen2"])
def test_thinking_cut_off_after_a_block_the_prompt_opened_is_reasoning(tokenizer, model_type):
    """Qwen3-Thinking-2507, DeepSeek-R1 distills (llama, qwen2): the template ends the prompt
    with <think>; an answer cut off by max_tokens before </think> is all reasoning."""
    text = "The user asks about the weather. I should"
    choice, usage = answer(tokenizer, model_type, text, prompt="<|im_start|>assistant\n<think>\n",
                           parse_thinking=True)
    assert choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == text
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"]
    # Without an opened block the same text is the answer.
    choice, usage = answer(tokenizer, model_type, text, parse_thinking=True)
    assert choice["message"]["content"] == text and "completion_tokens_details" not in usage


def test_a_block_the_prompt_closed_leaves_the_answer_content(tokenizer):
    """DeepSeek-V3.1 without thinking: the prompt ends with </think>, the answer is content."""
    choice, _ = answer(tokenizer, "deepseek_v3", "Hello there.", prompt="<｜Assistant｜></think>",
                       parse_thinking=True)
    assert choice["message"] == {"role": "assistant", "content": "Hello there.",
                                 "refusal": None}


def test_harmony_answer_without_a_call_is_the_final_channel():
    """gpt-oss with --parse-tool-call alone: an answer that calls nothing is its final channel,
    not the raw channel markup with the analysis in it."""
    text = ("<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant"
            "<|channel|>final<|message|>Hello!<|return|>")
    assert parse_output(text, tool_parser="harmony").content == "Hello!"
    assert parse_output(text, reasoning_style="harmony", tool_parser="harmony").reasoning \
        == "User greets."


LLAMA31_CALLS = (
    "{%- for m in messages %}{%- if m.tool_calls %}{%- set c = m.tool_calls[0].function %}"
    "{{- '{\"name\": \"' + c.name + '\", \"parameters\": ' + c.arguments | tojson + '}' }}"
    "{%- else %}{{- m.role + ': ' + m.content + '\\n' }}{%- endif %}{%- endfor %}")
DEEPSEEK_V3_CALLS = (
    "{%- for m in messages %}{%- if m.tool_calls %}{%- for t in m.tool_calls %}"
    "{{- t.function.name + '\\n```json\\n' + t.function.arguments + '\\n```' }}{%- endfor %}"
    "{%- else %}{{- m.role + ': ' + m.content + '\\n' }}{%- endif %}{%- endfor %}")


@pytest.mark.parametrize("template, rendered", [
    (LLAMA31_CALLS, '{"name": "get_weather", "parameters": {"city": "Zürich"}}'),
    (DEEPSEEK_V3_CALLS, 'get_weather\n```json\n{"city": "Zürich"}\n```'),
])
def test_earlier_tool_calls_reach_the_template_as_objects(template, rendered):
    """OpenAI gives an assistant's tool call arguments as a JSON string; templates that write
    `arguments | tojson` (Llama 3.1, Qwen2.5) need the object, as vLLM hands it to them, while
    one that concatenates the text (DeepSeek-V3) keeps working with the string."""
    from tiny_models import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    tokenizer.chat_template = template
    messages = USER + [
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Zürich"}, ensure_ascii=False)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    text = render_chat(messages, {}, tokenizer)
    assert rendered in text and '\\"city\\"' not in text
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'


def test_parallel_tool_calls_false_answers_at_most_one_call(tokenizer):
    """OpenAI's `parallel_tool_calls: false`: the answer carries at most one tool call."""
    two = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    for parallel, count in ((False, 1), (True, 2), (None, 2)):
        extra = {"tools": [WEATHER]}
        if parallel is not None:
            extra["parallel_tool_calls"] = parallel
        choice, _ = answer(tokenizer, "qwen2", two, extra, parse_tool_call=True)
        assert len(choice["message"]["tool_calls"]) == count
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) \
            == {"city": "Paris"}


@pytest.mark.parametrize("template, role", [
    ("{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}", "system"),
    ("{%- for m in messages %}{%- if m.role == 'developer' %}{{- 'DEV: ' + m.content }}"
     "{%- else %}{{- m.role + ': ' + m.content + '\\n' }}{%- endif %}{%- endfor %}", "DEV"),
])
def test_developer_is_system_unless_the_template_knows_it(template, role):
    """OpenAI's `developer` message is a system message under a newer name: a template that
    never mentions the role renders it as `system`; one that does (gpt-oss's) gets it as is."""
    from tiny_models import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    tokenizer.chat_template = template
    messages = [{"role": "developer", "content": "Be brief."}] + USER
    text = render_chat(messages, {}, tokenizer)
    assert text.startswith(f"{role}: Be brief.") and "developer" not in text
    assert messages[0]["role"] == "developer"  # the line's own messages are left as given


def test_a_template_mentioning_developers_in_prose_still_gets_developer_as_system():
    """Only a template that compares the role to the quoted name handles it; a default system
    prompt mentioning "developers" does not."""
    from tiny_models import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    tokenizer.chat_template = ("{{- 'Made by our developers.\\n' }}{%- for m in messages %}"
                               "{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}")
    text = render_chat([{"role": "developer", "content": "Be brief."}] + USER, {}, tokenizer)
    assert "system: Be brief." in text
