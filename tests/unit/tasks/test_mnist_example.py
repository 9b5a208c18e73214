"""The MNIST example, a task defined outside the package, trains end to end."""

import sys

import numpy as np
import pytest

from machinery.settings import ROOT


sys.path.insert(0, str(ROOT / "examples" / "mnist"))


from idx import read_idx, write_idx  # noqa: E402


def test_idx_round_trip_plain_and_gzip(tmp_path):
    data = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    for name in ("a-idx3-ubyte", "a-idx3-ubyte.gz"):
        write_idx(tmp_path / name, data)
        assert (read_idx(tmp_path / name) == data).all()


def test_idx_rejects_foreign_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
