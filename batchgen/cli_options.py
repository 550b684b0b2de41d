"""Command-line options generated from the config dataclasses (one source of truth).

Each leaf field of JobConfig becomes `--field-name` with the field's docstring as help; bools
that default to True get a `--no-...` twin. The command functions receive flat keyword
arguments and `build_config` regroups them into the frozen, validated JobConfig.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, Callable, Optional

import typer

from batchgen.config import JobConfig, canonical_kv_dtype, field_docs

ALIASES = {"enable_cuda_graph": ["--enable-cuda-graphs"]}
PANELS = {"model": "Model", "memory": "Memory", "scheduler": "Scheduler", "runtime": "Runtime",
          "storage": "Input and storage", "output": "Outputs", "dist": "Distributed",
          "watchdog": "Watchdog and preemption"}


def _sub_config(f: dataclasses.Field):
    """The dataclass a field holds (via default_factory), or None for a plain value."""
    sub = f.default_factory  # type: ignore[misc]
    return sub if sub is not dataclasses.MISSING and dataclasses.is_dataclass(sub) else None


def leaf_sections(cls: type = JobConfig, prefix: str = "") -> list[tuple[str, type]]:
    """("engine.model", ModelConfig), ... for every leaf dataclass of a composite config."""
    out = []
    for f in dataclasses.fields(cls):
        sub = _sub_config(f)
        if sub is None:
            continue
        if any(_sub_config(g) for g in dataclasses.fields(sub)):
            out += leaf_sections(sub, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", sub))
    return out


def _option_type(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return Optional[args[0]]
    return hint


def _parameter(section: str, cls: type, f: dataclasses.Field) -> inspect.Parameter:
    hint = _option_type(typing.get_type_hints(cls)[f.name])
    flag = "--" + f.name.replace("_", "-")
    if hint is bool and f.default is True:
        decls = [f"{flag}/--no-{f.name.replace('_', '-')}"]
    else:
        decls = [flag, *ALIASES.get(f.name, [])]
    panel = PANELS.get(section.split(".")[-1])
    option = typer.Option(f.default, *decls, help=field_docs(cls).get(f.name, ""),
                          rich_help_panel=panel, show_default=f.default is not None)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=hint)


def config_parameters(sections: list[tuple[str, type]] | None = None,
                      skip: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    params = []
    for section, cls in sections if sections is not None else leaf_sections():
        for f in dataclasses.fields(cls):
            if f.name not in skip:
                params.append(_parameter(section, cls, f))
    return params


def with_config_options(func: Callable, sections: list[tuple[str, type]] | None = None,
                        skip: tuple[str, ...] = ()) -> Callable:
    """Give `func(**kwargs)` a signature Typer reads: its own parameters + every flag of the
    given config dataclasses (default: all of JobConfig)."""
    own = [p for p in inspect.signature(func).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    func.__signature__ = inspect.Signature(own + config_parameters(sections, skip))  # type: ignore[attr-defined]
    return func


def build_dataclass(cls: type, values: dict[str, Any]):
    """One flat dataclass from the flag values that name its fields."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def build_config(values: dict[str, Any]) -> JobConfig:
    """Regroup flat flag values into a validated JobConfig (raises ConfigError)."""
    values = dict(values)
    if values.get("kv_dtype") is not None:
        values["kv_dtype"] = canonical_kv_dtype(values["kv_dtype"])
    return _build(JobConfig, values).validate()


def _build(cls: type, values: dict[str, Any]):
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = _sub_config(f)
        if sub is not None:
            kwargs[f.name] = _build(sub, values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def flags_markdown() -> str:
    """docs/flags.md, generated from the same docstrings as --help."""
    lines = ["# `batchgen run` flags", "",
             "Generated from the config dataclasses (`python -m batchgen.cli_options`); "
             "every flag is validated before any weights load.", ""]
    for section, cls in leaf_sections():
        lines += [f"## {PANELS.get(section.split('.')[-1], section)}", "",
                  "| flag | default | meaning |", "|---|---|---|"]
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.default is True:
                flag += f" / --no-{f.name.replace('_', '-')}"
            for alias in ALIASES.get(f.name, []):
                flag += f" / {alias}"
            doc = docs.get(f.name, "").replace("\n", " ").replace("|", "\\|")
            lines.append(f"| `{flag}` | `{f.default}` | {doc} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(flags_markdown())
