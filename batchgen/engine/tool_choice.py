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

from batchgen.request_checks import ToolChoiceError, forced_functions  # noqa: F401

FORCING_PARSERS = ("hermes", "llama3_json", "deepseek_v3")


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
        from batchgen.engine.structured import xgrammar_reason

        raise ToolChoiceError("tools: a parameters schema cannot be enforced: "
                              f"{xgrammar_reason(err)}") from None


def _literal(xgr, text: str):
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


def _call(xgr, fn: dict, parser: str):
    """One call: the format's fixed text around the arguments, whose grammar is built from
    the parameters schema alone, so its `$ref`s (`#/$defs/...`, `#`) resolve against it as
    a pydantic-written schema expects."""
    arguments = xgr.Grammar.from_json_schema(json.dumps(fn["parameters"]), any_whitespace=False)
    if parser == "deepseek_v3":
        head = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                f"{fn['name']}\n```json\n")
        tail = "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    else:
        key = "arguments" if parser == "hermes" else "parameters"
        head = f'{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "{key}": '
        tail = "}"
        if parser == "hermes":
            head, tail = "<tool_call>\n" + head, tail + "\n</tool_call>"
    return xgr.Grammar.concat(_literal(xgr, head), arguments, _literal(xgr, tail))
