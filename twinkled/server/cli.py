"""`twinkled`: serve the daemon, and administer it with `ctl`. A thin click layer."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from twinkled.protocol.config import Config
from twinkled.server.ctl import ctl
from twinkled.server.layout import (
    adapters_budget,
    expand_devices,
    full_run_room,
    gpu_memory,
    host_memory_warning,
    kv_pool_mb,
    layout_problems,
    layout_summary,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})  # sub-commands too
@click.version_option(package_name="twinkle", prog_name="twinkled",
                      message="%(prog)s %(version)s")
def main() -> None:
    """twinkled: multi-tenant LoRA training as a service, speaking the Tinker API."""


@main.command()
@click.option("--model", type=click.Path(path_type=Path), help="Hugging Face model directory.")
@click.option("--model-name", help="Name clients pass as base_model (default: the dir name).")
@click.option("--data-dir", type=click.Path(path_type=Path), help="SQLite + checkpoints.")
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="Port (default 8000).")
@click.option("--device", help="cpu, cuda, cuda:N or auto (default).")
@click.option("--devices", help="One worker per device, comma-separated: cuda:0,cuda:1 "
              "(a range: cuda:0-3).")
@click.option("--workers", type=int, help="Worker ranks on --device (default 1; gloo on CPU).")
@click.option("--tp", type=int, help="Tensor-parallel size: each replica of the base model "
              "is split over this many devices (default 1).")
@click.option("--ep", type=int, help="Expert parallelism: ranks that split an MoE model's "
              "experts (default 1; divides the ranks and the experts).")
@click.option("--cp", type=int, help="Context parallelism: a row longer than cp_min_tokens "
              "has its tokens split over this many ranks (default 1).")
@click.option("--max-seq-len", type=int, help="Longest row; beyond the model's config it "
              "turns on YaRN unless rope_scaling is set (default: the config's).")
@click.option("--lanes", type=int, help="Independent worker groups to split the devices "
              "into, each with its own steps; a model lives on one (default 1). 0: no workers "
              "here, lanes come from the hosts that join (join_listen).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]),
              help="Base model dtype (default bfloat16; float32 on a CPU).")
@click.option("--log-format", type=click.Choice(["text", "json"]),
              help="One line per request; json for log shippers (default text).")
@click.option("--config", "config_file", type=click.Path(path_type=Path, exists=True),
              help="TOML config file; flags override it.")
def serve(model, model_name, data_dir, host, port, device, devices, workers, tp, ep, cp,
          max_seq_len, lanes, dtype, log_format, config_file) -> None:
    """Load the base model once and serve the Tinker API over HTTP."""
    from twinkled.server.perms import private_dir, private_umask

    private_umask()  # files 0600, dirs 0700: the daemon's and its workers' (docs/operator.md)
    from aiohttp import web

    from twinkled.core.service import Service
    from twinkled.server.app import make_app
    from twinkled.store import Store

    cfg = Config.load(config_file, model=model, model_name=model_name, data_dir=data_dir,
                      host=host, port=port, device=device, dtype=dtype, workers=workers, tp=tp,
                      ep=ep, cp=cp, max_seq_len=max_seq_len, lanes=lanes, devices=expand_devices(devices) if devices else None,
                      log_format=log_format)
    if cfg.model is None or not (cfg.model / "config.json").is_file():
        raise click.UsageError("--model must be a Hugging Face model directory")
    problems = cfg.range_problems()
    if problems:
        raise click.UsageError("; ".join(problems))
    _refuse_busy_port(cfg.host, cfg.port)
    memory = gpu_memory(cfg)
    cfg.sample_kv_mb = kv_pool_mb(cfg, memory)  # 0: sized from the cards (layout.py)
    problems = layout_problems(cfg, memory)
    if problems:
        raise click.UsageError("; ".join(problems))
    from twinkled.protocol.logs import setup_logging
    from twinkled.server.admin import admin_key_path, ensure_admin_key

    setup_logging(cfg.log_format)
    logging.getLogger("twinkled").info("workers: %s", layout_summary(cfg))
    if cfg.sample_kv_mb:
        logging.getLogger("twinkled").info("sampler KV pool: %d MiB per worker",
                                           cfg.sample_kv_mb)
    if warning := host_memory_warning(cfg):
        logging.getLogger("twinkled").warning(warning)
    private_dir(cfg.data_dir)
    key_path = admin_key_path(cfg.data_dir, cfg.admin_key_file or None)
    admin_key = ensure_admin_key(key_path)
    _log_start(cfg, key_path)
    store = Store(cfg.data_dir / "twinkle.db")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # optional speed-up
        pass
    # auto_decompress off: forward_backward bodies may be zstd (Content-Encoding: zstd),
    # which the Tinker codec decodes itself, with a size limit.
    service = Service(cfg, store, adapter_budget=adapters_budget(cfg, memory),
                      full_run_room=full_run_room(cfg, memory))
    # print=None: aiohttp's banner is plain text; _log_start said where we listen.
    web.run_app(make_app(service, store, admin_key), host=cfg.host, port=cfg.port,
                print=None, auto_decompress=False)
    logging.getLogger("twinkled").info("stopped")
    _exit_within(10.0)


def _log_start(cfg: Config, key_path: Path) -> None:
    """Where things are, once at start-up: what an operator looks for first."""
    import socket

    log = logging.getLogger("twinkled")
    host = cfg.host
    if host in ("0.0.0.0", "::", "", "*"):  # every interface: clients use a name
        host = socket.gethostname()
    host = f"[{host}]" if ":" in host else host
    url = f"http://{host}:{cfg.port}"
    log.info("data dir %s; admin key in %s (`twinkled ctl --data-dir %s ...` finds both)",
             cfg.data_dir, key_path, cfg.data_dir,
             extra={"data_dir": str(cfg.data_dir), "admin_key_file": str(key_path)})
    log.info("listening on %s:%d: Tinker base_url %s, OpenAI base_url %s/oai/api/v1; "
             "Ctrl+C or SIGTERM stops gracefully (drain, persist adapters)", cfg.host,
             cfg.port, url, url, extra={"tinker_base_url": url,
                                        "openai_base_url": f"{url}/oai/api/v1"})


def _refuse_busy_port(host: str, port: int) -> None:
    """A port another process listens on: one line and exit 2, before the model loads
    (aiohttp would find out only after start-up, with a long traceback)."""
    import socket
    import sys

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as e:
        click.echo(f"Error: cannot listen on {host}:{port}: {e.strerror or e}", err=True)
        sys.exit(2)
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
            try:
                s.bind(addr)
            except OSError as e:
                click.echo(f"Error: cannot listen on {host}:{port}: {e.strerror or e} "
                           f"(another twinkled? pick another --port)", err=True)
                sys.exit(2)


def _exit_within(seconds: float) -> None:
    """Everything is persisted by now; if some thread still holds the interpreter open,
    say which (stack dump in the log) and exit anyway, so that a stop never waits for a
    SIGKILL."""
    import faulthandler
    import os
    import sys
    import threading

    def stuck() -> None:
        logging.getLogger("twinkled").error("exit held up for %.0f s by a thread; stacks:",
                                            seconds)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(0)

    timer = threading.Timer(seconds, stuck)
    timer.daemon = True
    timer.start()


main.add_command(ctl)


@main.command()
@click.option("--join", "join", required=True, metavar="tcp://HEAD:PORT",
              help="The daemon's join_listen address, as this host reaches it.")
@click.option("--devices", required=True, help="This host's ranks, comma-separated: "
              "cuda:0,cuda:1 or cpu,cpu.")
@click.option("--token-file", type=click.Path(path_type=Path, dir_okay=False),
              default=Path("/etc/twinkle/join.key"), show_default=True,
              help="A copy of the daemon's join token (join_token_file).")
@click.option("--model", help="The model directory on this host (default: the daemon's "
              "path, which must then exist here too).")
@click.option("--name", help="This host's name in `twinkled ctl status` (default: hostname).")
@click.option("--lanes", type=click.IntRange(min=0), default=0, show_default=True,
              help="Bring the devices as this many lanes (equal slices, one worker group "
              "each, on which the daemon places runs); 0: as ranks of the daemon's group.")
def worker(join, devices, token_file, model, name, lanes) -> None:
    """Join a daemon from another host: run the ranks or lanes it assigns here."""
    import re
    import sys

    from twinkled.workers.host import main as agent
    from twinkled.workers.join import split_endpoint

    names = [d.strip() for d in devices.split(",") if d.strip()]
    if not names or any(not re.fullmatch(r"cpu|cuda:\d+", d) for d in names):
        raise click.UsageError(f"--devices must list cpu or cuda:N, got {devices!r}")
    if lanes and len(names) % lanes:
        raise click.UsageError(f"--lanes {lanes} does not divide the {len(names)} devices")
    try:
        split_endpoint(join)
    except ValueError as e:
        raise click.UsageError(f"--join: {e}") from None
    try:
        code = agent(join, names, token_file, model, name, lanes)
    except (OSError, ValueError) as e:  # an unreadable or short token file
        raise click.ClickException(str(e)) from None
    sys.exit(code)


@main.group()
def config() -> None:
    """Configuration files."""


@config.command("check")
@click.argument("file", type=click.Path(path_type=Path))
def config_check(file: Path) -> None:
    """Validate a TOML config: print each bad key and why (exit 1), or "ok"."""
    from twinkled.protocol.config import check_config

    problems = check_config(file)
    for p in problems:
        click.echo(f"{file}: {p}")
    if problems:
        raise SystemExit(1)
    click.echo("ok")
