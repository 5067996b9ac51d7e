"""`twinkled ctl`: administer a daemon. A thin layer over admin.py: each command calls one
admin method, on the running daemon through its admin endpoint, or (when none answers) on
the data directory itself, and prints a table or, with --json, the raw result."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import click

from twinkled.protocol.config import default_data_dir
from twinkled.server.admin import Admin, AdminError, admin_key_path
from twinkled.server.perms import private_dir, private_umask

QUOTAS = ("max_queued_requests", "max_queued_tokens", "max_adapters", "max_rank",
          "max_full_runs")


class Target:
    """Where ctl's commands go: the daemon's admin endpoint, else the data dir."""

    def __init__(self, data_dir: Path, url: str | None, admin_key: str | None,
                 create: bool = False):
        self.data_dir = data_dir
        self.create = create
        self.answered = ""  # where the last command ran: the daemon's URL, or the data dir
        info = data_dir / "daemon.json"
        if url is None and info.is_file():
            url = json.loads(info.read_text()).get("url")
        self.url = url
        self.admin_key = admin_key

    def call(self, command: str, **args):
        args = {k: v for k, v in args.items() if v is not None}
        if self.url:
            try:
                result = self._http(command, args)
                self.answered = f"the daemon at {self.url}"
                return result
            except urllib.error.URLError as e:
                if not isinstance(getattr(e, "reason", None), ConnectionRefusedError):
                    raise click.ClickException(f"daemon at {self.url}: {e.reason}") from None
        from twinkled.store import Store  # no daemon answers: the data dir itself

        if not (self.data_dir / "twinkle.db").is_file() and not self.create:
            # A mistyped --data-dir (or none) would make a fresh database, and a key made
            # there is one no daemon accepts.
            raise click.ClickException(
                f"no twinkled data dir at {self.data_dir} (no twinkle.db), and no daemon "
                f"answers: pass the daemon's --data-dir (or --url), or `twinkled ctl "
                f"--data-dir {self.data_dir} --create ...` to start a new one")
        self.answered = f"data dir {self.data_dir}"
        private_dir(self.data_dir)
        store = Store(self.data_dir / "twinkle.db")
        try:
            return Admin(store, self.data_dir).run(command, args)
        except AdminError as e:
            raise click.ClickException(str(e)) from None
        finally:
            store.close()

    def _http(self, command: str, args: dict):
        key = self.admin_key
        if key is None:
            path = admin_key_path(self.data_dir)
            if not path.is_file():
                raise click.ClickException(f"the daemon at {self.url} needs the admin key: "
                                           f"--admin-key, TWINKLE_ADMIN_KEY, or {path}")
            key = path.read_text().strip()
        req = urllib.request.Request(f"{self.url}/admin/v1/{command}",
                                     data=json.dumps(args).encode(), method="POST",
                                     headers={"X-Admin-Key": key,
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=900) as r:
                return json.loads(r.read())["result"]
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["detail"]
            except (ValueError, KeyError):
                pass
            raise click.ClickException(f"{command}: {detail} (HTTP {e.code})") from None


def _out(result, as_json: bool, render) -> None:
    if as_json:
        click.echo(json.dumps(result))
    else:
        render(result)


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


PREFIX = 12  # characters of a key's hash shown in `keys list`
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.group()
@click.option("--data-dir", type=click.Path(path_type=Path), default=default_data_dir(),
              show_default=True, help="The daemon's data directory.")
@click.option("--url", envvar="TWINKLE_URL", help="The daemon (default: from the data dir).")
@click.option("--admin-key", envvar="TWINKLE_ADMIN_KEY",
              help="Admin key (default: <data-dir>/admin.key).")
@click.option("--create", is_flag=True,
              help="Start a new data dir if there is none (without it, ctl refuses one "
              "that holds no twinkle.db).")
@click.pass_context
def ctl(ctx, data_dir: Path, url: str | None, admin_key: str | None, create: bool) -> None:
    """Administer a daemon: through its admin endpoint, or its data dir when it is down."""
    old = private_umask()  # what ctl writes in the data dir is private too (0600 / 0700)
    ctx.call_on_close(lambda: os.umask(old))  # ctl called in-process leaves no trace
    ctx.obj = Target(data_dir, url, admin_key, create)


@ctl.group()
def keys() -> None:
    """API keys: one key maps to one tenant."""


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant the key belongs to.")
@json_option
@click.pass_obj
def keys_create(target: Target, tenant: str, as_json: bool) -> None:
    """Create a key; it is printed once, alone on the last line (only a hash is stored)."""
    r = target.call("keys_create", tenant=tenant)
    _out(r, as_json, lambda r: click.echo(
        f"created a key for tenant {tenant!r} in {target.answered}; keep it, it is not shown "
        f"again:\n{r['key']}"))


@keys.command("list")
@click.option("--tenant", help="Only this tenant's keys.")
@json_option
@click.pass_obj
def keys_list(target: Target, tenant: str | None, as_json: bool) -> None:
    """Keys by hash prefix (never the keys), tenant, creation and revocation time."""
    def render(rows):
        click.echo(f"{'key':<{PREFIX}}  {'tenant':<16} {'created':<20}  state")
        for r in rows:
            state = f"revoked {_when(r['revoked_at'])}" if r["revoked_at"] else "active"
            click.echo(f"{r['key_prefix']:<{PREFIX}}  {r['tenant']:<16} {_when(r['created'])}  "
                       f"{state}")
    _out(target.call("keys_list", tenant=tenant), as_json, render)


@keys.command("revoke")
@click.argument("key")
@json_option
@click.pass_obj
def keys_revoke(target: Target, key: str, as_json: bool) -> None:
    """Revoke KEY (the full tml-... key or its hash prefix); its next request gets a 401."""
    _out(target.call("keys_revoke", key=key), as_json, lambda r: click.echo("revoked"))


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
@click.option("--max-full-runs", type=int,
              help="Full-parameter runs (rank 0, a lane each) at once.")
@click.option("--max-storage-bytes", type=int,
              help="Checkpoint + metadata bytes; -1: no limit (0: back to the default).")
@json_option
@click.pass_obj
def tenants_set(target: Target, name: str, weight, as_json: bool, **limits) -> None:
    """Set a tenant's weight and quotas (0 clears a quota); applied at once."""
    if weight is not None and weight <= 0:
        raise click.BadParameter("must be positive", param_hint="--weight")
    row = target.call("tenants_set", name=name, weight=weight, **limits)
    _out(row, as_json, lambda r: click.echo(json.dumps(r)))


@tenants.command("list")
@json_option
@click.pass_obj
def tenants_list(target: Target, as_json: bool) -> None:
    """Tenants with their weights, quotas and storage used (checkpoints + metadata)."""
    def render(rows):
        click.echo(f"{'tenant':<20} {'weight':<6} {'storage used':<32} quotas")
        for r in rows:
            quotas = ", ".join(f"{k}={r.get(k)}" for k in QUOTAS if r.get(k))
            used, quota = r.get("storage_used_bytes"), r.get("storage_quota_bytes")
            storage = ("-" if used is None else  # an older daemon does not count it
                       f"{_size(used)} of {_size(quota) if quota else 'unlimited'}")
            click.echo(f"{r['name']:<20} {r['weight']:<6g} {storage:<32} "
                       f"{quotas or 'no quotas'}")
    _out(target.call("tenants_list"), as_json, render)


@ctl.group()
def runs() -> None:
    """Training runs (one per adapter a client created)."""


@runs.command("list")
@click.option("--tenant", help="Only this tenant's runs.")
@json_option
@click.pass_obj
def runs_list(target: Target, tenant: str | None, as_json: bool) -> None:
    """Runs, newest first: id, tenant, rank, loaded or not, last request."""
    def render(rows):
        width = max([len("run")] + [len(r["id"]) for r in rows])
        click.echo(f"{'run':<{width}}  {'tenant':<16} {'rank':<4} {'loaded':<7}last request")
        for r in rows:
            live = "loaded" if r.get("live") else "-"
            click.echo(f"{r['id']:<{width}}  {r['tenant']:<16} {r['lora_rank']:<4} {live:<7}"
                       f"{_when(r['last_request_time'])}")
    _out(target.call("runs_list", tenant=tenant), as_json, render)


@runs.command("show")
@click.argument("run_id")
@json_option
@click.pass_obj
def runs_show(target: Target, run_id: str, as_json: bool) -> None:
    """One run with its LoRA config and checkpoints."""
    def render(r):
        for k in ("id", "tenant", "base_model", "lora_config", "live", "created"):
            click.echo(f"{k:<12} {_when(r[k]) if k == 'created' else r[k]}")
        for c in r["checkpoints"]:
            click.echo(f"  {c['tinker_path']}  {c['status']}  {_size(c['size_bytes'])}")
    _out(target.call("runs_show", run_id=run_id), as_json, render)


@runs.command("delete")
@click.argument("run_id")
@json_option
@click.pass_obj
def runs_delete(target: Target, run_id: str, as_json: bool) -> None:
    """Delete a run and unload its adapter (its checkpoints stay until deleted)."""
    _out(target.call("runs_delete", run_id=run_id), as_json,
         lambda r: click.echo(f"deleted {r['deleted']}; {r['checkpoints_kept']} checkpoint(s) kept"))


@ctl.group()
def checkpoints() -> None:
    """Checkpoints: list, verify against their recorded digests, delete."""


@checkpoints.command("list")
@click.option("--run", "run_id", metavar="RUN_ID", help="Only this training run's.")
@click.option("--tenant", help="Only this tenant's.")
@click.option("--status", type=click.Choice(["ready", "corrupt", "writing"]),
              help="Only checkpoints in this state (default: all).")
@json_option
@click.pass_obj
def checkpoints_list(target: Target, run_id, tenant, status, as_json: bool) -> None:
    """Checkpoints, newest first, with status, size, creation time and, if corrupt, why."""
    def render(rows):
        width = max([len("checkpoint")] + [len(r["tinker_path"]) for r in rows])
        click.echo(f"{'checkpoint':<{width}}  {'status':<7} {'size':>10}  created")
        for r in rows:
            line = (f"{r['tinker_path']:<{width}}  {r['status']:<7} "
                    f"{_size(r['size_bytes']):>10}  {_when(r['created'])}")
            if r["status"] != "ready" and r["error"]:
                line += f"  {r['error']}"
            click.echo(line)
    _out(target.call("checkpoints_list", run=run_id, tenant=tenant, status=status), as_json,
         render)


@checkpoints.command("verify")
@json_option
@click.pass_obj
def checkpoints_verify(target: Target, as_json: bool) -> None:
    """Re-hash ready checkpoints; move damaged ones to quarantine/ and mark them corrupt."""
    def render(damaged):
        for d in damaged:
            click.echo(f"{d['tinker_path']}: {d['reason']}")
        click.echo(f"{len(damaged)} damaged checkpoint(s) found" if damaged
                   else "all ready checkpoints are intact")
    _out(target.call("checkpoints_verify"), as_json, render)


@checkpoints.command("delete")
@click.argument("path")
@json_option
@click.pass_obj
def checkpoints_delete(target: Target, path: str, as_json: bool) -> None:
    """Delete a checkpoint (tinker://...) and its files."""
    _out(target.call("checkpoints_delete", path=path), as_json,
         lambda r: click.echo(f"deleted {r['deleted']}"))


@ctl.command()
@json_option
@click.pass_obj
def status(target: Target, as_json: bool) -> None:
    """Model, devices, workers and memory, queues, and each tenant's share."""
    def render(s):
        if not s.get("running", True):
            click.echo(f"NOT RUNNING: no daemon answers; last status written "
                       f"{s['age_seconds']} s ago:")
        click.echo(f"model {s['model']} ({s['state']}), {s['adapters']} adapters, "
                   f"{s['steps']} steps, {s.get('samples_running', 0)} samples decoding, "
                   f"worker restarts {s['restarts']}")
        for w in s["workers"]:
            where = f" on {w['host']}" if w.get("remote") else ""
            lane = f"lane {w['lane']} " if "lanes" in s else ""
            click.echo(f"  {lane}rank {w['rank']} {w['device']:<8}{where} pid {w['pid']}  "
                       f"{'alive' if w['alive'] else 'DOWN'}  memory {_size(w['memory_bytes'])}"
                       f" (peak {_size(w.get('peak_memory_bytes', 0))})")
        for lane in s.get("lanes", []):
            state = f"DOWN: {lane['down']}" if lane.get("down") else "up"
            t = lane.get("tiers") or {}
            host = (f", {t['host']} parked in host memory ({_size(t['host_bytes'])} of "
                    f"{_size(t['host_budget'])})" if t.get("host_budget") else "")
            click.echo(f"  lane {lane['lane']} on {lane.get('host', '?')} "
                       f"({', '.join(lane['devices'])}): {state}, {lane['adapters']} adapters, "
                       f"{lane['queued_requests']} queued{host}"
                       + (", long lane (long-context runs)" if lane.get("long") else ""))
        if tiers := s.get("tiers"):
            moves = tiers.get("moves", {})
            click.echo(f"adapters: {tiers['gpu']} in GPU banks, {tiers['host']} in host memory;"
                       f" moves to host {moves.get('to_host', 0)}, to disk "
                       f"{moves.get('to_disk', 0)}, back from host {moves.get('from_host', 0)}, "
                       f"from disk {moves.get('from_disk', 0)} ({_size(tiers['moved_bytes'])});"
                       f" churn {tiers.get('churn', 0)}; new runs started parked "
                       f"{tiers.get('started_parked', 0)}")
        for held in s.get("full_runs", []):
            click.echo(f"  lane {held['lane']} held by the full-parameter run {held['run']} "
                       f"of tenant {held['tenant']} (no LoRA runs or base-model samples there)")
        gap = s.get("logprob_gap") or {}
        if gap.get("mean") is not None:
            click.echo(f"logprob gap, sampler vs trainer: mean {gap['mean']:.2g}, max "
                       f"{gap['max']:.2g} nats/token over the last {gap['window']} checked "
                       f"samples ({gap['checked']} in all)")
        for d in s.get("damaged_checkpoints", []):
            click.echo(f"  damaged checkpoint {d['tinker_path']}: {d['reason']}")
        # share: of all training time; contended: of the steps that left work waiting,
        # the split the weights decide (docs/operator.md).
        click.echo(f"{'tenant':<16}{'weight':>7}{'queued':>8}{'tokens':>9}{'paused':>8}"
                   f"{'served':>12}{'share':>8}{'contended':>11}")
        for name, t in s["tenants"].items():
            contended = t.get("contended_share")
            click.echo(f"{name:<16}{t['weight']:>7g}{t['queued_requests']:>8}"
                       f"{t['queued_tokens']:>9}{t['paused']:>8}{t['served_tokens']:>12}"
                       f"{t['share']:>8.1%}"
                       f"{'-' if contended is None else format(contended, '.1%'):>11}")
    _out(target.call("status"), as_json, render)


@ctl.command()
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for queued work.")
@click.option("--undo", is_flag=True, help="Take new work again.")
@json_option
@click.pass_obj
def drain(target: Target, timeout: float, undo: bool, as_json: bool) -> None:
    """Stop taking new work (clients get 503 and retry) and wait for queued work to finish."""
    def render(r):
        click.echo("taking work again" if undo else
                    "drained: nothing queued or running" if r["drained"] else
                    f"still busy after {timeout:g} s: {r['queued']} queued")
    _out(target.call("drain", timeout=timeout, undo=undo or None), as_json, render)


