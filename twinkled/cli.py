"""`twinkled`: serve the daemon, and administer it with `ctl`. A thin click layer."""

from __future__ import annotations

import logging
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
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]),
              help="Base model dtype (default bfloat16; float32 on a CPU).")
@click.option("--config", "config_file", type=click.Path(path_type=Path, exists=True),
              help="TOML config file; flags override it.")
def serve(model, model_name, data_dir, host, port, device, dtype, config_file) -> None:
    """Load the base model once and serve the Tinker API over HTTP."""
    from aiohttp import web

    from .app import make_app
    from .service import Service
    from .store import Store

    cfg = Config.load(config_file, model=model, model_name=model_name, data_dir=data_dir,
                      host=host, port=port, device=device, dtype=dtype)
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
