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
from batchgen.cli_options import (SIMULATE_RENAMES, apply_renames, build_config,
                                  deprecated_given, with_config_options)
from batchgen.config import ConfigError, default_storage_path
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


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)


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
    requeue_on_stop_signals()  # already done by the entry point, not under `-m batchgen.cli`
    from batchgen.io.locations import refuse_storage_urls

    run_job = _import_run_job()
    for line in deprecated_given(given_on_command_line(ctx)):
        warn(line)
    _setup_logging()
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
def validate(input: Path = typer.Option(..., "--input", "-i",
                                        help="JSONL or Parquet requests file."),
             max_tokens: int = typer.Option(256, help="Default max_tokens for lines without one.")):
    """Check an input file without loading a model: counts and the error of each bad line."""
    from batchgen.io.locations import refuse_urls
    from batchgen.runner.leader.validate import validate_file

    if max_tokens < 1:
        _fail(f"--max-tokens={max_tokens} is not allowed: an integer >= 1 (the max_tokens of "
              "lines that give none)")
    with _user_errors():
        refuse_urls(input=str(input))
        raise typer.Exit(validate_file(input, max_tokens))


@app.command()
def status(target: Optional[str] = typer.Argument(
               None, help="Job id, a job folder, or a job's --output file (default: every job "
                          "under --storage-path)."),
           storage_path: Optional[str] = typer.Option(
               None, help="Job folder (default: as `batchgen run` without --output: "
                          "$BATCHGEN_STATE_DIR or ~/.local/state/batchgen).")):
    """Status, request counts, tokens, throughput and health of jobs."""
    from batchgen.runner.leader.status import show_status

    raise typer.Exit(show_status(Path(storage_path or default_storage_path(None)), target))


@app.command()
def bench(shape: str = typer.Option("smollm2-135m", help="Model shape: smollm2-135m, llama3-8b, "
                                    "qwen3-8b, deepseek-v3-4l (37 B), gpt-oss-20b (MXFP4)."),
          requests: int = typer.Option(64, help="Number of requests."),
          input_len: int = typer.Option(128, help="Prompt tokens per request."),
          output_len: int = typer.Option(
              64, help="Output tokens per request (lognormal: the uncapped mean, sigma 1)."),
          output_dist: str = typer.Option("fixed", help="fixed or lognormal."),
          max_output_len: int = typer.Option(16384, help="Cap of lognormal outputs."),
          max_tokens_mode: str = typer.Option(
              "exact", help="exact: max_tokens = each drawn length (the scheduler knows it); "
              "cap: max_tokens = --max-output-len, the drawn length ends a request like an EOS."),
          peer: str = typer.Option("none", help="none, or hf: HF generate on static batches."),
          peer_batch: int = typer.Option(256, help="Static batch size of the HF peer."),
          dtype: str = typer.Option("auto", help="auto, float32, bfloat16, float16."),
          kv_dtype: str = typer.Option("auto", help="auto, bfloat16, float16, fp8_e4m3fn."),
          max_decode_batch: int = typer.Option(256, help="Most sequences decoded together."),
          max_prefill_tokens: int = typer.Option(
              8192, help="Token budget of one packed prefill step."),
          initial_gpu_page_buffer: int = typer.Option(
              32, help="Device pages reserved beyond the context when a sequence is loaded."),
          gpu_kv_cache_size: Optional[float] = typer.Option(None, help="Device KV pool in GB."),
          gpu_memory_frac: float = typer.Option(
              0.9, help="Share of device memory for weights + KV (without --gpu-kv-cache-size)."),
          host_kv_cache_size: Optional[float] = typer.Option(None, help="Host KV pool in GB."),
          compare_host_tier: bool = typer.Option(
              False, help="Run again with the host tier off (host pool = device pool, same "
              "device pool); report both, their ratio, and whether their tokens agree."),
          shared_prefix_len: int = typer.Option(
              0, help="Leading tokens of each prompt (of --input-len) that are one of "
              "--num-prefixes shared prefixes, drawn per request."),
          num_prefixes: int = typer.Option(1, help="Distinct shared prefixes."),
          n: int = typer.Option(1, "--n", help="Samples per prompt (greedy: all computed)."),
          enable_prefix_caching: bool = typer.Option(
              True, help="Share the KV of common prompt prefixes (as run's flag)."),
          compare_prefix_caching: bool = typer.Option(
              False, help="Run again with the prefix cache off; report both, their ratio, and "
              "whether their tokens agree."),
          device: str = typer.Option("auto", help="auto, cuda, cuda:N or cpu."),
          disable_cuda_graphs: bool = typer.Option(
              False, help="Decode eagerly (CUDA graphs are on by default on CUDA)."),
          cuda_graph_num_buckets: int = typer.Option(
              16, help="Captured decode batch sizes (fewer capture faster)."),
          decode_burst_steps: int = typer.Option(
              8, help="Decode steps queued back to back while the running set is fixed."),
          fp8_weights: bool = typer.Option(False, help="FP8 weights (not gpt-oss)."),
          fp8_scales: str = typer.Option(
              "block", help="--fp8-weights scales: block (128x128, as DeepSeek) or tensor "
              "(one per matrix, as AutoFP8 Llama checkpoints: row-scaled GEMMs)."),
          pre_dequantize_weights: bool = typer.Option(
              False, help="Dequantize MXFP4/FP8 weights at load, not on the fly."),
          enable_ep_with_offloading: bool = typer.Option(
              False, help="Keep a share of the routed experts in host memory."),
          ep_offloading_ratio: float = typer.Option(
              0.0, help="Share (0-1) of routed experts offloaded (needs the flag above)."),
          tiny: bool = typer.Option(False, help="The shape at toy widths (CPU smoke runs)."),
          tensor_parallel_size: int = typer.Option(
              1, help="Split the model over this many GPUs (DeepSeek: experts too), one "
              "process each (--device cpu: CPU processes over gloo)."),
          json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
          mode: str = typer.Option(
              "generate", help="generate, or embeddings: prefill-only embedding vs "
              "transformers' batched forward (--shape qwen3-embedding-0.6b; --peer-batch, "
              "--max-prefill-tokens).")):
    """Synthetic throughput benchmark on a random-init model of a real shape (EOS ignored)."""
    import json

    if mode not in ("generate", "embeddings"):
        _fail(f"--mode {mode!r} is not allowed: generate or embeddings")
    if mode == "embeddings":
        from batchgen.bench_embed import EmbedBench, format_table as embed_table, run as embed_run
        from batchgen.engine.embed import step_tokens

        _setup_logging()
        try:
            report = embed_run(EmbedBench(shape, requests, input_len,
                                          step_tokens(max_prefill_tokens), peer_batch, dtype,
                                          device, tiny))
        except ValueError as err:
            _fail(str(err))
        typer.echo(embed_table(report))
        if json_out:
            json_out.write_text(json.dumps(report, indent=2))
        return

    from batchgen.bench import BenchConfig, Workload, bench as run_bench
    from batchgen.bench_report import format_table
    from batchgen.config import canonical_dtype, canonical_kv_dtype

    _setup_logging()
    cfg = BenchConfig(
        shape=shape, dtype=canonical_dtype(dtype), kv_dtype=canonical_kv_dtype(kv_dtype),
        peer=peer, peer_batch=peer_batch, max_decode_batch=max_decode_batch,
        max_prefill_tokens=max_prefill_tokens, initial_gpu_page_buffer=initial_gpu_page_buffer,
        gpu_kv_cache_size=gpu_kv_cache_size, host_kv_cache_size=host_kv_cache_size,
        gpu_memory_frac=gpu_memory_frac, compare_host_tier=compare_host_tier, device=device,
        enable_prefix_caching=enable_prefix_caching,
        compare_prefix_caching=compare_prefix_caching,
        disable_cuda_graphs=disable_cuda_graphs, cuda_graph_num_buckets=cuda_graph_num_buckets,
        decode_burst_steps=decode_burst_steps, fp8_weights=fp8_weights, fp8_scales=fp8_scales,
        pre_dequantize_weights=pre_dequantize_weights,
        enable_ep_with_offloading=enable_ep_with_offloading,
        ep_offloading_ratio=ep_offloading_ratio, tiny=tiny,
        tensor_parallel_size=tensor_parallel_size)
    work = Workload(requests=requests, input_len=input_len, output_len=output_len,
                    output_dist=output_dist, max_output_len=max_output_len,
                    max_tokens_mode=max_tokens_mode, shared_prefix_len=shared_prefix_len,
                    num_prefixes=num_prefixes, n=n)
    try:
        cfg.model_config()
        work.validate()
        report = run_bench(cfg, work)
    except (ConfigError, ValueError) as err:
        _fail(str(err))
    typer.echo(format_table(report))
    if json_out:
        json_out.write_text(json.dumps(report, indent=2, default=str))


def simulate(ctx: typer.Context,
             png: Optional[Path] = typer.Option(None, help="Write the timeline plot here."),
             **flags) -> None:
    """The real scheduler driven by a cost model: size flags for machines we cannot run here."""
    from batchgen.cli_options import build_dataclass
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


def convert(output: Path = typer.Option(..., "--output", help="Folder to write (must not exist)."),
            world_size: int = typer.Option(1, help="World size the folder is for."),
            tensor_parallel_size: int = typer.Option(
                1, help="TP size the folder is for: > 1 writes one file per TP rank holding only "
                        "that rank's weights (runs at another TP size are refused)."),
            **flags) -> None:
    """Write a model in batchgen's own layout (fused projections, chosen dtype) + a manifest;
    `batchgen run --converted-ckpt-dir` then loads it without conversion."""
    from batchgen.cli_options import build_dataclass
    from batchgen.config import ModelConfig, canonical_dtype
    from batchgen.models.export import convert_model

    _setup_logging()
    cfg = build_dataclass(ModelConfig, {**flags, "dtype": canonical_dtype(flags["dtype"])})
    try:
        cfg.validate()
    except ConfigError as err:
        _fail(str(err))
    from batchgen.runner.files.errors import disk_errors

    with _user_errors(), disk_errors(f"write the converted model beside {output}"):
        convert_model(cfg, output, world_size, tensor_parallel_size)
    typer.echo(f"converted -> {output}")


def _register_generated_commands() -> None:
    from batchgen.config import ModelConfig, SchedulerConfig
    from batchgen.simulate import SimulationConfig

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
    sys.exit(run_app(app))


if __name__ == "__main__":
    main()
