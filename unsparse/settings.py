"""Checks of settings (training, timing, pruners, quantizers, data, time series): each returns the value or raises
``ValueError`` naming it.

Bools are refused where a number is expected (``True`` is an ``int`` to Python) and numbers where a bool is. So are
numpy integers and float32 scalars: the settings go into JSON files (job records, file metadata), which take Python
numbers only (numpy's float64 is a Python float).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from unsparse.messages import quote


def check_quantile(quantile: float, field: str) -> float:
    """``quantile`` as a float if it is a number in ``(0, 1]``.

    Raises:
        ValueError: naming ``field`` otherwise.
    """
    if isinstance(quantile, bool) or not isinstance(quantile, int | float) or not 0 < quantile <= 1:
        raise ValueError(f"{field}: expected a number in (0, 1], got {quote(quantile)}")
    return float(quantile)


def check_number(value: float, field: str, valid: Callable[[float], bool], expected: str) -> float:
    """``value`` as a float if it is a number (not a bool) for which ``valid(value)`` holds; ``expected`` says
    which numbers, for the message (e.g. ``"> 0"``).

    Raises:
        ValueError: naming ``field`` otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not valid(value):
        raise ValueError(f"{field}: expected a number {expected}, got {quote(value)}")
    return float(value)


def check_integer(value: int, field: str, low: int | None = 1, high: int | None = None) -> int:
    """``value`` if it is an integer in ``[low, high]`` (no bound where ``low`` or ``high`` is None).

    Raises:
        ValueError: naming ``field`` otherwise.
    """
    if (isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low)
            or (high is not None and value > high)):
        bounds = (f" in [{low}, {high}]" if low is not None and high is not None else f" >= {low}" if low is not None
                  else f" <= {high}" if high is not None else "")
        raise ValueError(f"{field}: expected an integer{bounds}, got {quote(value)}")
    return value


SEED_MAX = 2**32 - 1
"""Largest seed :func:`check_seed` takes: seeds in ``[0, SEED_MAX]`` give torch's CPU generator distinct states."""


def check_seed(value: int) -> int:
    """``value`` if it is an integer in ``[0, 2^32)``: the seeds that torch's CPU generator tells apart.

    ``torch.manual_seed`` takes ``[-2^63, 2^64)`` (its own refusal is a ``RuntimeError``, "manual_seed expected a
    long", that names no setting), but reads a negative seed as its 64-bit two's complement (``-1`` as ``2^64 - 1``),
    and its CPU generator (mt19937) keeps only the low 32 bits of the seed (``2^32 + 5`` draws what ``5`` draws). The
    model's initial weights, the data's validation split, the training order and the evolutionary pruner's choices
    all draw from CPU generators, so a seed outside this range would name a job (its identity, which a resume must
    match) of its own whose run repeats another seed's.

    Raises:
        ValueError: naming ``seed``: a value that is no integer (a bool, a float, a string), or one outside
            ``[0, 2^32)``, with the seed in range it would alias.
    """
    try:
        return check_integer(value, "seed", low=0, high=SEED_MAX)
    except ValueError as error:
        if isinstance(value, bool) or not isinstance(value, int):
            raise
        raise ValueError(f"{error}: torch's CPU generator keeps a seed's low 32 bits (a negative seed read modulo "
                         f"2^64), so it would draw what seed {value % 2**32} draws") from None


def check_flag(value: bool, field: str) -> bool:
    """``value`` if it is a bool (a string such as ``"false"`` would be true to ``bool()``).

    Raises:
        ValueError: naming ``field`` otherwise.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{field}: expected a bool, got {quote(value)}")
    return value


def check_choice(value: Any, choices: Collection[str], field: str) -> str:
    """``value`` if it is one of the strings ``choices``.

    Raises:
        ValueError: naming ``field`` otherwise.
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{field}: expected one of {tuple(choices)}, got {quote(value)}")
    return value


def output_file(text: str) -> Path:
    """A file a script writes, given on its command line (an argparse ``type``): refused while the command line is
    read if it names an existing folder, which the write would fail on only after the work (training, timings).

    Raises:
        argparse.ArgumentTypeError: naming the folder.
    """
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; expected a file name (see --help for which file)")
    return path


def positive_integer_argument(text: str) -> int:
    """A count or size given on a command line (an argparse ``type``): an integer >= 1 (a batch, a number of runs, a
    stride). Checked while the command line is read, so argparse names the option before any GPU work.

    Raises:
        argparse.ArgumentTypeError: naming the value otherwise.
    """
    try:
        return check_integer(int(text), "value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None


def sparsity_argument(text: str) -> float:
    """A sparsity given on a command line (an argparse ``type``): a number in ``[0, 1)``, the range that magnitude
    pruning (:func:`unsparse.runtime.bench.magnitude_prune_`) and every pruner's target take (1 would prune every
    weight). Checked while the command line is read, so argparse names the option, instead of a traceback at the
    first setting of a GPU run that uses it.

    Raises:
        argparse.ArgumentTypeError: naming the value otherwise (NaN included).
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a sparsity in [0, 1), got {text!r}")
    return value


def generated_setting_argument(text: str, keys: Collection[str]) -> dict[str, int]:
    """A setting of the ``generated`` backend given on a command line (an argparse ``type``, through
    ``functools.partial`` for ``keys``), e.g. ``{"rows": 32, "programs": 4, "min_blocks": 3}``: a JSON object of
    ``keys`` with ``rows`` among them, each value an integer >= 1 (``min_blocks`` >= 0: 0 is no launch bound). Whether
    the backend offers the setting for a layer is the backend's check, when it runs
    (:meth:`~unsparse.runtime.backends.generated.GeneratedBackend.conv`).

    Raises:
        argparse.ArgumentTypeError: naming the entry and what is expected.
    """
    try:
        setting = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, an integer beyond Python's 4300 digits, or nested too deep
        raise argparse.ArgumentTypeError(f"setting {quote(text)}: not JSON") from None
    if (not isinstance(setting, dict) or "rows" not in setting or set(setting) - set(keys)
            or any(type(value) is not int or value < (0 if key == "min_blocks" else 1)
                   for key, value in setting.items())):
        raise argparse.ArgumentTypeError(f"setting {quote(text)}: expected an object of {sorted(keys)} with rows, "
                                         "positive integers (min_blocks >= 0)")
    return setting
