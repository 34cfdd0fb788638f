"""`rlvr sandbox ...`: what the code sandbox gets on this host (`check`) and the sandbox as an HTTP
service (`serve`). A sub-app of rlvr.cli, kept here so the sandbox's commands live with it."""

from __future__ import annotations

import os
from typing import Annotated

import typer

sandbox_app = typer.Typer(help="The code sandbox.", no_args_is_help=True)


@sandbox_app.command("check")
def sandbox_check_command() -> None:
    """Which mode (root or rootless) and isolation layers the code sandbox gets on this host; exit 1
    where it refuses to run."""
    from rlvr.sandbox.runner import (
        LAYER_DESCRIPTIONS,
        MODE_DESCRIPTIONS,
        REQUIRED,
        SERVICE_HINT,
        capabilities,
        capability_details,
        mode,
    )

    have, details = capabilities(), capability_details()
    now = mode()
    print(f"mode: {MODE_DESCRIPTIONS.get(now, now)}")
    for layer, description in LAYER_DESCRIPTIONS.items():
        kind = "required" if layer in REQUIRED else "optional"
        note = f": {details[layer]}" if layer in details else ""
        print(f"{'yes' if have[layer] else 'NO ':<4}{layer:<19}{description} ({kind}){note}")
    missing = [layer for layer in REQUIRED if not have[layer]]
    if missing:
        print(
            f"the sandbox refuses to run here, as root nor rootless (missing: {', '.join(missing)}); "
            f"{SERVICE_HINT}"
        )
        raise typer.Exit(1)
    print("the sandbox runs here, with every layer marked yes")


@sandbox_app.command("serve")
def sandbox_serve_command(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8090,
    workers: Annotated[
        int, typer.Option("--workers", min=1, help="Sandbox runs at once (one process each).")
    ] = 2,
    queue: Annotated[
        int,
        typer.Option("--queue", min=0, help="Requests that may wait for a worker; past them: 503."),
    ] = 64,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            help="Required as 'Authorization: Bearer KEY' on every request (else 401). "
            "Default: RLVR_SANDBOX_API_KEY.",
        ),
    ] = None,
) -> None:
    """Run the code sandbox behind HTTP: POST /v1/run_tests (code and tests in, verdicts out; the
    hidden tests' runs are reduced here as in-process) and SandboxFusion's POST /run_code."""
    import uvicorn

    from rlvr.sandbox.runner import REQUIRED, SERVICE_HINT, capabilities, mode
    from rlvr.sandbox.service import create_app

    missing = [k for k in REQUIRED if not capabilities()[k]]
    if missing:  # a service that cannot isolate must not take code from a network
        print(
            f"the sandbox cannot isolate code here (missing: {', '.join(missing)}); {SERVICE_HINT}"
        )
        raise typer.Exit(1)
    key = api_key or os.environ.get("RLVR_SANDBOX_API_KEY") or None
    app = create_app(workers=workers, queue=queue, api_key=key)
    print(
        f"rlvr sandbox serve: {mode()} mode, {workers} workers, queue {queue}, on http://{host}:{port}",
        flush=True,
    )
    if key is None:
        print("no API key: anyone who reaches the port may run code here (--api-key)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
