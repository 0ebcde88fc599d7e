"""The Fashion-MNIST cache: several processes preparing it at once all end with whole files."""

from __future__ import annotations

import gzip
import lzma
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unsparse.data import FASHION_MNIST_FILES

PREPARE = "import sys; from pathlib import Path; from unsparse.data import _prepare_fashion_mnist_root as p; " \
          "print(p(Path(sys.argv[1])))"


@pytest.mark.parametrize("suffix, compress", [(".gz", lambda data: gzip.compress(data, compresslevel=1)),
                                              (".xz", lambda data: lzma.compress(data, preset=0)),
                                              ("", lambda data: data)])
def test_concurrent_preparers_all_succeed_with_complete_files(tmp_path, suffix, compress):
    source = tmp_path / "source"
    source.mkdir()
    payload = {name: bytes([index]) * (4 << 20) for index, name in enumerate(FASHION_MNIST_FILES)}
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
