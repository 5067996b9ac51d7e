"""The errors every layer raises and the door turns into answers (standard library only)."""

from __future__ import annotations


class UserError(ValueError):
    """The client's fault: answered as a 4xx at submit, or as category "user" later."""


class Draining(Exception):
    """The daemon is stopping (hot restart): come back shortly (HTTP 503, retried)."""


class NotFound(UserError):
    pass


class Conflict(ValueError):
    """A row with this id already exists (for example a repeated create_model)."""


class QuotaExceeded(UserError):
    """The tenant's storage (checkpoint files + stored user_metadata) is at its quota."""


# What a worker's refusal of a park for want of host memory says (workers/parked.py); the
# daemon then makes room there and tries again (core/residency.py)
HOST_ROOM = "no room in this worker's host memory"
