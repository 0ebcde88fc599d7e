"""Real time series shipped inside statsmodels' wheel (nothing downloads), cut into autoencoder windows.

Series (``statsmodels.api.datasets``): ``co2`` (weekly Mauna Loa CO2, 1958-2001, 2284 points, 59 gaps
filled by linear interpolation), ``sunspots`` (yearly, 1700-2008, 309 points), ``elnino`` (monthly sea
surface temperature, 1950-2010, 732 points). statsmodels is imported inside :func:`statsmodels_series` only.

Where statsmodels is missing (e.g. a GPU machine without network), :func:`export_series` writes a series to a
small text file here and ``timeseries(..., source=path)`` reads it back bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from unsparse.atomic import atomic_write_text
from unsparse.data import Splits, first_examples, spread
from unsparse.settings import check_integer, check_number

SERIES = ("co2", "sunspots", "elnino")


def statsmodels_series(name: str) -> torch.Tensor:
    """The named series as a ``(T,)`` float32 tensor in its original units, gaps interpolated.

    Raises:
        ValueError: unknown name.
        ImportError: statsmodels missing.
    """
    return torch.tensor(_statsmodels_values(name), dtype=torch.float32)


def _statsmodels_values(name: str) -> np.ndarray:
    """The named series as float64 values (see :func:`statsmodels_series`)."""
    if name not in SERIES:
        raise ValueError(f"series: unknown name {name!r}; known: {SERIES}")
    from statsmodels.api import datasets

    if name == "co2":
        values = datasets.co2.load_pandas().data["co2"].interpolate().to_numpy()
    elif name == "sunspots":
        values = datasets.sunspots.load_pandas().data["SUNACTIVITY"].to_numpy()
    else:
        values = datasets.elnino.load_pandas().data.drop(columns="YEAR").to_numpy().reshape(-1)
    return np.asarray(values, dtype=np.float64)


def export_series(name: str, path: str | Path) -> Path:
    """Write the named statsmodels series to ``path``, one float64 value a line (exact ``repr``).

    :func:`read_series` of the file equals :func:`statsmodels_series` of ``name`` exactly.

    Raises:
        ValueError: unknown name.
        ImportError: statsmodels missing.
    """
    return atomic_write_text(path, "".join(f"{float(value)!r}\n" for value in _statsmodels_values(name)))


def read_series(path: str | Path, field: str | None = None) -> torch.Tensor:
    """A series written by :func:`export_series` as a ``(T,)`` float32 tensor.

    Args:
        path: the file. field: the setting that named it (``data.source``), named before ``path`` in errors.

    Raises:
        ValueError: naming ``field`` (where given) and ``path``, where the file cannot be read (missing, a folder,
            not readable: the system's reason), is not UTF-8 text, a line is not a number, or a value is not finite
            in float32 (beyond about 3.4e38).
    """
    named = f"{field}: {path}" if field else str(path)
    try:
        values = np.array([float(word) for word in Path(path).read_text(encoding="utf-8").split()], dtype=np.float64)
    except OSError as error:  # FileNotFoundError, IsADirectoryError, PermissionError...
        raise ValueError(f"{named}: cannot be read ({error.strerror or error})") from error
    except ValueError as error:  # UnicodeDecodeError is one
        raise ValueError(f"{named}: not a series of numbers ({error})") from error
    series = torch.tensor(values, dtype=torch.float32)
    if not torch.isfinite(series).all():
        raise ValueError(f"{named}: series holds values that are not finite in float32")
    return series


def windows(series: torch.Tensor, length: int, stride: int, name: str = "series") -> torch.Tensor:
    """Overlapping windows ``(N, 1, length)`` of a ``(T,)`` series, each minus its own mean (level removed).

    Raises:
        ValueError: ``length`` below 2 (a one-point window levels to 0) or ``stride`` below 1, naming it; the series
            (``name``) shorter than ``length``.
    """
    check_integer(length, "window", low=2)
    check_integer(stride, "stride")
    if len(series) < length:
        raise ValueError(f"{name}: {len(series)} points, shorter than the window of {length}")
    cut = series.unfold(0, length, stride)
    return (cut - cut.mean(dim=1, keepdim=True)).unsqueeze(1)


def timeseries(name: str = "co2", window: int = 64, stride: int = 4, val_fraction: float = 0.15,
               test_fraction: float = 0.15, source: str | Path | None = None, limit_train: int | None = None,
               limit_test: int | None = None, source_field: str = "data.source") -> Splits:
    """Chronological train / val / test windows of a statsmodels series for reconstruction.

    The series is split in time first (no window crosses a split), windowed, levelled per window and scaled by
    the training windows' standard deviation. Inputs and targets are the same ``(N, 1, window)`` float32
    tensor, so ``Trainer(loss="mse")`` trains an autoencoder; ``num_classes`` is 0.

    Args:
        source: a file written by :func:`export_series` to read instead of statsmodels (``name`` then only
            names the splits); its errors name it as ``source_field``.
        limit_train, limit_test: keep only the first N train / (validation and test) windows (smoke runs); the
            scale is taken from the windows kept.
        source_field: the setting that gave ``source``, as its errors name it: ``data.source`` in the job's config
            (which leaves this parameter at its default), a script's option (``--series-file``).

    Raises:
        ValueError: unknown series, fractions that are no numbers in (0, 1) or sum to 1 or more, a window below 2
            or stride below 1, a split shorter than ``window`` (naming the split), a limit that is no integer or
            below 1, naming it, constant training windows (nothing to scale by), or a ``source`` that cannot be
            read or is no series of finite numbers (:func:`read_series`), naming ``source_field`` and the file.
    """
    for field, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        check_number(fraction, field, lambda value: 0 < value < 1, "in (0, 1)")
    if val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction + test_fraction: {val_fraction + test_fraction} leaves no training points")
    series = statsmodels_series(name) if source is None else read_series(source, source_field)
    test_start = round(len(series) * (1.0 - test_fraction))
    val_start = round(len(series) * (1.0 - test_fraction - val_fraction))
    parts = {"train": series[:val_start], "val": series[val_start:test_start], "test": series[test_start:]}
    limits = {"train": (limit_train, "limit_train"), "val": (limit_test, "limit_test"),
              "test": (limit_test, "limit_test")}
    cut = {key: first_examples((windows(part, window, stride, f"{key} split"),) * 2, *limits[key])[0]
           for key, part in parts.items()}
    scale = spread(cut["train"], "training windows")[1]
    return Splits(**{key: (value / scale, value / scale) for key, value in cut.items()}, num_classes=0, name=name)
