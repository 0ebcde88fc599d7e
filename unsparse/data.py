"""Real data sets, read from local files only (nothing downloads at run time).

- Fashion-MNIST from Debian's package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``),
  read through ``torchvision.datasets.FashionMNIST``.
- scikit-learn's ``load_digits`` (8x8 digits shipped inside scikit-learn), upsampled to 28x28.

Images come out as ``(N, 1, 28, 28)`` float32 tensors normalised to zero mean / unit variance of the
training split, labels as ``(N,)`` int64.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import lzma
import math
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from unsparse.atomic import atomic_write, remove_stale_temporaries
from unsparse.settings import check_integer, check_seed

log = logging.getLogger(__name__)

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                       "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
STALE_CACHE_WRITE_S = 3600.0
"""Age (seconds since last written) after which a temporary file in the data cache is taken for one a killed process
left: the cache is shared by concurrent jobs, and a live copy of a file (at most 47 MB) is written in seconds."""
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")


class DatasetUnavailableError(FileNotFoundError):
    """A data set's local files are missing; the message says how to install them."""


@dataclass
class Splits:
    """Train / validation / test tensors of one data set.

    Attributes:
        train, val, test: ``(images (N, 1, 28, 28) float32, labels (N,) int64)`` pairs, or for a time series
            ``(windows (N, 1, T) float32, the same windows)`` (:func:`unsparse.timeseries.timeseries`).
        num_classes: number of labels; 0 for a time series (reconstruction, :mod:`unsparse.task`).
        name: data set name.
    """

    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    num_classes: int
    name: str

    def loaders(self, batch_size: int, eval_batch_size: int = 1000, seed: int = 0) -> dict[str, DataLoader]:
        """``{"train", "val", "test"}`` loaders; only train shuffles (with a generator seeded by ``seed``)."""
        generator = torch.Generator().manual_seed(seed)
        return {
            "train": DataLoader(TensorDataset(*self.train), batch_size=batch_size, shuffle=True, generator=generator),
            "val": DataLoader(TensorDataset(*self.val), batch_size=eval_batch_size),
            "test": DataLoader(TensorDataset(*self.test), batch_size=eval_batch_size),
        }


def _cache_dir() -> Path:
    return Path(os.environ.get("UNSPARSE_CACHE", Path.home() / ".cache" / "unsparse"))


def check_idx(data: bytes, name: str, ndim: int | None = None) -> bytes:
    """``data`` if it is a complete idx file of unsigned bytes (the MNIST format: magic ``0x0000 08 nd``, ``nd``
    big-endian int32 dimensions, then their product in bytes), of ``ndim`` dimensions where given (3 for images,
    1 for labels), holding at least one value.

    Raises:
        ValueError: naming ``name``, for another magic number, another number of dimensions (a labels file in an
            images file's place), a length that disagrees with the dimensions (a truncated or corrupt file,
            which torchvision would report as a tensor shape error), or a dimension of 0 (no images or labels,
            which torchvision fails to read with an error naming no file).
    """
    if len(data) < 4 or data[:3] != b"\x00\x00\x08" or not 1 <= data[3] <= 4:
        raise ValueError(f"{name}: not an idx file of unsigned bytes (header {data[:4].hex()})")
    stored = data[3]
    if ndim is not None and stored != ndim:
        raise ValueError(f"{name}: {stored} dimensions, expected {ndim}")
    dims = struct.unpack(f">{stored}I", data[4:4 + 4 * stored]) if len(data) >= 4 + 4 * stored else ()
    expected = 4 + 4 * stored + math.prod(dims) if dims else None
    if expected != len(data):
        raise ValueError(f"{name}: {len(data)} bytes, but its header {dims} needs {expected} (truncated or corrupt)")
    if 0 in dims:
        raise ValueError(f"{name}: its header {dims} holds no values (no images or labels)")
    return data


def fashion_mnist_sources(source: Path) -> dict[str, tuple[Path, Callable[..., Any]]]:
    """Per name of :data:`FASHION_MNIST_FILES`, the file in ``source`` that holds it (``.gz``, ``.xz`` or plain, in
    that order of preference) and the function that opens it.

    Raises:
        DatasetUnavailableError: if a file is missing from ``source``.
    """
    found = {}
    for name in FASHION_MNIST_FILES:
        candidates = ((source / f"{name}.gz", gzip.open), (source / f"{name}.xz", lzma.open), (source / name, open))
        present = [(path, opener) for path, opener in candidates if path.exists()]
        if not present:
            raise DatasetUnavailableError(
                f"Fashion-MNIST file {source / name}.gz not found. Install Debian's package: "
                "`apt-get install dataset-fashion-mnist` (or set data.root to a folder holding the four "
                "idx files).")
        found[name] = present[0]
    return found


def _prepare_fashion_mnist_root(source: Path, found: dict[str, tuple[Path, Callable[..., Any]]]) -> Path:
    """Lay out checked, decompressed copies of the Debian files ``found`` in ``source`` (:func:`fashion_mnist_sources`,
    which the caller also names them by) where torchvision's FashionMNIST looks for them.

    The copies live in a cache folder (``$UNSPARSE_CACHE``, default ``~/.cache/unsparse``) keyed by ``source``'s
    path and each source file's size and modification time, so a replaced file is read again; each is checked
    (:func:`check_idx`) before it is written, atomically (temporary file + rename). Temporary files that killed
    processes left there (older than :data:`STALE_CACHE_WRITE_S`) are removed, logged.

    Returns:
        The ``root`` to pass to ``torchvision.datasets.FashionMNIST`` (files under ``root/FashionMNIST/raw``).

    Raises:
        ValueError: naming the source file and ``data.root`` (the setting to change), if it cannot be opened or
            read (a folder in its place, no permission: the system's reason) or decompressed; naming the file, if it
            is not a complete idx file of images (3 dimensions) or labels (1).
    """
    stamp = [str(source.resolve())] + [f"{path.name}:{path.stat().st_size}:{path.stat().st_mtime_ns}"
                                       for path, _ in found.values()]
    root = _cache_dir() / "torchvision" / hashlib.sha1("|".join(stamp).encode()).hexdigest()[:12]
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    stale = remove_stale_temporaries(raw, FASHION_MNIST_FILES, older_than_s=STALE_CACHE_WRITE_S)
    if stale:
        log.warning("removed %d temporary files that killed processes left in the data cache: %s", len(stale),
                    ", ".join(path.name for path in stale))
    for name, (path, opener) in found.items():
        target = raw / name
        if target.exists():
            continue
        try:
            with opener(path, "rb") as src:
                data = check_idx(src.read(), str(path), 1 if "labels" in name else 3)
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as error:  # a folder, or a damaged .gz or .xz stream
            raise ValueError(f"{path}: cannot be read ({getattr(error, 'strerror', None) or error}); set data.root "
                             "to a folder holding the four idx files") from error
        # A unique temporary name per writer: processes preparing the same cache at once (several tables on
        # one machine) each rename a whole file into place instead of renaming each other's half-written one.
        atomic_write(target, lambda dst, data=data: dst.write(data))
    return root


def check_split_size(size: int, available: int, field: str) -> int:
    """``size`` if it is an integer in ``[1, available - 1]``: a split that leaves the other one part empty, or a
    negative size (which Python's slicing reads from the end), would train or validate on nothing.

    Raises:
        ValueError: naming ``field`` otherwise.
    """
    return check_integer(size, field, 1, available - 1)


def _split_validation(images: torch.Tensor, labels: torch.Tensor, val_size: int, seed: int):
    check_split_size(val_size, len(labels), "val_size")
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    val, train = order[:val_size], order[val_size:]
    return (images[train], labels[train]), (images[val], labels[val])


def mean_and_std(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of all of ``values`` as float32 scalars, summed in float64.

    A float32 reduction over tens of millions of values rounds differently with the CPU thread count (Fashion-MNIST's
    training mean differed in its last bit at 8 threads against 1, 2, 4 or 16), so normalised inputs, and every
    deterministic run after them, would depend on the machine's cores; float64 sums round to the same float32.
    Holds a float64 copy of ``values`` meanwhile (345 MB for Fashion-MNIST's training images).
    """
    wide = values.double()
    return wide.mean().float(), wide.std().float()


def spread(values: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mean_and_std` of ``values`` (the training split), for scaling every split by.

    Raises:
        ValueError: naming ``name``, if the standard deviation is 0 or not finite (constant inputs: every scaled
            value would be NaN).
    """
    mean, std = mean_and_std(values)
    if not (torch.isfinite(std) and std > 0):
        raise ValueError(f"{name}: standard deviation {std.item()} (constant or non-finite values); cannot scale by it")
    return mean, std


def _normalise(splits: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    mean, std = spread(splits["train"][0], "training images")
    return {key: ((images - mean) / std, labels) for key, (images, labels) in splits.items()}


def first_examples(pair: tuple[torch.Tensor, torch.Tensor], limit: int | None,
            name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``limit`` examples of ``pair`` (all for None).

    Raises:
        ValueError: naming ``name``, for a limit that is no integer, or below 1 (an empty split fails later, far
            from the setting).
    """
    if limit is not None and check_integer(limit, name, low=None) < 1:
        raise ValueError(f"{name}: {limit} keeps no example; use a positive number or null for all")
    return pair if limit is None else (pair[0][:limit], pair[1][:limit])


def labelled_images(dataset: Any, images_file: Path, labels_file: Path, classes: int) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """``(images (N, 1, 28, 28) float32 in [0, 1], labels (N,) int64)`` of a torchvision MNIST-style ``dataset``
    read from ``images_file`` and ``labels_file``, checked against each other (each file was checked on its own,
    :func:`check_idx`).

    Raises:
        ValueError: naming the files, for images other than 28x28, a count of labels other than of images (extra
            labels would be scored, missing ones drop images or fail indexing), or a label outside
            ``[0, classes)``.
    """
    images, labels = dataset.data, dataset.targets
    if tuple(images.shape[1:]) != (28, 28):
        raise ValueError(f"{images_file}: images of {tuple(images.shape[1:])} pixels, expected (28, 28)")
    if len(labels) != len(images):
        raise ValueError(f"{labels_file}: {len(labels)} labels for the {len(images)} images of {images_file}")
    if len(labels) and int(labels.max()) >= classes:
        raise ValueError(f"{labels_file}: label {int(labels.max())} outside [0, {classes})")
    return images.unsqueeze(1).float() / 255.0, labels.long()


def fashion_mnist(root: str | Path = FASHION_MNIST_DIR, val_size: int = 5000, limit_train: int | None = None,
                  limit_test: int | None = None, seed: int = 0) -> Splits:
    """Fashion-MNIST (60k train, 10k test, 10 classes), the validation split carved from train.

    Args:
        root: folder with the four idx files (``.gz``, ``.xz`` or plain), Debian's location by default.
        val_size: training images held out for validation (the pruners' accuracy signal).
        limit_train, limit_test: keep only the first N train / (validation and test) images (smoke runs).
        seed: seed of the validation split.

    Raises:
        DatasetUnavailableError: files missing (the message names the Debian package).
        ValueError: a limit that is no integer or below 1, a ``val_size`` outside ``[1, 59999]``, or a ``seed`` that
            is no integer in ``[0, 2^32)`` (:func:`~unsparse.settings.check_seed`), naming it;
            files that cannot be read or are corrupt, or disagree with each other (:func:`labelled_images`), or
            constant images, naming them.
    """
    from torchvision.datasets import FashionMNIST

    check_seed(seed)
    found = fashion_mnist_sources(Path(root))
    torchvision_root = _prepare_fashion_mnist_root(Path(root), found)
    sources = [path for path, _ in found.values()]
    train, test = (labelled_images(FashionMNIST(str(torchvision_root), train=split == "train", download=False),
                                   *sources[offset:offset + 2], len(FASHION_MNIST_CLASSES))
                   for split, offset in (("train", 0), ("test", 2)))
    train_pair, val_pair = _split_validation(*train, val_size, seed)
    splits = _normalise({"train": first_examples(train_pair, limit_train, "limit_train"),
                         "val": first_examples(val_pair, limit_test, "limit_test"),
                         "test": first_examples(test, limit_test, "limit_test")})
    return Splits(**splits, num_classes=10, name="fashion_mnist")


def digits(test_size: int = 360, val_size: int = 180, seed: int = 0, limit_train: int | None = None,
           limit_test: int | None = None) -> Splits:
    """scikit-learn's handwritten digits (1797 8x8 images, 10 classes), bilinearly upsampled to 28x28.

    The test split is the last ``test_size`` images; validation is drawn from the rest with ``seed``.
    ``limit_train`` and ``limit_test`` keep the first N train / (validation and test) images, as for Fashion-MNIST.

    Raises:
        ValueError: a limit below 1, a split size that leaves a split empty, or a ``seed`` that is no integer
            in ``[0, 2^32)`` (:func:`~unsparse.settings.check_seed`), naming it.
    """
    from sklearn.datasets import load_digits

    check_seed(seed)
    bunch = load_digits()
    check_split_size(test_size, len(bunch.target), "test_size")
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.tensor(bunch.target, dtype=torch.long)
    rest, test = (images[:-test_size], labels[:-test_size]), (images[-test_size:], labels[-test_size:])
    train_pair, val_pair = _split_validation(*rest, val_size, seed)
    splits = _normalise({"train": first_examples(train_pair, limit_train, "limit_train"),
                         "val": first_examples(val_pair, limit_test, "limit_test"),
                         "test": first_examples(test, limit_test, "limit_test")})
    return Splits(**splits, num_classes=10, name="digits")
