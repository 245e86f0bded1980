"""The Typer app, output helpers and the error boundary every command shares."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from trainlift.errors import TrainliftError

app = typer.Typer(
    rich_markup_mode=None,  # plain help: flags without a type, values by their metavar
    name="trainlift",
    help="Fine-tune a Hugging Face causal LM with FSDP on Ray: locally first, then on EKS.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console(soft_wrap=True)  # a line the user pipes to grep stays one line
err_console = Console(stderr=True, soft_wrap=True)
_state = {"debug": False}


@app.callback()
def _global_options(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
) -> None:
    _state["debug"] = debug


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, nothing else."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def main() -> None:
    """Console-script entry point: user errors become one line and an exit code."""
    # Typer's vendored click: a usage error's class in every release from the image's (0.26) on; 0.29 added
    # `typer.exceptions.TyperException` above it, which the image's typer does not have.
    from typer._click.exceptions import ClickException

    try:
        code = app(prog_name="trainlift", standalone_mode=False)
    except ClickException as exc:  # a mistyped flag, value or argument: one line like every other mistake
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare command group: its help
            exc.show()
            sys.exit(exc.exit_code)
        from trainlift.redact import mask

        command = exc.ctx.command_path if getattr(exc, "ctx", None) else "trainlift"
        err_console.print(f"[bold red]error:[/] {escape(mask(exc.format_message()))} (see `{command} --help`)",
                          highlight=False, soft_wrap=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except typer.Abort:
        err_console.print("interrupted")
        sys.exit(130)
    except TrainliftError as exc:
        if _state["debug"]:
            traceback.print_exc()
        err_console.print(f"[bold red]error:[/] {escape(exc.one_line())}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
