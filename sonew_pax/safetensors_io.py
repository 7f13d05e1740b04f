"""The safetensors file format, read and written with numpy alone (no torch, no extra package).

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON naming each tensor's
dtype, shape and ``[begin, end)`` byte range in the data that follows (and an optional
``__metadata__`` dict of strings), then the tensors' bytes, row-major and little-endian, back to
back. The header is padded with spaces to a multiple of 8 bytes, as the reference writer does.
"""

import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

HEADER_SIZE = struct.Struct("<Q")
METADATA_KEY = "__metadata__"
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}


def _little_endian(array: np.ndarray) -> np.ndarray:
    """``array`` row-major and little-endian."""
    array = np.ascontiguousarray(array)
    return array.astype(array.dtype.newbyteorder("<"), copy=False)


def save(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes ``tensors`` to a safetensors file at ``path``, in their order.

    Args:
      tensors: name -> array of a dtype in `DTYPES`.
      path: the file to write.
      metadata: strings stored under ``__metadata__`` (Hugging Face reads ``{"format": "pt"}``).

    Raises:
      ValueError: an array's dtype has no safetensors code.
    """
    arrays = {name: _little_endian(value) for name, value in tensors.items()}
    header: dict[str, Any] = {METADATA_KEY: dict(metadata)} if metadata else {}
    offset = 0
    for name, array in arrays.items():
        code = _CODES.get(array.dtype)
        if code is None:
            raise ValueError(f"{name}: dtype {array.dtype} has no safetensors code")
        header[name] = {
            "dtype": code,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(HEADER_SIZE.pack(len(encoded)))
        file.write(encoded)
        for array in arrays.values():
            file.write(array.tobytes())


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of the safetensors file at ``path`` (tensors and ``__metadata__``)."""
    with open(path, "rb") as file:
        (size,) = HEADER_SIZE.unpack(file.read(HEADER_SIZE.size))
        return json.loads(file.read(size))


def load(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The tensors of the safetensors file at ``path``, name -> array, in the header's order.

    Raises:
      ValueError: a tensor's byte range does not match its dtype and shape, or the data has
        bytes no tensor covers.
    """
    header = read_header(path)
    header.pop(METADATA_KEY, None)
    with open(path, "rb") as file:
        file.seek(HEADER_SIZE.size + HEADER_SIZE.unpack(file.read(HEADER_SIZE.size))[0])
        data = file.read()
    tensors, covered = {}, 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if begin != covered or end - begin != dtype.itemsize * int(np.prod(shape)):
            raise ValueError(f"{path}: tensor {name} has byte range {begin}..{end}")
        tensors[name] = np.frombuffer(data[begin:end], dtype).reshape(shape)
        covered = end
    if covered != len(data):
        raise ValueError(f"{path}: {len(data) - covered} bytes after the last tensor")
    return {name: tensors[name] for name in header}
