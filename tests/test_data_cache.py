"""The Fashion-MNIST cache: several processes preparing it at once all end with whole files."""

from __future__ import annotations

import gzip
import lzma
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from unsparse.data import FASHION_MNIST_FILES


def idx_file(dims: tuple[int, ...], fill: int) -> bytes:
    """An idx file of unsigned bytes (the MNIST format) of shape ``dims``, every byte ``fill``."""
    return bytes([0, 0, 8, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + bytes([fill]) * math.prod(dims)


PREPARE = "import sys; from pathlib import Path; from unsparse.data import _prepare_fashion_mnist_root as p; " \
          "print(p(Path(sys.argv[1])))"


@pytest.mark.parametrize("suffix, compress", [(".gz", lambda data: gzip.compress(data, compresslevel=1)),
                                              (".xz", lambda data: lzma.compress(data, preset=0)),
                                              ("", lambda data: data)])
def test_concurrent_preparers_all_succeed_with_complete_files(tmp_path, suffix, compress):
    source = tmp_path / "source"
    source.mkdir()
    payload = {name: idx_file((4096, 1024), index) for index, name in enumerate(FASHION_MNIST_FILES)}
    for name, data in payload.items():
        (source / f"{name}{suffix}").write_bytes(compress(data))
    environment = {**os.environ, "UNSPARSE_CACHE": str(tmp_path / "cache"),
                   "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    workers = [subprocess.Popen([sys.executable, "-c", PREPARE, str(source)], env=environment,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [(*worker.communicate(timeout=120), worker.returncode) for worker in workers]
    assert all(code == 0 for _, _, code in results), [error for _, error, _ in results]
    roots = {out.strip() for out, _, _ in results}
    assert len(roots) == 1
    raw = Path(roots.pop()) / "FashionMNIST" / "raw"
    assert sorted(path.name for path in raw.iterdir()) == sorted(FASHION_MNIST_FILES)
    assert all((raw / name).read_bytes() == data for name, data in payload.items())


def test_a_replaced_source_is_read_again_and_a_truncated_one_is_named(tmp_path, monkeypatch):
    """The cache is keyed on the source files' sizes and times, so a replaced file is not served from an old copy;
    a truncated one is refused naming it (torchvision reported a tensor shape error naming nothing)."""
    from unsparse.data import _prepare_fashion_mnist_root

    monkeypatch.setenv("UNSPARSE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "source"
    source.mkdir()
    for name in FASHION_MNIST_FILES:
        (source / name).write_bytes(idx_file((3, 2), 1))
    first = _prepare_fashion_mnist_root(source) / "FashionMNIST" / "raw" / FASHION_MNIST_FILES[0]
    assert first.read_bytes() == idx_file((3, 2), 1)
    (source / FASHION_MNIST_FILES[0]).write_bytes(idx_file((5, 2), 7))
    again = _prepare_fashion_mnist_root(source) / "FashionMNIST" / "raw" / FASHION_MNIST_FILES[0]
    assert again.read_bytes() == idx_file((5, 2), 7)
    (source / FASHION_MNIST_FILES[1]).write_bytes(idx_file((5, 2), 7)[:-3])
    with pytest.raises(ValueError, match=rf"{FASHION_MNIST_FILES[1]}: 19 bytes, but its header \(5, 2\) needs 22"):
        _prepare_fashion_mnist_root(source)
