"""How the command line talks to people: options grouped in panels in every layout, usage
mistakes as one `error:` line, warnings for deprecated spellings, and the version."""

from __future__ import annotations

import sys
from importlib import metadata

import typer
import typer.core
from typer.core import TyperCommand

from batchgen.runner.exits import ExitCode


def _click():
    """The click typer runs on: its own copy in newer typer releases, click itself before."""
    return getattr(typer.core, "_click", None) or typer.core.click  # type: ignore[attr-defined]


class PanelCommand(TyperCommand):
    """A command whose plain (non-rich) help groups options under their help panels, in the
    order the parameters are declared, as the rich layout does."""

    def format_options(self, ctx, formatter) -> None:
        if self.rich_markup_mode is not None:
            return super().format_options(ctx, formatter)
        args, panels = [], {}  # type: ignore[var-annotated]
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append(record)
            else:
                panel = getattr(param, "rich_help_panel", None) or "Options"
                panels.setdefault(panel, []).append(record)
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        for panel, records in panels.items():
            with formatter.section(panel):
                formatter.write_dl(records)


def warn(message: str) -> None:
    typer.secho(message, fg=typer.colors.YELLOW, err=True)


def given_on_command_line(ctx: typer.Context) -> set[str]:
    """Names of the command's parameters the user gave (not defaults)."""
    return {name for name in ctx.params
            if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}


def version() -> str:
    try:
        return metadata.version("batchgen")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"batchgen {version()}")
        raise typer.Exit()


def _foreign_flag(err, args: list[str], foreign_flags: dict) -> str | None:
    """The other tool's flag behind a usage error: the option click names, or the argument
    it came from where click read a short form such as vLLM's `-pp` as the cluster `-p -p`."""
    name = getattr(err, "option_name", None) or ""
    if name in foreign_flags:
        return name
    if len(name) != 2:
        return None
    given = (arg.split("=", 1)[0] for arg in args if not arg.startswith("--"))
    return next((arg for arg in given if arg in foreign_flags and arg.startswith(name)), None)


def _command_path(err, args: list[str]) -> str:
    """The command whose `--help` a usage error points to, spelled as click spells it (`batchgen
    run`, `python -m batchgen run`): its context names it; an option given without its value
    fails before the command has a context, so the program name and the first word of `args`
    (the subcommand) name it then."""
    if err.ctx is not None:
        return err.ctx.command_path
    detect = getattr(_click().utils, "_detect_program_name", None)
    program = detect() if detect is not None else "batchgen"
    command = next((arg for arg in args if not arg.startswith("-")), None)
    return f"{program} {command}" if command else program


def run_app(app: typer.Typer, args: list[str] | None = None,
            foreign_flags: dict[str, tuple[str, str]] | None = None) -> int:
    """Run the app; a usage mistake (unknown flag, missing value) is one `error:` line naming
    the fix, with click's did-you-mean when a flag is a near miss. `foreign_flags`: flags of
    another tool (vLLM, SGLang) that are not taken -> (that tool, what to do instead). No
    arguments at all (or a command group alone) shows the help."""
    click = _click()
    no_args = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click < 8.2 shows it itself
    try:
        code = app(args=args, standalone_mode=False)
    except no_args as err:
        err.show()
        return ExitCode.INPUT
    except click.exceptions.UsageError as err:
        command = _command_path(err, sys.argv[1:] if args is None else args)
        message = err.format_message().replace("\n", " ")
        flag = _foreign_flag(err, sys.argv[1:] if args is None else args, foreign_flags or {})
        if isinstance(err, click.exceptions.NoSuchOption) and flag is not None:
            tool, instead = foreign_flags[flag]  # type: ignore[index]
            message = f"{flag} is {tool}'s flag, not taken here: {instead}"
        typer.secho(f"error: {message} (see `{command} --help`)", fg=typer.colors.RED, err=True)
        return ExitCode.INPUT
    except click.exceptions.ClickException as err:
        typer.secho(f"error: {err.format_message()}", fg=typer.colors.RED, err=True)
        return err.exit_code
    except typer.Abort:  # click's Abort (typer >= 0.16 keeps its own, not in _click)
        typer.echo("aborted", err=True)
        return 130
    return code if isinstance(code, int) else 0

