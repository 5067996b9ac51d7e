"""The admin commands' arguments as typed messages (msgspec), checked once at the door.

The admin endpoint (`POST /admin/v1/<command>`) and `twinkled ctl` working on the data
directory both pass through `parse`: a wrong type, an unknown argument or a value out of
range is an `AdminError` (HTTP 400) naming the argument, never a 500, and never a value
stored that breaks the tenant's next request later (a `max_rank` of "x").
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from twinkled.protocol.errors import UserError

# Quotas are SQLite integers: kept well inside 64 bits.
Quota = Annotated[int, Meta(ge=0, le=2**62)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]


class AdminError(UserError):
    """A refused admin command; the message says why (HTTP 400)."""


class Args(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class NoArgs(Args):
    pass


class KeysCreate(Args):
    tenant: Name


class KeysList(Args):
    tenant: Name | None = None


class KeysRevoke(Args):
    key: Name


class TenantsSet(Args):
    name: Name
    weight: Annotated[float, Meta(gt=0, le=1e6)] | None = None
    max_queued_requests: Quota | None = None
    max_queued_tokens: Quota | None = None
    max_adapters: Quota | None = None
    max_rank: Quota | None = None
    max_full_runs: Quota | None = None
    # Negative: no storage limit for this tenant.
    max_storage_bytes: Annotated[int, Meta(ge=-(2**62), le=2**62)] | None = None


class RunsList(Args):
    tenant: Name | None = None
    limit: Annotated[int, Meta(ge=1, le=100_000)] = 1000


class RunRef(Args):
    run_id: Name


class CheckpointsList(Args):
    run: Name | None = None
    tenant: Name | None = None
    status: Name | None = None


class CheckpointRef(Args):
    path: Annotated[str, Meta(min_length=1, max_length=4096)]


class Drain(Args):
    timeout: Annotated[float, Meta(ge=0, le=86400)] = 600.0
    undo: bool = False


ARGS: dict[str, type[Args]] = {
    "keys_create": KeysCreate, "keys_list": KeysList, "keys_revoke": KeysRevoke,
    "tenants_list": NoArgs, "tenants_set": TenantsSet, "runs_list": RunsList,
    "runs_show": RunRef, "runs_delete": RunRef, "checkpoints_list": CheckpointsList,
    "checkpoints_verify": NoArgs, "checkpoints_delete": CheckpointRef, "status": NoArgs,
    "drain": Drain,
}
COMMANDS = tuple(ARGS)
_AT = re.compile(r" - at `\$\.?([^`]*)`")


def _refused(command: str, e: Exception) -> AdminError:
    text = str(e)
    at = _AT.search(text)
    if at and at.group(1):
        text = f"argument {at.group(1)!r}: {text[:at.start()]}"
    return AdminError(f"{command}: {text}")


def parse(command: str, args: dict[str, Any] | bytes) -> dict[str, Any]:
    """The command's arguments, typed and in range, as keyword arguments (a JSON body's
    bytes, or a dict from ctl); an AdminError naming what does not fit."""
    if command not in ARGS:
        raise AdminError(f"unknown admin command {command!r}; known: {', '.join(COMMANDS)}")
    kind = ARGS[command]
    try:
        if isinstance(args, bytes):
            value = msgspec.json.decode(args or b"{}", type=kind)
        else:
            value = msgspec.convert(args, kind)
    except msgspec.ValidationError as e:
        raise _refused(command, e) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        raise AdminError("the body must be a JSON object of arguments") from None
    return msgspec.structs.asdict(value)
