"""Atomic file writes: write a temporary file beside the target, flush it to disk, then rename over it.

A reader (or a crash, or Ctrl-C) sees either the old complete file or the new complete file, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(file)`` on a temporary file in ``path``'s folder, fsync it, and rename it to ``path``.

    The folder is created if missing. The file gets the permissions of the file it replaces, or those a new file
    gets under the process's umask (``mkstemp`` alone would leave it readable by its owner only). On any exception
    the temporary file is removed and ``path`` is left untouched.

    Returns:
        ``path`` as a Path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(handle, _file_mode(path))
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def _file_mode(path: Path) -> int:
    """Permission bits for ``path``'s new content: the existing file's, else ``0o666`` less the umask."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask: from ``/proc/self/status`` on Linux, which reads it without changing it; elsewhere by
    setting and restoring it (a moment in which another thread's new files would get mode 0o666)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0)
        os.umask(umask)
        return umask


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Atomically replace ``path`` with ``data``."""
    return atomic_write(path, lambda file: file.write(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Atomically replace ``path`` with UTF-8 ``text``."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, data: Any) -> Path:
    """Atomically replace ``path`` with ``data`` as indented JSON."""
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")
