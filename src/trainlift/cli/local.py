"""`trainlift local up|status|down`: a persistent Ray head on this machine, which submit and train then use."""

from __future__ import annotations

from typing import Optional

import typer

from trainlift.cli.app import app, console, print_json

local_app = typer.Typer(rich_markup_mode=None, help="A persistent local Ray head (dashboard on loopback) for submit and train.",
                        no_args_is_help=True)
app.add_typer(local_app, name="local")


@local_app.command("up")
def local_up(port: int = typer.Option(8265, min=1, max=65535, help="Dashboard port (loopback only)."),
             num_cpus: Optional[int] = typer.Option(None, help="CPUs Ray may schedule (default: all)."),
             json_out: bool = typer.Option(False, "--json")) -> None:
    """Start a local Ray head; submit and train then use it by default.

    Every server of the head (Jobs API, GCS, metrics) listens on 127.0.0.1 only, and it requires Ray's token
    (~/.ray/auth_token, written 0600 on first use; RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH name another)."""
    from trainlift.ops import localray

    state = localray.up(port=port, num_cpus=num_cpus)
    if json_out:
        print_json(state)
    else:
        verb = "started" if state["started"] else "already running"
        console.print(f"local Ray head {verb}: dashboard {state['dashboard_url']} (loopback only), GCS "
                      f"{state['gcs_address']} (loopback only; Ray's token is required)")


@local_app.command("status")
def local_status(json_out: bool = typer.Option(False, "--json")) -> None:
    """Whether the local head is running and its dashboard answers."""
    from trainlift.ops import localray

    state = localray.status()
    if json_out:
        print_json(state)
    elif state["running"]:
        console.print(f"running: dashboard {state['dashboard_url']} "
                      f"({'reachable' if state['dashboard_reachable'] else 'not answering'})")
    else:
        console.print("not running (start it with `trainlift local up`)")
    if not state["running"]:
        raise typer.Exit(1)


@local_app.command("down")
def local_down() -> None:
    """Stop the local head started by `trainlift local up`."""
    from trainlift.ops import localray

    console.print("stopped the local Ray head" if localray.down() else "no local Ray head was running")
