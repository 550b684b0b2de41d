"""The run command line a vLLM user already knows: vLLM engine-argument names as aliases of
ours, short forms, --version, help in panels with the job files first, deprecated flags hidden
with a warning, usage mistakes as one `error:` line with a did-you-mean."""

import os
import re
import subprocess
import sys

import pytest
import typer
import typer.main

from batchgen.cli import app
from batchgen.cli_options import (DEPRECATED, PANEL_ORDER, VLLM_ALIASES, VLLM_SAME_NAMES,
                                  build_config, flag_name)
from batchgen.config import JobConfig

RUN = typer.main.get_command(app).commands["run"]


def parsed(*args) -> JobConfig:
    """The JobConfig `batchgen run ARGS` builds, without running it."""
    ctx = RUN.make_context("run", ["--input", "x.jsonl", *map(str, args)])
    return build_config(ctx.params)


def leaf(config: JobConfig, name: str):
    for part in (config.engine.model, config.engine.memory, config.engine.scheduler,
                 config.engine.runtime, config.storage, config.output, config.dist,
                 config.watchdog):
        if hasattr(part, name):
            return getattr(part, name)
    raise KeyError(name)


VALUES = {"gpu_memory_frac": "0.55", "max_decode_batch": "17", "max_prefill_tokens": "4096",
          "kv_dtype": "fp8", "cache_dir": "/models", "max_model_len": "1000", "seed": "9",
          "dtype": "float16", "tensor_parallel_size": "1", "model": "org/name",
          "generation_config": "vllm", "chat_template": "{{ messages[0].content }}"}
FLAG_VALUES = {"disable_cuda_graphs": True, "enable_prefix_caching": False}


@pytest.mark.parametrize("name,alias", [(n, a) for n, aliases in VLLM_ALIASES.items()
                                        for a in aliases])
def test_each_vllm_alias_sets_the_same_field_as_our_flag(name, alias):
    default = leaf(JobConfig(), name)
    if name in FLAG_VALUES:
        ours, theirs = parsed(flag_name(name)), parsed(alias)
    else:
        ours, theirs = parsed(flag_name(name), VALUES[name]), parsed(alias, VALUES[name])
    assert leaf(theirs, name) == leaf(ours, name) != default
    assert theirs == ours  # nothing else moved


@pytest.mark.parametrize("name", VLLM_SAME_NAMES)
def test_vllm_names_spelled_as_ours_are_our_flags(name):
    if name == "enable_prefix_caching":
        assert leaf(parsed("--no-enable-prefix-caching"), name) is False
        assert leaf(parsed("--enable-prefix-caching"), name) is True
        return
    assert str(leaf(parsed(flag_name(name), VALUES[name]), name)) == VALUES[name]


def test_swap_space_is_gib_and_sets_the_host_pool_in_gb():
    assert parsed("--swap-space", "4").engine.memory.host_kv_cache_size == pytest.approx(
        4 * 2**30 / 1e9)
    from batchgen.config import ConfigError

    with pytest.raises(ConfigError, match="--swap-space"):
        parsed("--swap-space", "4", "--host-kv-cache-size", "4")


def test_short_forms_max_tokens_and_dtype_spellings():
    config = parsed("-o", "out.jsonl", "--max-tokens", "33", "--dtype", "bf16")
    assert config.storage.output == "out.jsonl" and config.storage.max_tokens == 33
    assert config.engine.model.dtype == "bfloat16"
    ctx = RUN.make_context("run", ["-i", "in.jsonl"])
    assert ctx.params["input"] == "in.jsonl" and ctx.params["max_tokens"] == 256


def cli(*args, columns=80):
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "batchgen", *args], env=env,
                          capture_output=True, text=True, cwd="/")


@pytest.mark.parametrize("columns", [80, 160])
def test_run_help_is_grouped_in_panels_job_files_first(columns):
    out = cli("run", "--help", columns=columns).stdout
    positions = [out.find(panel) for panel in PANEL_ORDER]
    assert -1 not in positions and positions == sorted(positions), positions
    head, panels = out[:positions[0]], out[positions[0]:]
    assert "--model" not in head and "--output" not in head  # no option before the panel
    assert re.search(r"--[a-z]", panels).group(0) == "--i"  # --input comes first
    assert "required" in panels[:panels.find("--output")]
    for name in DEPRECATED:
        assert flag_name(name) not in out
    if columns == 80:
        assert max(len(line) for line in out.splitlines()) <= 80


def test_version():
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("batchgen ")


def test_near_miss_flag_is_one_error_line_with_a_suggestion():
    proc = cli("run", "-i", "x.jsonl", "--max-num-seq", "8")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--max-num-seqs" in lines[0]
    proc = cli("run")
    assert proc.stderr.startswith("error: ") and "--input" in proc.stderr


def test_deprecated_flags_are_accepted_with_one_warning_line(tmp_path):
    missing = tmp_path / "missing.jsonl"
    proc = cli("run", "-i", missing, "--enable-prepack", "--enable-cuda-graph",
               "--enable-decode-preemption", "--enable-host-kv-eviction")
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 4 and all("deprecated and ignored" in w for w in warnings)
    assert "No such option" not in proc.stderr


def test_simulate_spells_flags_as_run_and_keeps_old_spellings_with_a_warning():
    new = cli("simulate", "--shape", "smollm2-135m", "--tensor-parallel-size", "1",
              "--host-kv-cache-size", "50", "--gpu-kv-cache-size", "2", "--num-requests", "20")
    old = cli("simulate", "--model", "smollm2-135m", "--tensor-parallel", "1",
              "--host-kv-gb", "50", "--device-kv-gb", "2", "--num-requests", "20")
    assert new.returncode == 0 and old.returncode == 0, old.stderr

    def simulated(out: str) -> str:  # the report less the seconds the simulation itself took
        return re.sub(r"in \d+\.\d s", "in <t> s", out)

    assert simulated(new.stdout) == simulated(old.stdout) and "warning" not in new.stderr
    assert old.stderr.count("is deprecated: use") == 4
    assert "--tensor-parallel-size" in old.stderr and "--shape" in old.stderr
    shown = cli("simulate", "--help").stdout
    assert "--host-kv-gb" not in shown and "--host-kv-cache-size" in shown


def test_the_supervisor_and_torch_are_imported_with_the_collector_off(monkeypatch):
    """`batchgen run` imports the supervisor (and torch) with the cyclic GC off, and turns it
    back on after."""
    import gc
    import sys

    from batchgen import cli

    name = "batchgen.runner.leader.supervisor"
    seen = []

    class Watch:
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            if fullname == name:
                seen.append(gc.isenabled())
            return None

    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [Watch(), *sys.meta_path])
    assert gc.isenabled()
    assert callable(cli._import_run_job())
    assert seen == [False] and gc.isenabled()


def test_vllm_flags_that_are_not_taken_say_what_to_do_instead(capsys):
    from batchgen.cli_help import run_app
    from batchgen.cli_options import NOT_TAKEN, VLLM_NOT_TAKEN

    for flag, instead in VLLM_NOT_TAKEN.items():
        assert run_app(app, ["run", "-i", "x.jsonl", flag, "1"], NOT_TAKEN) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {flag} is vLLM's flag"), lines
        assert instead in lines[0]
    proc = cli("run", "-i", "x.jsonl", "--trust-remote-code")  # the console entry point
    assert proc.returncode == 2 and "never runs code shipped with a model" in proc.stderr
    assert "flags that are not taken" in open(os.path.join(
        os.path.dirname(__file__), "..", "docs", "flags.md")).read()


@pytest.mark.parametrize("args,named", [
    (["--max-num-seqs", "0"], "--max-decode-batch / --max-num-seqs=0 is not allowed"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-frac / --gpu-memory-utilization=1.5"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-dtype / --kv-cache-dtype='fp8_e5m2'"),
    (["--swap-space", "-1"], "--swap-space=-1.0 is not allowed: a size in GiB > 0"),
])
def test_a_bad_value_under_a_vllm_name_is_refused_under_that_name(args, named):
    from batchgen.config import ConfigError

    with pytest.raises(ConfigError) as err:
        parsed(*args)
    assert str(err.value).startswith(named), str(err.value)


def test_tensor_parallel_size_alone_names_the_world_size_it_needs():
    """vLLM's `--tensor-parallel-size 8` alone uses 8 GPUs; here the GPUs are --world-size."""
    from batchgen.config import ConfigError

    with pytest.raises(ConfigError, match="for 8 GPUs give --world-size 8 too"):
        parsed("--tensor-parallel-size", "8")
    assert parsed("--tensor-parallel-size", "8", "--world-size", "8").dist.world_size == 8


@pytest.mark.parametrize("given,tokens", [("8k", 8000), ("8K", 8192), ("25.6k", 25600),
                                          ("1M", 1 << 20), ("4096", 4096)])
def test_token_counts_take_vllms_human_readable_sizes(given, tokens):
    """vLLM writes `--max-model-len 32k`: k/m/g are powers of 1,000, K/M/G of 1,024."""
    config = parsed("--max-model-len", given, "--max-num-batched-tokens", given)
    assert config.engine.model.max_model_len == tokens
    assert config.engine.scheduler.max_prefill_tokens == tokens


@pytest.mark.parametrize("given", ["1.2345k", "8 kb", "abc", "-8k"])
def test_a_token_count_that_is_not_whole_names_the_forms(given):
    with pytest.raises(typer.BadParameter, match="whole number of tokens: give e.g. 8192, 8k"):
        parsed("--max-model-len", given)


@pytest.mark.parametrize("flag,named", [
    ("--tp-size", "--tensor-parallel-size"),
    ("--mem-fraction-static", "--gpu-memory-utilization"),
    ("--context-length", "--max-model-len"),
    ("--disable-radix-cache", "--no-enable-prefix-caching"),
    ("--schedule-policy", "remove the flag"), ("--disable-log-stats", "remove the flag"),
    ("-pp", "--tensor-parallel-size"), ("-dp", "--world-size")])
def test_sglang_and_vllm_server_flags_name_the_flag_to_use(flag, named):
    """An SGLang command line (or vLLM's logging switches) gets the flag that does the same
    here, not click's unrelated near misses (`--tp-size`: --dtype, --world-size), nor for
    vLLM's `-pp`, which click reads as `-p -p`, "No such option: -p"."""
    proc = cli("run", "-i", "x.jsonl", flag, "1")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {flag} is ") and named in lines[0], lines[0]
    assert "Possible options" not in lines[0]


@pytest.mark.parametrize("args, command", [
    (["run", "-i", "x.jsonl", "--model"], "run"), (["validate", "-i"], "validate"),
    (["status", "--storage-path"], "status")])
def test_a_flag_without_its_value_points_to_its_commands_help(capsys, args, command):
    """`batchgen run -i x.jsonl --model` (the value forgotten) pointed to `batchgen --help`,
    the list of commands, where every other usage error of `run` points to `run --help`."""
    from batchgen.cli_help import run_app

    assert run_app(app, args) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "requires an argument" in line, line
    assert line.endswith(f" {command} --help`)"), line


def test_a_flag_without_its_value_names_the_program_as_invoked():
    proc = cli("run", "-i", "x.jsonl", "--model")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("(see `python -m batchgen run --help`)"), proc.stderr


def test_no_arguments_show_the_help_not_an_error_line():
    proc = cli()
    assert proc.returncode == 2 and "error:" not in proc.stderr
    assert proc.stderr.startswith("Usage:") and "\n  run " in proc.stderr


def test_revision_without_a_hub_model_is_refused_not_ignored():
    """The embedded model has no revisions: `--revision` alone would run other weights than
    the user pinned."""
    from batchgen.config import ConfigError

    with pytest.raises(ConfigError, match="--revision='v1.0' is not allowed: .*--model org/name"):
        parsed("--revision", "v1.0")
    assert parsed("--revision", "v1.0", "--model", "org/name").engine.model.revision == "v1.0"


@pytest.mark.parametrize("args,named", [
    (["--max-tokens", "9" * 23], "--max-tokens=9999"),
    (["--max-model-len", "9" * 23], "--max-model-len=9999"),
    (["--max-num-seqs", "9" * 23], "--max-decode-batch / --max-num-seqs=9999"),
    (["--max-line-bytes", "9" * 23], "--max-line-bytes=9999"),
    (["--swap-space", "inf"], "--swap-space=inf"),
    (["--host-kv-cache-size", "inf"], "--host-kv-cache-size=inf"),
    (["--preempt-grace", "inf"], "--preempt-grace=inf"),
    (["--inflight-checkpoint-interval", "inf"], "--inflight-checkpoint-interval=inf"),
])
def test_numbers_no_setting_can_use_are_refused_by_flag(args, named):
    """Past 64 bits, or infinite: refused as one line naming the flag, not a traceback from
    the preflight, the job files or the worker."""
    from batchgen.config import ConfigError

    with pytest.raises(ConfigError) as err:
        parsed(*args)
    assert str(err.value).startswith(named) and "is not allowed" in str(err.value), str(err.value)


@pytest.mark.parametrize("device", ["cuda:x", "cuda:-1", "cudax", "cuda:", "CPU"])
def test_a_device_not_spelled_as_documented_is_refused_by_flag(device):
    """Not a torch traceback ("Invalid device string") from the job's first look at it."""
    from batchgen.config import ConfigError

    with pytest.raises(ConfigError, match=f"--device='{device}' is not allowed: auto, cpu"):
        parsed("--device", device)
    assert parsed("--device", "cuda:1").engine.runtime.device == "cuda:1"


@pytest.mark.parametrize("flag", ["--watchdog-timeout", "--decode-step-timeout",
                                  "--startup-timeout", "--watchdog-heartbeat-interval",
                                  "--preempt-grace"])
def test_seconds_past_what_the_timers_hold_are_refused_by_flag(flag):
    """1e10 s passed the checks and then killed the watchdog's thread with an OverflowError
    (faulthandler's timer holds ~9.2e9 s); a stop's grace timer would fail the same way."""
    from batchgen.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(f"{flag}=10000000000.0 is not allowed: "
                                                    "seconds > 0 and <= 1e+09")):
        parsed(flag, "1e10")
    parsed(flag, "1e9")
