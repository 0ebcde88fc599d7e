"""Untrusted Fashion-MNIST files found in review: files of no images."""

from __future__ import annotations

import random
import struct

import pytest

from unsparse.data import FASHION_MNIST_FILES, fashion_mnist


def idx_file(dims: tuple[int, ...], rng: random.Random) -> bytes:
    """An idx file of unsigned bytes of shape ``dims``, random bytes below 10 (labels of 10 classes)."""
    count = 1
    for size in dims:
        count *= size
    return bytes([0, 0, 8, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + bytes(
        rng.randrange(10) for _ in range(count))


@pytest.mark.parametrize(("empty", "named"), [(2, "t10k-images-idx3-ubyte"), (0, "train-images-idx3-ubyte")])
def test_a_split_of_no_images_is_named(tmp_path, monkeypatch, empty, named):
    """Well-formed files of 0 images and 0 labels failed in torchvision's reader with an error naming no file."""
    monkeypatch.setenv("UNSPARSE_CACHE", str(tmp_path / "cache"))
    rng = random.Random(0)
    for index, name in enumerate(FASHION_MNIST_FILES):
        count = 0 if index in (empty, empty + 1) else 50
        (tmp_path / name).write_bytes(idx_file((count,) if "labels" in name else (count, 28, 28), rng))
    with pytest.raises(ValueError, match=rf"{named}: its header \(0, 28, 28\) holds no values"):
        fashion_mnist(tmp_path, val_size=10)
