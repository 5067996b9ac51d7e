"""Where a bench writes its section: bench/results/ (ignored by git), one file per run.

BENCHMARKS.md is curated by hand from these files, newest first; no bench writes to it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def emit(text: str, path: str) -> None:
    """Print a bench's section and write it to `path` ('' : print only)."""
    print(text)
    if path:
        Path(path).write_text(text)
        print(f"written to {path}")


def section_path(name: str) -> str:
    """bench/results/<name>-<UTC time>.md (the folder is made when missing)."""
    RESULTS.mkdir(exist_ok=True)
    return str(RESULTS / f"{name}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}.md")
