"""Read and write the IDX format of MNIST / Fashion-MNIST (gzipped or not).

Header: two zero bytes, a type code, the number of dimensions, then each
dimension as a big-endian int32; the data follows in C order.
"""

import gzip
import struct
import zlib

import numpy as np

_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09}


def _open(path, mode):
    return gzip.open(path, mode) if str(path).endswith(".gz") else open(path, mode)


def read_idx(path):
    try:
        with _open(path, "rb") as f:
            raw = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:   # truncated, bad CRC
        raise ValueError(f"{path} is corrupt or truncated ({type(err).__name__}: {err}); "
                         "download or create it again") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}i", raw[4:4 + 4 * ndim])
    dtype = np.dtype(_DTYPES[raw[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    body = raw[4 + 4 * ndim:]
    if len(body) != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes) but {len(body)} bytes follow")
    return np.frombuffer(body, dtype=dtype).reshape(dims)


def write_idx(path, array):
    array = np.ascontiguousarray(array)
    if array.dtype not in _CODES:
        raise ValueError(f"write_idx supports uint8/int8 arrays, got {array.dtype}")
    header = bytes([0, 0, _CODES[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    with _open(path, "wb") as f:
        f.write(header + array.tobytes())
