"""Command-line options generated from the config dataclasses (one source of truth).

Each leaf field of JobConfig becomes `--field-name` with the field's docstring as help; bools
that default to True get a `--no-...` twin. The command functions receive flat keyword
arguments and `build_config` regroups them into the frozen, validated JobConfig.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
import typing
from typing import Any, Callable, Optional

import typer

from batchgen.config import (ConfigError, JobConfig, canonical_dtype, canonical_kv_dtype,
                              field_docs)

VLLM_ALIASES = {
    "gpu_memory_frac": ["--gpu-memory-utilization"],
    "max_decode_batch": ["--max-num-seqs"],
    "max_prefill_tokens": ["--max-num-batched-tokens"],
    "kv_dtype": ["--kv-cache-dtype"],
    "disable_cuda_graphs": ["--enforce-eager"],
    "cache_dir": ["--download-dir"],
    "tensor_parallel_size": ["-tp"],
}
"""vLLM engine-argument names accepted as our flags where the meaning is the same (the ones
spelled as ours are VLLM_SAME_NAMES; --swap-space, GiB not GB, is converted: SWAP_SPACE)."""
VLLM_SAME_NAMES = ("model", "dtype", "seed", "max_model_len", "tensor_parallel_size",
                   "enable_prefix_caching", "generation_config", "chat_template")
"""vLLM engine arguments spelled as ours already."""
_QUANTIZATION = ("the quantization is read from the checkpoint's config.json (FP8 and MXFP4 "
                 "run as they ship; a bf16 checkpoint is not quantized at load, so for FP8 "
                 "weights give its FP8 release; AWQ, GPTQ and bitsandbytes are refused): "
                 "remove the flag")
_PIPELINE = ("there is no pipeline parallelism: split a model over GPUs with "
             "--tensor-parallel-size (several nodes: docs/slurm.md)")
_DATA_PARALLEL = ("data parallelism is --world-size / --tensor-parallel-size: give --world-size "
                  "(all GPUs of the job)")
VLLM_NOT_TAKEN = {
    "--trust-remote-code": "batchgen never runs code shipped with a model; it runs its own "
                           "code for the architectures it supports (README.md, Models): "
                           "remove the flag",
    "--served-model-name": "every answer's `model` is the loaded model's own name: remove the "
                           "flag",
    "--quantization": _QUANTIZATION,
    "-q": "(--quantization) " + _QUANTIZATION,
    "--tokenizer": "the model folder's own tokenizer is used (tokenizer.json): copy the "
                   "tokenizer files into the model folder, or fix chat prompts with "
                   "--chat-template",
    "--tokenizer-mode": "the model folder's own tokenizer is used as it ships: remove the "
                        "flag",
    "--load-format": "weights are read from safetensors, a .gguf file or a `batchgen convert` "
                     "folder, whichever --model names: remove the flag",
    "--pipeline-parallel-size": _PIPELINE,
    "-pp": "(--pipeline-parallel-size) " + _PIPELINE,
    "--data-parallel-size": _DATA_PARALLEL,
    "-dp": "(--data-parallel-size) " + _DATA_PARALLEL,
    "--enable-chunked-prefill": "prefill is always chunked, --max-prefill-tokens "
                                "(--max-num-batched-tokens) per step: remove the flag",
    "--block-size": "KV pages are always 64 tokens: remove the flag",
    "--output-tmp-dir": "results are written to a temporary file beside --output and renamed "
                        "into place: remove the flag",
    "--disable-log-stats": "there are no per-step stats logs to turn off (progress is a bar, or "
                           "a log line every 30 s; `batchgen status` shows the rest): remove "
                           "the flag",
    "--disable-log-requests": "requests are never logged: remove the flag",
}
"""vLLM flags `batchgen run` does not take, and what to do instead: a command line copied
from vLLM gets this line instead of a bare "no such option"."""
_TP = "give --tensor-parallel-size N (with --world-size, the job's GPUs in all)"
SGLANG_NOT_TAKEN = {
    "--model-path": "give --model",
    "--tokenizer-path": VLLM_NOT_TAKEN["--tokenizer"],
    "--tp-size": _TP,
    "--tp": _TP,
    "--dp-size": VLLM_NOT_TAKEN["--data-parallel-size"],
    "--dp": VLLM_NOT_TAKEN["--data-parallel-size"],
    "--mem-fraction-static": "give --gpu-memory-utilization (--gpu-memory-frac): the share of "
                             "device memory for weights + KV cache, of which 0.05 of the device "
                             "is kept for activations",
    "--context-length": "give --max-model-len (at most the model's own context)",
    "--disable-radix-cache": "give --no-enable-prefix-caching",
    "--schedule-policy": "the scheduler's order is fixed (waiting requests that share a prompt "
                         "prefix are admitted together): remove the flag",
    "--random-seed": "give --seed",
    "--chunked-prefill-size": "give --max-num-batched-tokens (--max-prefill-tokens), the "
                              "prefill chunk in tokens",
    "--max-running-requests": "give --max-num-seqs (--max-decode-batch)",
    "--disable-cuda-graph": "give --enforce-eager (--disable-cuda-graphs)",
    "--cuda-graph-max-bs": "give --cuda-graph-max-bucket-size",
}
"""SGLang server arguments `batchgen run` does not take under SGLang's name, and the flag that
does the same here (or why none is needed)."""
NOT_TAKEN = {**{flag: ("vLLM", why) for flag, why in VLLM_NOT_TAKEN.items()},
             **{flag: ("SGLang", why) for flag, why in SGLANG_NOT_TAKEN.items()}}
"""Every other tool's flag `batchgen run` refuses by name: flag -> (tool, what to do)."""
SHORT = {"input": ["-i"], "output": ["-o"]}
REQUIRED = ("input",)
"""Shown as required in --help (an empty value is refused by validation with the fix)."""
DEPRECATED = {
    "enable_host_kv_eviction": "host KV eviction is always on",
    "enable_decode_preemption": "decode preemption is always on",
    "enable_prepack": "prompts are always packed into one prefill batch",
    "enable_cuda_graph": "CUDA graphs are on by default on CUDA (--enforce-eager turns them off)",
}
"""Flags that change nothing: accepted with a one-line warning, left out of --help."""
HIDDEN_SPELLINGS = {"enable_cuda_graph": ["--enable-cuda-graphs"]}
SWAP_SPACE = "swap_space"
"""--swap-space GiB (vLLM's CPU swap space) sets --host-kv-cache-size in GB."""
RENAMED_PREFIX = "renamed__"
SIMULATE_RENAMES = {"model": "--shape", "tensor_parallel": "--tensor-parallel-size",
                    "host_kv_gb": "--host-kv-cache-size", "device_kv_gb": "--gpu-kv-cache-size"}
"""`batchgen simulate` spells these as `run` and `bench` do; the old flags still work."""
PANELS = {"storage": "Job files", "model": "Model", "runtime": "Model", "memory": "Memory",
          "scheduler": "Scheduler", "dist": "Parallel", "output": "Outputs",
          "watchdog": "Reliability"}
PANEL_ORDER = ("Job files", "Model", "Memory", "Scheduler", "Parallel", "Outputs", "Reliability")
FIELD_PANELS = {"wait_for_lock": "Reliability", "no_incremental_save": "Reliability"}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


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


HUMAN_SIZED = ("max_model_len", "max_prefill_tokens")
"""Token counts also taken as vLLM writes them: 8k = 8,000, 8K = 8,192, 25.6k = 25,600."""
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(value: Any) -> int:
    """An integer flag value, or one with a k/m/g (powers of 1,000) or K/M/G (of 1,024)
    suffix; typer.BadParameter naming the forms otherwise."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", str(value).strip())
    number = float(match[1]) * _UNITS[match[2]] if match else None
    if number is None or number != int(number):
        raise typer.BadParameter(f"{value!r} is not a whole number of tokens: give e.g. "
                                 "8192, 8k (8,000) or 8K (8,192)")
    return int(number)


def _option_type(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return Optional[args[0]]
    return hint


def _parameter(section: str, cls: type, f: dataclasses.Field,
               renames: dict[str, str] | None = None) -> inspect.Parameter:
    hint = _option_type(typing.get_type_hints(cls)[f.name])
    flag = (renames or {}).get(f.name) or flag_name(f.name)
    if hint is bool and f.default is True:
        decls = [f"{flag}/--no-{f.name.replace('_', '-')}"]
    else:
        decls = [flag, *SHORT.get(f.name, []), *VLLM_ALIASES.get(f.name, []),
                 *HIDDEN_SPELLINGS.get(f.name, [])]
    panel = FIELD_PANELS.get(f.name) or PANELS.get(section.split(".")[-1])
    default = ... if f.name in REQUIRED else f.default
    option = typer.Option(default, *decls, help=field_docs(cls).get(f.name, ""),
                          rich_help_panel=panel, show_default=f.default is not None,
                          hidden=f.name in DEPRECATED,
                          parser=human_int if f.name in HUMAN_SIZED else None)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=hint)


def _swap_space_parameter() -> inspect.Parameter:
    option = typer.Option(None, "--swap-space", rich_help_panel=PANELS["memory"],
                          help="vLLM's name: host KV pool in GiB (sets --host-kv-cache-size).")
    return inspect.Parameter(SWAP_SPACE, inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=Optional[float])


def _old_spelling(cls: type, f: dataclasses.Field) -> inspect.Parameter:
    """A hidden option under a field's former flag name (RENAMED_PREFIX + field)."""
    hint = _option_type(typing.get_type_hints(cls)[f.name])
    option = typer.Option(None, flag_name(f.name), hidden=True)
    return inspect.Parameter(RENAMED_PREFIX + f.name, inspect.Parameter.KEYWORD_ONLY,
                             default=option, annotation=Optional[hint])


def apply_renames(values: dict[str, Any], renames: dict[str, str]) -> list[str]:
    """Move values given under a former flag name onto the field; one warning line each."""
    warnings = []
    for name, flag in renames.items():
        old = values.pop(RENAMED_PREFIX + name, None)
        if old is not None:
            values[name] = old
            warnings.append(f"warning: {flag_name(name)} is deprecated: use {flag}")
    return warnings


def config_parameters(sections: list[tuple[str, type]] | None = None,
                      skip: tuple[str, ...] = (),
                      renames: dict[str, str] | None = None) -> list[inspect.Parameter]:
    """One option per field; for the whole JobConfig (sections None) in help-panel order,
    the job files first, plus --swap-space. `renames`: field -> flag spelled otherwise than
    the field, the field's own spelling kept as a hidden deprecated option."""
    params = []
    for section, cls in sections if sections is not None else leaf_sections():
        for f in dataclasses.fields(cls):
            if f.name not in skip:
                params.append(_parameter(section, cls, f, renames))
                if f.name in (renames or {}):
                    params.append(_old_spelling(cls, f))
    if sections is None:
        params.append(_swap_space_parameter())
        rank = {panel: i for i, panel in enumerate(PANEL_ORDER)}
        params.sort(key=lambda p: rank.get(p.default.rich_help_panel, len(rank)))
    return params


def with_config_options(func: Callable, sections: list[tuple[str, type]] | None = None,
                        skip: tuple[str, ...] = (),
                        renames: dict[str, str] | None = None) -> Callable:
    """Give `func(**kwargs)` a signature Typer reads: its own parameters + every flag of the
    given config dataclasses (default: all of JobConfig)."""
    own = [p for p in inspect.signature(func).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params = own + config_parameters(sections, skip, renames)
    func.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return func


def build_dataclass(cls: type, values: dict[str, Any]):
    """One flat dataclass from the flag values that name its fields."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def build_config(values: dict[str, Any]) -> JobConfig:
    """Regroup flat flag values into a validated JobConfig (raises ConfigError, naming a flag
    that has a vLLM alias by both names: the user may have typed either)."""
    try:
        return _build_config(values)
    except ConfigError as err:
        aliases = VLLM_ALIASES.get(err.name)
        if not aliases:
            raise
        raise ConfigError(err.name, err.value, err.allowed,
                          " / ".join([err.flag, *aliases])) from None


def _build_config(values: dict[str, Any]) -> JobConfig:
    values = dict(values)
    if values.get("kv_dtype") is not None:
        values["kv_dtype"] = canonical_kv_dtype(values["kv_dtype"])
    if values.get("dtype") is not None:
        values["dtype"] = canonical_dtype(values["dtype"])
    swap = values.pop(SWAP_SPACE, None)
    if swap is not None:
        if values.get("host_kv_cache_size") is not None:
            raise ConfigError(SWAP_SPACE, swap, "give --swap-space (GiB) or "
                              "--host-kv-cache-size (GB), not both")
        if not 0 < swap < math.inf:
            raise ConfigError(SWAP_SPACE, swap, "a size in GiB > 0 (it sets "
                              "--host-kv-cache-size, in GB)")
        values["host_kv_cache_size"] = swap * 2**30 / 1e9
    config = _build(JobConfig, values).validate()
    _refuse_unusable_numbers(values)
    return config


def _refuse_unusable_numbers(values: dict[str, Any]) -> None:
    """Numbers within each flag's own bounds that still no setting can use: an integer past
    64 bits (the job's files and the engine hold them as such) or an infinite float (sizes,
    seconds). Checked after the flags' own checks, whose messages say more."""
    for name, value in values.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and not -2**63 <= value < 2**63:
            raise ConfigError(name, value, "an integer below 2**63")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(name, value, "a finite number")


def deprecated_given(given: set[str]) -> list[str]:
    """One warning line per no-op flag among the parameters given on the command line."""
    return [f"warning: {flag_name(name)} is deprecated and ignored: {why}"
            for name, why in DEPRECATED.items() if name in given]


def _build(cls: type, values: dict[str, Any]):
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = _sub_config(f)
        if sub is not None:
            kwargs[f.name] = _build(sub, values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def _flag_cell(f: dataclasses.Field) -> str:
    flag = flag_name(f.name)
    if f.default is True:
        flag += f" / --no-{f.name.replace('_', '-')}"
    for alias in [*SHORT.get(f.name, []), *VLLM_ALIASES.get(f.name, []),
                  *HIDDEN_SPELLINGS.get(f.name, [])]:
        flag += f" / {alias}"
    return f"`{flag}`"


def flags_markdown() -> str:
    """docs/flags.md, generated from the same docstrings as --help, in --help's panels."""
    lines = ["# `batchgen run` flags", "",
             "Generated from the config dataclasses (`python -m batchgen.cli_options`); "
             "every flag is validated before any weights load. `batchgen run --help` shows "
             "the same flags in the same groups, but the deprecated ones (listed here as "
             "ignored), and vLLM's `--swap-space` in Memory (listed with vLLM's names "
             "below).", ""]
    rows: dict[str, list[str]] = {panel: [] for panel in PANEL_ORDER}
    for section, cls in leaf_sections():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            panel = FIELD_PANELS.get(f.name) or PANELS.get(section.split(".")[-1], section)
            doc = docs.get(f.name, "").replace("\n", " ").replace("|", "\\|")
            if f.name in DEPRECATED:
                doc = f"Deprecated, ignored (not in --help): {DEPRECATED[f.name]}."
            default = "required" if f.name in REQUIRED else f.default
            rows.setdefault(panel, []).append(f"| {_flag_cell(f)} | `{default}` | {doc} |")
    for panel, table in rows.items():
        lines += [f"## {panel}", "", "| flag | default | meaning |", "|---|---|---|", *table, ""]
    return "\n".join(lines + _vllm_table())


def _vllm_table() -> list[str]:
    """vLLM engine arguments batchgen reads, and the flag each one is."""
    lines = ["## vLLM engine-argument names", "",
             "A vLLM command line's engine arguments work here where the meaning is the same:",
             "", "| vLLM flag | batchgen flag | note |", "|---|---|---|"]
    for name, aliases in VLLM_ALIASES.items():
        for alias in aliases:
            lines.append(f"| `{alias}` | `{flag_name(name)}` | alias |")
    for name in VLLM_SAME_NAMES:
        lines.append(f"| `{flag_name(name)}` | `{flag_name(name)}` | same name |")
    lines.append("| `--swap-space` | `--host-kv-cache-size` | GiB converted to GB; batchgen's "
                 "host pool is per node, vLLM's swap space per GPU |")
    lines += ["", "vLLM flags that are not taken are refused with what to do instead:", "",
              "| vLLM flag | instead |", "|---|---|"]
    lines += [f"| `{flag}` | {why} |" for flag, why in VLLM_NOT_TAKEN.items()]
    lines += ["", "SGLang's names for these settings are refused with the flag to use:", "",
              "| SGLang flag | instead |", "|---|---|"]
    lines += [f"| `{flag}` | {why} |" for flag, why in SGLANG_NOT_TAKEN.items()]
    lines += ["", "A near miss of any flag (`--max-num-seq`) is answered with the closest "
              "flags.", ""]
    return lines


if __name__ == "__main__":
    print(flags_markdown())
