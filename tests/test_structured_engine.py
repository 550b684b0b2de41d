"""Structured outputs end to end on the embedded SmolLM2: every schema answer parses and
validates, json_object mode always yields an object."""

import json

import pytest
import torch

from batchgen.config import ModelConfig
from batchgen.core import Request, SamplingParams
from batchgen.engine.structured import GrammarCompiler
from batchgen.models.factory import load_model
from engine_utils import make_engine

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer"}},
     "required": ["city", "population"]},
    {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "neutral"]},
                                      "score": {"type": "number"}}, "required": ["mood", "score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3,
                                               "items": {"enum": ["a", "b", "c"]}}},
     "required": ["tags"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
        "member": {"type": "boolean"}}, "required": ["name", "age", "member"]}},
     "required": ["person"]},
]


def validate(value, schema):
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and all(validate(value[k], s)
                        for k, s in schema["properties"].items() if k in value))
    if kind == "array":
        return isinstance(value, list) and all(validate(v, schema["items"]) for v in value)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(kind)


def strict(schema):
    """OpenAI strict-mode style: objects admit only their declared properties."""
    if schema.get("type") == "object":
        schema = {**schema, "additionalProperties": False,
                  "properties": {k: strict(v) for k, v in schema["properties"].items()}}
    if schema.get("type") == "array":
        schema = {**schema, "items": strict(schema["items"])}
    return schema


SCHEMAS = [strict(s) for s in SCHEMAS]


@pytest.fixture(scope="module")
def smol():
    return load_model(ModelConfig(), torch.device("cpu"))


def prompt(tokenizer, text):
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


def test_json_schema_answers_validate(smol):
    compiler = GrammarCompiler(smol.tokenizer, smol.hf_config.vocab_size,
                               stop_token_ids=list(smol.eos_token_ids))
    engine = make_engine(smol.model, smol.tokenizer, smol.eos_token_ids, device_gb=0.3, host_gb=0.3)
    requests = []
    for i in range(20):
        schema = SCHEMAS[i % len(SCHEMAS)]
        grammar = compiler.compile({"type": "json_schema",
                                    "json_schema": {"name": f"s{i}", "schema": schema}})
        requests.append(Request(f"s{i}", prompt(smol.tokenizer, f"Answer in JSON (case {i})."),
                                SamplingParams(max_tokens=160, temperature=0.7, seed=i), grammar))
    for request, result in zip(requests, engine.generate(requests)):
        completion = result.completions[0]
        assert completion.finish_reason.value == "stop", completion.text
        value = json.loads(completion.text)
        assert validate(value, SCHEMAS[int(request.request_id[1:]) % len(SCHEMAS)]), value


def test_json_object_mode_yields_an_object(smol):
    compiler = GrammarCompiler(smol.tokenizer, smol.hf_config.vocab_size,
                               stop_token_ids=list(smol.eos_token_ids))
    engine = make_engine(smol.model, smol.tokenizer, smol.eos_token_ids, device_gb=0.3, host_gb=0.3)
    grammar = compiler.compile({"type": "json_object"})
    requests = [Request(f"o{i}", prompt(smol.tokenizer, "Describe a cat as JSON."),
                        SamplingParams(max_tokens=200, temperature=0.8, seed=i), grammar)
                for i in range(4)]
    for result in engine.generate(requests):
        text = result.completions[0].text
        if result.completions[0].finish_reason.value == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert text.lstrip().startswith("{")
