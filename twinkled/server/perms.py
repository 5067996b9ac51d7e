"""Private by default: what `twinkled serve` and `twinkled ctl` write under the data dir is
readable by their user only, directories 0700 and files 0600.

Both set the process umask to 077 when they start (`private_umask`), so every file and
directory they create gets those modes, and so do the worker processes, which inherit the
umask from the daemon. The data dir itself is created 0700, or tightened to 0700 when it is
ours and looser (`private_dir`), with the files directly inside it; a data dir we cannot
tighten is logged as a warning, never a reason to stop.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
# What the daemon keeps directly in its data dir (tightened when an older release left
# them readable by others); anything else there is the operator's and left alone.
OWN_ENTRIES = frozenset({"twinkle.db", "twinkle.db-wal", "twinkle.db-shm", "daemon.json",
                         "admin.key", "live", "checkpoints", "quarantine"})

log = logging.getLogger("twinkled")


def private_umask() -> int:
    """New files 0600 and new directories 0700 from now on (children inherit it); returns
    the previous umask."""
    return os.umask(PRIVATE_UMASK)


def private_dir(path: Path | str) -> Path:
    """Create `path` (mode 0700, and any missing parents) if it is missing; if it exists,
    is ours and is open to group or others, chmod it to 0700. When it is ours, also take the
    group and other bits off the daemon's own entries directly inside it (`OWN_ENTRIES`:
    twinkle.db and its -wal/-shm, daemon.json, admin.key, live/, checkpoints/,
    quarantine/), which a data dir made by an older release has readable by others. Never
    raises for a mode it cannot change: it logs a warning and goes on."""
    path = Path(path)
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    try:
        st = path.stat()
    except OSError as e:
        log.warning("data dir %s: cannot stat it (%s); its permissions are not checked", path, e)
        return path
    if st.st_uid == os.geteuid():
        _tighten_entries(path)
    if not stat.S_IMODE(st.st_mode) & PRIVATE_UMASK:
        return path
    if st.st_uid != os.geteuid():
        log.warning("data dir %s is mode %04o and owned by uid %d, not by this user (%d): "
                    "other users may read it; make it 0700", path, stat.S_IMODE(st.st_mode),
                    st.st_uid, os.geteuid())
        return path
    try:
        os.chmod(path, DIR_MODE)
    except OSError as e:
        log.warning("data dir %s is mode %04o and could not be made 0700 (%s): other users "
                    "may read it", path, stat.S_IMODE(st.st_mode), e)
        return path
    log.warning("data dir %s was mode %04o; made it 0700", path, stat.S_IMODE(st.st_mode))
    return path


def _tighten_entries(path: Path) -> None:
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        if entry.name not in OWN_ENTRIES:  # only what the daemon itself keeps there
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if (stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid()
                    or not stat.S_IMODE(st.st_mode) & PRIVATE_UMASK):
                continue
            os.chmod(entry.path, stat.S_IMODE(st.st_mode) & ~PRIVATE_UMASK)
        except OSError as e:
            log.warning("%s: could not take the group and other permissions off (%s)",
                        entry.path, e)
