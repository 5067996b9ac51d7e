"""`twinkled`: serve the daemon, and administer it with `ctl`. A thin click layer."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import click

from .config import Config


@click.group()
def main() -> None:
    """twinkled: multi-tenant LoRA training as a service, speaking the Tinker API."""


@main.command()
@click.option("--model", type=click.Path(path_type=Path), help="Hugging Face model directory.")
@click.option("--model-name", help="Name clients pass as base_model (default: the dir name).")
@click.option("--data-dir", type=click.Path(path_type=Path), help="SQLite + checkpoints.")
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="Port (default 8000).")
@click.option("--device", help="cpu, cuda, cuda:N or auto (default).")
@click.option("--devices", help="One worker per device, comma-separated: cuda:0,cuda:1.")
@click.option("--workers", type=int, help="Worker ranks on --device (default 1; gloo on CPU).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]),
              help="Base model dtype (default bfloat16; float32 on a CPU).")
@click.option("--config", "config_file", type=click.Path(path_type=Path, exists=True),
              help="TOML config file; flags override it.")
def serve(model, model_name, data_dir, host, port, device, devices, workers, dtype,
          config_file) -> None:
    """Load the base model once and serve the Tinker API over HTTP."""
    from aiohttp import web

    from .app import make_app
    from .service import Service
    from .store import Store

    cfg = Config.load(config_file, model=model, model_name=model_name, data_dir=data_dir,
                      host=host, port=port, device=device, dtype=dtype, workers=workers,
                      devices=devices.split(",") if devices else None)
    if cfg.model is None or not (cfg.model / "config.json").is_file():
        raise click.UsageError("--model must be a Hugging Face model directory")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(cfg.data_dir / "twinkle.db")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # optional speed-up
        pass
    # auto_decompress off: forward_backward bodies may be zstd (Content-Encoding: zstd),
    # which the Tinker codec decodes itself, with a size limit.
    web.run_app(make_app(Service(cfg, store), store), host=cfg.host, port=cfg.port,
                print=lambda s: click.echo(s, err=True),
                auto_decompress=False)


@main.group()
@click.option("--data-dir", type=click.Path(path_type=Path), default=Path("./twinkle-data"),
              show_default=True, help="The daemon's data directory.")
@click.pass_context
def ctl(ctx, data_dir: Path) -> None:
    """Administer a daemon's data directory (works whether or not it is running)."""
    from .store import Store

    data_dir.mkdir(parents=True, exist_ok=True)
    ctx.obj = Store(data_dir / "twinkle.db")


@ctl.group()
def keys() -> None:
    """API keys: one key maps to one tenant."""


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant the key belongs to.")
@click.pass_obj
def keys_create(store, tenant: str) -> None:
    """Create a key; it is printed once, alone on the last line (only a hash is stored)."""
    store.ensure_tenant(tenant)
    key = store.create_key(tenant)
    click.echo(f"created a key for tenant {tenant!r}; keep it, it is not shown again:")
    click.echo(key)


@ctl.group()
def tenants() -> None:
    """Tenants: fair-share weights and quotas."""


@tenants.command("set")
@click.argument("name")
@click.option("--weight", type=float, help="Fair-share weight (default 1).")
@click.option("--max-queued-requests", type=int, help="Queued requests before work waits.")
@click.option("--max-queued-tokens", type=int, help="Queued tokens before work waits.")
@click.option("--max-adapters", type=int, help="Adapters (training runs) at once.")
@click.option("--max-rank", type=int, help="Largest LoRA rank.")
@click.pass_obj
def tenants_set(store, name: str, weight, **limits) -> None:
    """Set a tenant's weight and quotas (0 clears a quota); a daemon applies it in seconds."""
    if weight is not None and weight <= 0:
        raise click.BadParameter("must be positive", param_hint="--weight")
    row = store.set_tenant(name, weight, **limits)
    click.echo(json.dumps(row))


@tenants.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def tenants_list(store, as_json: bool) -> None:
    """Tenants with their weights and quotas."""
    rows = store.list_tenants()
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:
        quotas = ", ".join(f"{k}={r.get(k)}" for k in store.TENANT_LIMITS if r.get(k))
        click.echo(f"{r['name']:<20} weight {r['weight']:<6g} {quotas or 'no quotas'}")


@ctl.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def status(store, as_json: bool) -> None:
    """The running daemon's state and, per tenant, queues, tokens served and share."""
    row = store.get_status()
    if row is None:
        raise click.ClickException("no status: has a daemon run on this data directory?")
    body = dict(row["body"], age_seconds=round(time.time() - row["updated"], 1))
    if as_json:
        click.echo(json.dumps(body))
        return
    click.echo(f"model {body['model']} ({body['state']}), {body['adapters']} adapters, "
               f"{body['steps']} steps; updated {body['age_seconds']} s ago")
    click.echo(f"{'tenant':<16}{'weight':>7}{'queued':>8}{'tokens':>9}{'paused':>8}"
               f"{'served':>12}{'share':>8}")
    for name, t in body["tenants"].items():
        click.echo(f"{name:<16}{t['weight']:>7g}{t['queued_requests']:>8}"
                   f"{t['queued_tokens']:>9}{t['paused']:>8}{t['served_tokens']:>12}"
                   f"{t['share']:>8.1%}")


@ctl.group()
def checkpoints() -> None:
    """Checkpoints: list them and verify their files against the recorded digests."""


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def _data_dir(ctx: click.Context) -> Path:
    """The --data-dir given to `ctl` (the command's group's group)."""
    while "data_dir" not in ctx.params:
        ctx = ctx.parent
    return ctx.params["data_dir"]


@checkpoints.command("list")
@click.option("--run", "run_id", metavar="RUN_ID", help="Only this training run's.")
@click.option("--tenant", help="Only this tenant's.")
@click.option("--status", type=click.Choice(["ready", "corrupt", "writing"]),
              help="Only checkpoints in this state (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def checkpoints_list(store, run_id, tenant, status, as_json: bool) -> None:
    """Checkpoints, newest first, with status, size, creation time and, if corrupt, why."""
    from .verify import all_checkpoints

    rows = all_checkpoints(store, status=status, run_id=run_id, tenant=tenant)
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created"]))
        line = f"{r['tinker_path']}  {r['status']:<7} {_size(r['size_bytes']):>10}  {created}Z"
        if r["status"] != "ready" and r["error"]:
            line += f"  {r['error']}"
        click.echo(line)


@checkpoints.command("verify")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def checkpoints_verify(ctx, as_json: bool) -> None:
    """Re-hash ready checkpoints; move damaged ones to quarantine/ and mark them corrupt."""
    from .verify import verify_checkpoints

    damaged = verify_checkpoints(ctx.obj, _data_dir(ctx))
    if as_json:
        click.echo(json.dumps(damaged))
        return
    for d in damaged:
        click.echo(f"{d['tinker_path']}: {d['reason']}")
    click.echo(f"{len(damaged)} damaged checkpoint(s) found" if damaged
               else "all ready checkpoints are intact")
