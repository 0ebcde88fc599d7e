"""The Fashion-MNIST cache: several processes preparing it at once all end with whole files."""

from __future__ import annotations

import gzip
import lzma
import math
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from unsparse.data import FASHION_MNIST_FILES


def idx_file(dims: tuple[int, ...], fill: int) -> bytes:
    """An idx file of unsigned bytes (the MNIST format) of shape ``dims``, every byte ``fill``."""
    return bytes([0, 0, 8, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + bytes([fill]) * math.prod(dims)


def fashion_files(count: int, size: int = 28, fill: int = 1) -> dict[str, bytes]:
    """The four Fashion-MNIST files, ``count`` images of ``size`` x ``size`` and ``count`` labels in each split."""
    return {name: idx_file((count,) if "labels" in name else (count, size, size), fill)
            for name in FASHION_MNIST_FILES}


def prepared(source: Path) -> Path:
    """The torchvision root that ``_prepare_fashion_mnist_root`` lays out for the Fashion-MNIST files in ``source``."""
    from unsparse.data import _prepare_fashion_mnist_root, fashion_mnist_sources

    return _prepare_fashion_mnist_root(source, fashion_mnist_sources(source))


PREPARE = "import sys; from pathlib import Path; from unsparse.data import _prepare_fashion_mnist_root as p, " \
          "fashion_mnist_sources as f; source = Path(sys.argv[1]); print(p(source, f(source)))"


@pytest.mark.parametrize("suffix, compress", [(".gz", lambda data: gzip.compress(data, compresslevel=1)),
                                              (".xz", lambda data: lzma.compress(data, preset=0)),
                                              ("", lambda data: data)])
def test_concurrent_preparers_all_succeed_with_complete_files(tmp_path, suffix, compress):
    source = tmp_path / "source"
    source.mkdir()
    payload = {name: idx_file((4096 * 1024,) if "labels" in name else (4096, 32, 32), index)
               for index, name in enumerate(FASHION_MNIST_FILES)}
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
    monkeypatch.setenv("UNSPARSE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "source"
    source.mkdir()
    for name, data in fashion_files(3, 2).items():
        (source / name).write_bytes(data)
    first = prepared(source) / "FashionMNIST" / "raw" / FASHION_MNIST_FILES[0]
    assert first.read_bytes() == idx_file((3, 2, 2), 1)
    (source / FASHION_MNIST_FILES[0]).write_bytes(idx_file((5, 2, 2), 7))
    again = prepared(source) / "FashionMNIST" / "raw" / FASHION_MNIST_FILES[0]
    assert again.read_bytes() == idx_file((5, 2, 2), 7)
    (source / FASHION_MNIST_FILES[1]).write_bytes(idx_file((5,), 7)[:-3])
    with pytest.raises(ValueError, match=rf"{FASHION_MNIST_FILES[1]}: 10 bytes, but its header \(5,\) needs 13"):
        prepared(source)


def test_a_damaged_gzip_stream_is_named(tmp_path, monkeypatch):
    """A flipped byte inside the compressed data raised a bare zlib.error that named no file."""
    monkeypatch.setenv("UNSPARSE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "source"
    source.mkdir()
    rng = random.Random(0)
    labels = bytes([0, 0, 8, 1]) + struct.pack(">I", 60000) + bytes(rng.randrange(10) for _ in range(60000))
    for name, data in {**fashion_files(50), FASHION_MNIST_FILES[1]: labels}.items():
        (source / f"{name}.gz").write_bytes(gzip.compress(data))
    damaged = bytearray((source / f"{FASHION_MNIST_FILES[1]}.gz").read_bytes())
    damaged[1000] ^= 0xFF  # inside the Huffman-coded labels: zlib's "invalid distance too far back"
    (source / f"{FASHION_MNIST_FILES[1]}.gz").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=rf"{FASHION_MNIST_FILES[1]}.gz: cannot be read \(Error -3"):
        prepared(source)


@pytest.mark.parametrize(("replace", "message"), [
    ({1: idx_file((40,), 1)}, r"train-labels-idx1-ubyte: 40 labels for the 50 images of .*train-images-idx3-ubyte"),
    ({3: idx_file((60,), 1)}, r"t10k-labels-idx1-ubyte: 60 labels for the 50 images"),
    ({1: idx_file((50,), 200)}, r"train-labels-idx1-ubyte: label 200 outside \[0, 10\)"),
    ({1: idx_file((50, 28, 28), 1)}, r"train-labels-idx1-ubyte: 3 dimensions, expected 1"),
    ({0: idx_file((50, 32, 32), 1)}, r"train-images-idx3-ubyte: images of \(32, 32\) pixels, expected \(28, 28\)"),
])
def test_image_and_label_files_that_disagree_are_named(tmp_path, monkeypatch, replace, message):
    """Each file was checked on its own: fewer labels dropped images without a word, more gave an IndexError or
    extra test labels that were scored, a label of 200 failed in training, and a labels file holding images gave
    torchvision's error naming no file."""
    from unsparse.data import fashion_mnist

    monkeypatch.setenv("UNSPARSE_CACHE", str(tmp_path / "cache"))
    files = fashion_files(50)
    for index, data in replace.items():
        files[FASHION_MNIST_FILES[index]] = data
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=message):
        fashion_mnist(tmp_path, val_size=10)


def test_constant_images_and_non_integer_limits_are_refused_by_name(tmp_path, monkeypatch):
    """Constant training images were scaled by a standard deviation of 0 into NaN; a limit of 2.5 failed in
    slicing and True was read as 1."""
    from unsparse.data import digits, fashion_mnist

    monkeypatch.setenv("UNSPARSE_CACHE", str(tmp_path / "cache"))
    for name, data in fashion_files(50).items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=r"training images: standard deviation 0.0"):
        fashion_mnist(tmp_path, val_size=10)
    for limit in (2.5, True, "10"):
        with pytest.raises(ValueError, match=rf"limit_train: expected an integer, got {limit!r}"):
            digits(limit_train=limit)


def test_temporaries_a_killed_preparer_left_are_removed_once_old(tmp_path, monkeypatch, caplog):
    """A process killed mid-copy left a temporary file of up to 47 MB in the shared cache for good; one that may
    belong to a live writer (recent) stays."""
    from unsparse.data import STALE_CACHE_WRITE_S

    monkeypatch.setenv("UNSPARSE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "source"
    source.mkdir()
    for name, data in fashion_files(3).items():
        (source / name).write_bytes(data)
    raw = prepared(source) / "FashionMNIST" / "raw"
    old, recent = raw / f".{FASHION_MNIST_FILES[0]}.abcd1234.tmp", raw / f".{FASHION_MNIST_FILES[1]}.efgh5678.tmp"
    for path in (old, recent):
        path.write_bytes(b"partial")
    stamp = old.stat().st_mtime - STALE_CACHE_WRITE_S - 1
    os.utime(old, (stamp, stamp))
    with caplog.at_level("WARNING", logger="unsparse.data"):
        prepared(source)
    assert not old.exists() and recent.exists()
    assert f"removed 1 temporary files that killed processes left in the data cache: {old.name}" in caplog.text


def test_disagreeing_files_are_named_as_they_are_stored(tmp_path, monkeypatch):
    """Debian's files are gzipped: the message named the path without .gz, a file that does not exist."""
    from unsparse.data import fashion_mnist

    monkeypatch.setenv("UNSPARSE_CACHE", str(tmp_path / "cache"))
    files = {**fashion_files(50), FASHION_MNIST_FILES[1]: idx_file((40,), 1)}
    for name, data in files.items():
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress(data))
    with pytest.raises(ValueError, match=rf"{tmp_path}/train-labels-idx1-ubyte.gz: 40 labels for the 50 images of "
                                         rf"{tmp_path}/train-images-idx3-ubyte.gz"):
        fashion_mnist(tmp_path, val_size=10)


def test_fashion_mnist_finds_its_source_files_once(tmp_path, monkeypatch):
    """The files were looked up twice, for the cache and for the names in messages, which could disagree where the
    folder changed in between (a .gz added next to a plain file)."""
    import unsparse.data

    monkeypatch.setenv("UNSPARSE_CACHE", str(tmp_path / "cache"))
    looked_up = []
    find = unsparse.data.fashion_mnist_sources
    monkeypatch.setattr(unsparse.data, "fashion_mnist_sources", lambda source: looked_up.append(source) or find(source))
    for name in FASHION_MNIST_FILES:
        count = 50 if "train" in name else 20
        dims, values = ((count,), 10) if "labels" in name else ((count, 28, 28), 256)
        header = bytes([0, 0, 8, len(dims)]) + struct.pack(f">{len(dims)}I", *dims)
        (tmp_path / name).write_bytes(header + bytes(index % values for index in range(math.prod(dims))))
    splits = unsparse.data.fashion_mnist(tmp_path, val_size=10)
    assert len(splits.train[1]) == 40 and len(splits.test[1]) == 20
    assert looked_up == [tmp_path]
