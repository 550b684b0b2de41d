"""batchgen's command line: run, validate, status, convert, simulate, bench."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from batchgen.cli_options import build_config, with_config_options
from batchgen.config import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline batch LLM inference: a file of requests in, a file of results out.")
log = logging.getLogger("batchgen")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _config(values: dict):
    try:
        return build_config(values)
    except ConfigError as err:
        _fail(str(err))


def run(**flags) -> None:
    """Run a job: every request of --input through the model, results fsynced as they finish.
    Re-running the same command resumes: finished requests are never recomputed."""
    from batchgen.runner.supervisor import run_job

    _setup_logging()
    config = _config(flags)
    with _user_errors():
        code = run_job(config)
    raise typer.Exit(code)


app.command("run")(with_config_options(run))


@app.command()
def validate(input: Path = typer.Option(..., "--input", help="JSONL or Parquet requests file."),
             max_tokens: int = typer.Option(256, help="Default max_tokens for lines without one.")):
    """Check an input file without loading a model: counts and the error of each bad line."""
    from batchgen.runner.validate import validate_file

    with _user_errors():
        raise typer.Exit(validate_file(input, max_tokens))


@app.command()
def status(batch_id: Optional[str] = typer.Argument(None, help="Job id (default: every job)."),
           storage_path: str = typer.Option("batchgen/storage/", help="Job folder.")):
    """Status, request counts, tokens, throughput and health of jobs."""
    from batchgen.runner.status import show_status

    raise typer.Exit(show_status(Path(storage_path), batch_id))


def _user_errors():
    from batchgen.runner.errors import user_errors

    return user_errors(_fail)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
