"""Atomic file writes: write a temporary file beside the target, flush it to disk, then rename over it.

A reader (or a crash, or Ctrl-C) sees either the old complete file or the new complete file, never a torn one.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatch
from pathlib import Path, PurePath
from typing import Any, BinaryIO

from unsparse.strict_json import dumps_strict

_PREFIX_BYTES = 200
"""The most bytes of the target's name that the temporary file's name repeats: with the dot before and after, the
random part and ``.tmp``, the temporary name stays within the 255 bytes a file name may have (NAME_MAX)."""


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(file)`` on a temporary file in ``path``'s folder, fsync it, and rename it to ``path``.

    The folder is created if missing. Where ``path`` is a symbolic link, the file it points to (followed to the
    end of a chain of links, and created if missing) is replaced atomically and the link stays. The file gets the
    permissions of the file it replaces, or those a new file gets under the process's umask (``mkstemp`` alone
    would leave it readable by its owner only). The temporary file is named after the target (the first
    ``_PREFIX_BYTES`` bytes of its name, so that a name of up to 255 bytes can be written). On any exception the
    temporary file is removed and ``path`` is left untouched.

    Returns:
        ``path`` as a Path (the link, where it is one).

    Raises:
        OSError: from the file system, e.g. where ``path`` is a folder or its folder cannot be created.
        KeyboardInterrupt: where Ctrl-C arrived during ``write``, also when ``write`` then failed while unwinding
            (``torch.save`` interrupted mid-record raised RuntimeError "unexpected pos" from its zip writer's
            cleanup, so the interruption read as a failed job: a Hydra sweep went on with its next job).
    """
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{_name_prefix(target.name)}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(handle, _file_mode(target))
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        interrupt = interruption(error)
        if interrupt is not None and interrupt is not error:
            raise interrupt from None
        raise
    return path


def interruption(error: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that ``error`` is, or that it was raised while handling (its ``__context__`` chain),
    else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return current
        seen.add(id(current))
        current = current.__context__
    return None


_TEMPORARY_NAME = re.compile(r"\.(.+)\.[a-z0-9_]{8}\.tmp")
"""Names :func:`atomic_write` gives its temporary files: ``.<target name>.<mkstemp's 8 characters>.tmp``."""


def remove_stale_temporaries(folder: str | Path, targets: Iterable[str], older_than_s: float | None = None
                             ) -> list[Path]:
    """Delete the temporary files :func:`atomic_write` left for the files ``targets`` names (glob patterns relative
    to ``folder``, e.g. ``"prune/*.pt"``) when its process was killed between creating one and renaming it (SIGKILL,
    power loss; an exception removes its own), whatever their age, or with ``older_than_s`` only those last modified
    more than that many seconds ago (a time in the future, from clock skew, reads as new). Other files
    are left, also ones named like temporary files of other targets, and links. Call it only while no other process
    writes those targets (e.g. under a job's folder lock), or with an age no live write can reach (a shared cache):
    another writer's temporary file would be deleted under it.

    Returns:
        The files removed, sorted.
    """
    removed = set()
    now = time.time()
    for pattern in targets:
        name = PurePath(pattern).name
        for path in (Path(folder) / pattern).parent.glob(f".{name}.*.tmp"):
            match = _TEMPORARY_NAME.fullmatch(path.name)
            if match and fnmatch(match.group(1), name) and path.is_file() and not path.is_symlink():
                try:
                    if older_than_s is None or now - path.stat().st_mtime > older_than_s:
                        removed.add(path)
                except FileNotFoundError:  # renamed into place by a writer meanwhile
                    continue
    for path in removed:
        path.unlink(missing_ok=True)
    return sorted(removed)


def _name_prefix(name: str) -> str:
    """``name`` cut to at most :data:`_PREFIX_BYTES` bytes in the file-system encoding, at a character boundary."""
    while len(os.fsencode(name)) > _PREFIX_BYTES:
        name = name[:-1]
    return name


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


def write_record(folder: str | Path, record: Mapping[str, str] | None) -> None:
    """Write a job's record into ``folder``, each file atomically (relative path -> UTF-8 text, e.g. the command
    line's composed config as ``.hydra/config.yaml``), and log each file's content (logger ``unsparse.atomic``), so
    the job's log holds it too. Called once a job is accepted, so a refused job writes no record. None writes
    nothing.

    Raises:
        OSError: as :func:`atomic_write`.
    """
    for name, text in (record or {}).items():
        atomic_write_text(Path(folder) / name, text)
        logging.getLogger(__name__).info("%s:\n%s", name, text)


def atomic_write_json(path: str | Path, data: Any) -> Path:
    """Atomically replace ``path`` with ``data`` as indented strict JSON: NaN is written as ``null`` and an infinity
    as the number ``1e999`` (``-1e999``), which :func:`~unsparse.strict_json.loads_strict` reads back as that
    infinity (:func:`~unsparse.strict_json.dumps_strict` with ``infinities``; Python's ``json`` writes ``NaN`` and
    ``Infinity``, which strict readers refuse, and ``null`` would read back as "not measured").

    Raises:
        TypeError, ValueError: from :func:`~unsparse.strict_json.dumps_strict`, before ``path`` is touched.
        OSError: as :func:`atomic_write`.
    """
    return atomic_write_text(path, dumps_strict(data, infinities=True, indent=2, sort_keys=False) + "\n")
