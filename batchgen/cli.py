"""batchgen's command line: run, validate, status, convert, simulate, bench."""

from __future__ import annotations

import gc
import logging
import shutil
import sys
from pathlib import Path
from typing import Optional

import typer

from batchgen.cli_help import PanelCommand, given_on_command_line, run_app, version_callback, warn
from batchgen.cli_options import (NOT_TAKEN, SIMULATE_RENAMES, apply_renames, build_config,
                                  build_dataclass, deprecated_given, with_config_options)
from batchgen.config import MIN_LINE_BYTES, ConfigError, StorageConfig, default_storage_path
from batchgen.runner.exits import ExitCode, requeue_on_stop_signals

# Rich's option tables truncate long flag names ("--initial-gpu-page-…") below ~120 columns;
# click's plain layout wraps instead, so narrow terminals and pipes get that one.
_RICH_HELP = "rich" if shutil.get_terminal_size().columns >= 120 else None
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=_RICH_HELP,
                  help="Offline batch LLM inference: a file of requests in, a file of results out.")
log = logging.getLogger("batchgen")


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=version_callback,
                                       is_eager=True, help="Print the version and exit.")):
    """Offline batch LLM inference: a file of requests in, a file of results out."""


QUIET_LOGGERS = ("httpx", "httpx2", "httpcore")
"""HTTP clients (huggingface_hub's) that log every request at INFO: a Hub download's progress
is batchgen.hub's, and a probe the Hub (or a mirror) answers 404 would read as a fault."""


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _fail(message: str, code: int = ExitCode.INPUT) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _config(values: dict):
    try:
        return build_config(values)
    except ConfigError as err:
        _fail(str(err))


def run(ctx: typer.Context, **flags) -> None:
    """Run a job: every request of --input through the model, results fsynced as they finish.
    Re-running the same command resumes: finished requests are never recomputed."""
    requeue_on_stop_signals(announce=True)  # as the entry point does (not under -m batchgen.cli)
    from batchgen.io.locations import refuse_storage_urls

    run_job = _import_run_job()
    for line in deprecated_given(given_on_command_line(ctx)):
        warn(line)
    _setup_logging()
    from batchgen.runner.leader.external import launcher_world_size

    # Under torchrun / srun --world-size may be left out: the flags are checked against the
    # launcher's world (docs/slurm.md), which `adopt` makes the job's.
    flags["world_size"] = launcher_world_size(flags["world_size"], flags["nnodes"])
    config = _config(flags)
    with _user_errors():
        refuse_storage_urls(config.storage)
        code = run_job(config)
    raise typer.Exit(code)


app.command("run", cls=PanelCommand)(with_config_options(run))


def _import_run_job():
    """The supervisor's entry, imported with the cyclic garbage collector off: it imports torch
    (for the workers' launcher), whose objects live for the whole run, so collections during
    that import only re-scan them (~0.4 s of a 2-core machine's ~1.4 s)."""
    gc.disable()
    try:
        from batchgen.runner.leader.supervisor import run_job
    finally:
        gc.enable()
    return run_job


@app.command()
def validate(input: str = typer.Option(..., "--input", "-i",
                                       help="JSONL or Parquet requests file."),
             max_tokens: int = typer.Option(256, help="Default max_tokens for lines without one."),
             max_line_bytes: int = typer.Option(
                 StorageConfig.max_line_bytes,
                 help="Longest JSONL line read, as `run --max-line-bytes` (give the job's value: "
                      "a longer line is a line_too_long error).")):
    """Check an input file without loading a model: counts and the error of each bad line."""
    from batchgen.io.locations import refuse_urls
    from batchgen.runner.leader.validate import validate_file

    if max_tokens < 1:
        _fail(f"--max-tokens={max_tokens} is not allowed: an integer >= 1 (the max_tokens of "
              "lines that give none)")
    if max_line_bytes < MIN_LINE_BYTES:
        _fail(f"--max-line-bytes={max_line_bytes} is not allowed: an integer >= "
              f"{MIN_LINE_BYTES} (as for `batchgen run`)")
    with _user_errors():
        refuse_urls(input=input)  # as typed: a Path would fold its "//"
        raise typer.Exit(validate_file(Path(input), max_tokens, max_line_bytes))


@app.command()
def status(target: Optional[str] = typer.Argument(
               None, help="Job id, a job folder (or the folder holding its .batchgen/), or "
                          "a job's --output file (default: every job under --storage-path)."),
           storage_path: Optional[str] = typer.Option(
               None, help="Job folder (default: as `batchgen run` without --output: "
                          "$BATCHGEN_STATE_DIR or ~/.local/state/batchgen)."),
           json_lines: bool = typer.Option(
               False, "--json", help="One JSON object a job on stdout (its batch file, with "
                                     "run, workers, saved and checkpoint) instead of tables.")):
    """Status, request counts, tokens, throughput and health of jobs."""
    from batchgen.io.locations import refuse_urls, url_scheme
    from batchgen.runner.leader.status import show_status

    if target is not None and url_scheme(target) is not None:
        _fail(f"{target!r} is a URL: status reads a job's local files; give its batch id, its "
              "job folder or its local --output file")
    with _user_errors():
        refuse_urls(storage_path=storage_path)
    raise typer.Exit(show_status(Path(storage_path or default_storage_path(None)), target,
                                 json_lines))


def bench(json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
          mode: str = typer.Option(
              "generate", help="generate, or embeddings: prefill-only embedding vs "
              "transformers' batched forward (--shape qwen3-embedding-0.6b; --requests, "
              "--input-len, --peer-batch, --max-prefill-tokens, --dtype, --device, --tiny)."),
          **flags) -> None:
    """Synthetic throughput benchmark on a random-init model of a real shape (EOS ignored)."""
    import json

    if mode not in ("generate", "embeddings"):
        _fail(f"--mode {mode!r} is not allowed: generate or embeddings")
    _setup_logging()
    try:
        report, table = (_bench_embeddings(flags) if mode == "embeddings"
                         else _bench_generate(flags))
    except (ConfigError, ValueError) as err:
        _fail(str(err))
    typer.echo(table)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2, default=str))


def _bench_generate(flags: dict) -> tuple[dict, str]:
    from batchgen.bench import bench as run_bench
    from batchgen.bench_config import BenchConfig, Workload
    from batchgen.bench_report import format_table
    from batchgen.config import canonical_dtype, canonical_kv_dtype

    flags = {**flags, "dtype": canonical_dtype(flags["dtype"]),
             "kv_dtype": canonical_kv_dtype(flags["kv_dtype"])}
    report = run_bench(build_dataclass(BenchConfig, flags), build_dataclass(Workload, flags))
    return report, format_table(report)


def _bench_embeddings(flags: dict) -> tuple[dict, str]:
    from batchgen.bench_embed import EmbedBench, format_table, run
    from batchgen.engine.embed import step_tokens

    report = run(EmbedBench(flags["shape"], flags["requests"], flags["input_len"],
                            step_tokens(flags["max_prefill_tokens"]), flags["peer_batch"],
                            flags["dtype"], flags["device"], flags["tiny"]))
    return report, format_table(report)


def simulate(ctx: typer.Context,
             png: Optional[Path] = typer.Option(None, help="Write the timeline plot here."),
             **flags) -> None:
    """The real scheduler driven by a cost model: size flags for machines we cannot run here."""
    from batchgen.config import SchedulerConfig
    from batchgen.simulate import SimulationConfig, plot_timeline, run_simulation

    for line in apply_renames(flags, SIMULATE_RENAMES) + deprecated_given(
            given_on_command_line(ctx)):
        warn(line)
    sim = build_dataclass(SimulationConfig, flags)
    sched = build_dataclass(SchedulerConfig, flags)
    if png is not None and not png.suffix:
        png = png.with_suffix(".png")  # what the plot library would write
    try:
        sim.validate()
        sched.validate()
        if png is not None and (png.is_dir() or not png.parent.is_dir()):
            raise ValueError(f"--png {png}: give a file path in an existing folder")
        result = run_simulation(sim, sched)  # reads --requests-file
    except (ConfigError, ValueError) as err:
        _fail(str(err))
    typer.echo(result.summary())
    if png:
        try:
            plot_timeline(result, str(png))
        except OSError as err:
            _fail(f"--png {png}: {err.strerror or err}")
        typer.echo(f"timeline: {png}")


def convert(output: Path = typer.Option(..., "--output", help="Folder to write (new, or empty)."),
            world_size: int = typer.Option(1, help="World size the folder is for."),
            tensor_parallel_size: int = typer.Option(
                1, help="TP size the folder is for: > 1 writes one file per TP rank holding only "
                        "that rank's weights (runs at another TP size are refused)."),
            **flags) -> None:
    """Write a model in batchgen's own layout (fused projections, chosen dtype) + a manifest;
    `batchgen run --converted-ckpt-dir` then loads it without conversion."""
    from batchgen.config import ModelConfig, canonical_dtype
    from batchgen.models.export import convert_model

    _setup_logging()
    cfg = build_dataclass(ModelConfig, {**flags, "dtype": canonical_dtype(flags["dtype"])})
    try:
        cfg.validate()
    except ConfigError as err:
        _fail(str(err))
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        _fail(f"--output {output} exists and is not an empty folder: choose a new folder")
    from batchgen.runner.files.errors import disk_errors

    with _user_errors(), disk_errors(f"write the converted model beside {output}"):
        convert_model(cfg, output, world_size, tensor_parallel_size)
    typer.echo(f"converted -> {output}")


def _register_generated_commands() -> None:
    from batchgen.bench_config import BenchConfig, Workload
    from batchgen.config import ModelConfig, SchedulerConfig
    from batchgen.simulate import SimulationConfig

    app.command("bench")(with_config_options(bench, [("bench", BenchConfig),
                                                     ("workload", Workload)]))

    app.command("simulate")(with_config_options(
        simulate, [("simulate", SimulationConfig), ("scheduler", SchedulerConfig)],
        renames=SIMULATE_RENAMES))
    app.command("convert")(with_config_options(
        convert, [("model", ModelConfig)], skip=("converted_ckpt_dir", "enable_ep_with_offloading",
                                                 "ep_offloading_ratio", "max_model_len")))


_register_generated_commands()


def _user_errors():
    from batchgen.runner.files.errors import user_errors

    return user_errors(_fail)


def main() -> None:
    sys.exit(run_app(app, foreign_flags=NOT_TAKEN))


if __name__ == "__main__":
    main()
