"""Benchmark result files as committed under ``benchmarks/results/``.

``scripts/gpu_check.py`` writes ``bench.json`` on the GPU machine; large ones are committed xz-compressed
(``<name>.json.xz``, ``xz -9e``; ``xz -dk`` restores ``<name>.json``), which keeps the tree that travels to the
device machine under its 64 MiB limit. Readers take either form.
"""

from __future__ import annotations

import lzma
from pathlib import Path
from typing import Any

from unsparse.strict_json import loads_strict

SUFFIXES = (".json.xz", ".json")
"""File endings of a benchmark result: compressed or plain JSON."""


def result_stem(path: str | Path) -> Path:
    """``path`` without its result ending (``a/b.json.xz`` and ``a/b.json`` -> ``a/b``), for the files written
    beside it.

    Raises:
        ValueError: naming the path, if it ends in neither of :data:`SUFFIXES`.
    """
    path = Path(path)
    for suffix in SUFFIXES:
        if path.name.endswith(suffix):
            return path.with_name(path.name[: -len(suffix)])
    raise ValueError(f"result path: {path} ends in neither of {SUFFIXES}")


def beside(stem: str | Path, suffix: str) -> Path:
    """``stem`` with ``suffix`` appended (``a/run_s0.9`` + ``.md`` -> ``a/run_s0.9.md``): unlike
    ``Path.with_suffix``, a dot inside the name (a sparsity) is kept."""
    stem = Path(stem)
    return stem.with_name(stem.name + suffix)


def load_result(path: str | Path, strict: bool = True) -> dict[str, Any]:
    """The JSON object in a result file, plain or xz-compressed.

    Layer records written before the twelfth session have no ``baseline``: their ``speedup_vs_cudnn`` was against
    the ``cudnn`` backend as an NCHW model calls it. They are read with that figure moved to
    ``speedup_vs_cudnn_call`` and ``speedup_vs_cudnn`` None, so that no report takes it for a speedup over
    cuDNN's convolution alone in its best layout (:mod:`unsparse.runtime.baseline`).

    ``strict``: refuse NaN and Infinity, which ``bench.json`` never holds (unmeasured values are null); pass False
    for files whose values may be infinite by design (a pruning table's evolutionary history records a diverged
    iteration's change as -Infinity).

    Raises:
        ValueError: naming the file, for another file ending, a broken xz stream, content that is not UTF-8, text
            that is not JSON (strict JSON where ``strict``), or content that is not a JSON object.
        OSError: from reading the file (missing, a folder).
    """
    path = Path(path)
    result_stem(path)
    try:
        if path.name.endswith(".xz"):
            with lzma.open(path, "rt", encoding="utf-8") as handle:
                text = handle.read()
        else:
            text = path.read_text(encoding="utf-8")
    except (lzma.LZMAError, EOFError) as error:
        raise ValueError(f"result {path}: not a complete xz stream ({error})") from error
    except UnicodeDecodeError as error:
        raise ValueError(f"result {path}: not UTF-8 text ({error})") from error
    try:
        result = loads_strict(text, constants=not strict)
    except ValueError as error:
        raise ValueError(f"result {path}: not valid JSON ({error})") from error
    if not isinstance(result, dict):
        raise ValueError(f"result {path}: expected a JSON object, got {type(result).__name__}")
    for record in result.get("layers", []):
        if isinstance(record, dict) and "speedup_vs_cudnn" in record and "baseline" not in record:
            record["speedup_vs_cudnn_call"], record["speedup_vs_cudnn"] = record["speedup_vs_cudnn"], None
    return result
