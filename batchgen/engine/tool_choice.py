"""`tool_choice` that forces a call ("required", or a named function): the grammar of one tool
call in the format the model's tool parser reads (parsers.py), built from the tools'
parameter schemas and enforced during sampling like a response_format.

  hermes       <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>
  llama3_json  {"name": NAME, "parameters": {...}}
  deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
               \\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import json

FORCING_PARSERS = ("hermes", "llama3_json", "deepseek_v3")


class ToolChoiceError(ValueError):
    """A tool_choice that cannot be enforced; the request becomes an error line."""


def forced_functions(tools, tool_choice) -> list[dict] | None:
    """The functions (`{"name", "parameters"}`) a call must be made to, or None when
    tool_choice leaves the model free ("auto", "none", absent)."""
    if tool_choice in (None, "auto", "none"):
        return None
    functions = _functions(tools)
    if tool_choice == "required":
        if not functions:
            raise ToolChoiceError("tool_choice \"required\" needs a non-empty tools list")
        return functions
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise ToolChoiceError(f"tool_choice names function {name!r}, which is not in tools")
        return chosen
    raise ToolChoiceError(f"tool_choice must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                          f"{tool_choice!r}")


def forces_call(extra: dict) -> bool:
    """Whether a request's tool_choice forces a call (a bad one is no request: False)."""
    try:
        return forced_functions(extra.get("tools"), extra.get("tool_choice")) is not None
    except ToolChoiceError:
        return False


def _functions(tools) -> list[dict]:
    if not isinstance(tools, list):
        return []
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolChoiceError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                  "{\"name\", \"parameters\"}}")
        params = fn.get("parameters") or {"type": "object"}
        if not isinstance(params, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"name": fn["name"], "parameters": params})
    return out


def tool_call_grammar(functions: list[dict], parser: str | None):
    """An xgrammar Grammar accepting exactly one call to one of `functions` in `parser`'s
    format. Raises ToolChoiceError for formats it cannot force."""
    import xgrammar as xgr

    if parser not in FORCING_PARSERS:
        said = "no tool-call format is known for this model" if parser is None \
            else f"the {parser} tool-call format cannot be forced"
        raise ToolChoiceError(f"tool_choice forcing a call is not supported: {said} (use "
                              f"--tool-call-parser with one of {', '.join(FORCING_PARSERS)}, "
                              "or tool_choice \"auto\")")
    try:
        calls = [_call(xgr, fn, parser) for fn in functions]
        return calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    except (RuntimeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ToolChoiceError(f"tools: a parameters schema cannot be enforced: {first}") from None


def _literal(xgr, text: str):
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))


def _call(xgr, fn: dict, parser: str):
    if parser == "deepseek_v3":
        head = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                f"{fn['name']}\n```json\n")
        return xgr.Grammar.concat(_literal(xgr, head),
                                  xgr.Grammar.from_json_schema(json.dumps(fn["parameters"]),
                                                               any_whitespace=False),
                                  _literal(xgr, "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"))
    key = "arguments" if parser == "hermes" else "parameters"
    schema = {"type": "object", "properties": {"name": {"const": fn["name"]},
                                               key: fn["parameters"]},
              "required": ["name", key], "additionalProperties": False}
    body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    if parser == "hermes":
        return xgr.Grammar.concat(_literal(xgr, "<tool_call>\n"), body,
                                  _literal(xgr, "\n</tool_call>"))
    return body
