"""The daemon's one SQLite connection (WAL, through ``sqlite-utils``) and the few ways the
store's table objects use it: read rows, run one write, hold a transaction, page a table.

The table objects (store_*.py) each hold the same ``Db``; its lock makes the connection
safe to share between the event loop and helper threads.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from twinkled.protocol.errors import Conflict
from twinkled.store.schema import INDEXES, SCHEMA, Row, decode_row


def _import_sqlite_utils():
    """sqlite-utils, imported without pandas and numpy where neither is loaded yet. It
    imports both when they are installed, only to map their scalar types (numpy.int64,
    pandas.Timestamp) to column types; the store's columns are str, int and float (schema.py)
    and the values it hands sqlite-utils plain Python, so it never needs them, and they cost
    every daemon, host agent and `twinkled ctl` ~0.4 s of CPU at start (pandas pulls in
    pyarrow). Where they are loaded already (a worker, a test process), sqlite-utils gets
    them as usual."""
    blocked = [name for name in ("pandas", "numpy") if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # `import name` raises ImportError: sqlite-utils does without
    try:
        import sqlite_utils
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    return sqlite_utils


sqlite_utils = _import_sqlite_utils()


class Db:
    """One connection and one lock. Safe to share between threads."""

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by the event loop and any helper threads; the lock
        # serialises its use, so check_same_thread can be off.
        self.conn = sqlite3.connect(path, check_same_thread=False, timeout=10.0)
        self.sqlite = sqlite_utils.Database(self.conn)
        self._lock = threading.RLock()
        self.sqlite.enable_wal()
        # WAL + NORMAL: no corruption on power loss, at worst the last commits are lost;
        # avoids an fsync per future write.
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self._create_tables()

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def _create_tables(self) -> None:
        with self.transaction():
            for name, (columns, pk, defaults) in SCHEMA.items():
                table = self.sqlite.table(name)
                table.create(columns, pk=pk, defaults=defaults, if_not_exists=True)
                for col, kind in columns.items():  # a data dir from an older release
                    if col not in table.columns_dict:
                        table.add_column(col, kind)
            for table, cols, unique in INDEXES:
                self.sqlite.table(table).create_index(cols, unique=unique, if_not_exists=True)

    def all(self, sql: str, params: Any = ()) -> list[Row]:
        """Every row of a query, as dicts with JSON columns decoded and flags as bools."""
        with self._lock:
            cur = self.conn.execute(sql, params)
            cols = [d[0] for d in cur.description]
            return [decode_row(dict(zip(cols, r, strict=True))) for r in cur.fetchall()]

    def one(self, sql: str, params: Any = ()) -> Row | None:
        rows = self.all(sql, params)
        return rows[0] if rows else None

    def write(self, sql: str, params: Any = ()) -> int:
        """Run one statement in its own transaction; returns the number of rows changed."""
        with self.transaction() as conn:
            return conn.execute(sql, params).rowcount

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Statements that commit together (or roll back together); nested ones become
        savepoints. Holds the lock, so no other thread's statement lands in between."""
        with self._lock, self.sqlite.atomic():
            yield self.conn

    @contextlib.contextmanager
    def immediate(self) -> Iterator[sqlite3.Connection]:
        """One write transaction that holds SQLite's write lock from its first statement
        (BEGIN IMMEDIATE), so a check and the write that depends on it are atomic, also
        against other processes on the same file (`twinkled ctl` beside the daemon)."""
        with self._lock:
            if self.conn.in_transaction:  # nested: the outer transaction holds the lock
                with self.sqlite.atomic():
                    yield self.conn
                return
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.rollback()
                raise
            self.conn.execute("COMMIT")

    def insert(self, table: str, row: Row) -> None:
        """Insert one row; a duplicate key is a ``Conflict`` (the caller answers 409)."""
        with self._lock:
            try:
                self.sqlite.table(table).insert(row)
            except sqlite3.IntegrityError as e:
                raise Conflict(f"{table}: {e}") from e

    def page(self, where: str, params: list, table: str, offset: int, limit: int,
             order: str = "created DESC, rowid DESC") -> tuple[list[Row], int]:
        """One page of rows (newest first by default) and the total count."""
        with self._lock:  # count and page from the same state
            total = self.one(f"SELECT count(*) AS n FROM {table} WHERE {where}", params)
            rows = self.all(f"SELECT * FROM {table} WHERE {where} ORDER BY {order} "
                            "LIMIT ? OFFSET ?", [*params, limit, offset])
        return rows, total["n"]  # type: ignore[index]
