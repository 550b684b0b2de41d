"""The shared pieces of the configuration: the dtype and choice flags' spellings, ConfigError,
the `require` check every `validate()` uses, and the field docstrings the CLI shows."""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path

KV_DTYPE_ALIASES = {
    "auto": "auto",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "fp8_e4m3fn": "fp8_e4m3fn", "fp8": "fp8_e4m3fn", "float8_e4m3fn": "fp8_e4m3fn",
    "fp8_e4m3": "fp8_e4m3fn",
}
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32",
                 "fp32": "float32"}
"""Short spellings --dtype accepts (vLLM's among them), as --kv-dtype does."""
GPU_ARCH_CHOICES = ("auto", "hopper", "ampere", "cpu")
GENERATION_CONFIGS = ("auto", "none", "vllm")
"""--generation-config: the model's sampling defaults (auto) or OpenAI's (none; vLLM's name
for that is "vllm")."""
REASONING_FIELD_CHOICES = ("reasoning_content", "reasoning", "both")


class ConfigError(ValueError):
    """A flag has a value we refuse; the message names the flag, the value and what is allowed."""

    def __init__(self, name: str, value: object, allowed: str, flag: str | None = None):
        self.name, self.value, self.allowed = name, value, allowed
        self.flag = flag or "--" + name.replace("_", "-")
        super().__init__(f"{self.flag}={value!r} is not allowed: {allowed}")


def canonical_kv_dtype(value: str) -> str:
    key = value.strip().lower()
    if key not in KV_DTYPE_ALIASES:
        raise ConfigError("kv_dtype", value, "choose one of " + ", ".join(KV_DTYPE_ALIASES))
    return KV_DTYPE_ALIASES[key]


def canonical_dtype(value: str) -> str:
    key = value.strip().lower()
    return DTYPE_ALIASES.get(key, key)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right under each field."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def read_chat_template(value: str) -> str:
    """--chat-template's text: the value itself if it reads as a Jinja template ({{ or {%),
    else the file it names; ConfigError if that cannot be read."""
    if "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).expanduser().read_text()
    except (OSError, ValueError) as err:  # ValueError: undecodable, or a NUL in the name
        raise ConfigError("chat_template", value, "a Jinja template file that can be read "
                          f"({err}), or the template text itself") from None


def require(ok: bool, name: str, value: object, allowed: str) -> None:
    """Raise ConfigError for the flag of `name` unless `ok`; `allowed`: what it accepts."""
    if not ok:
        raise ConfigError(name, value, allowed)
