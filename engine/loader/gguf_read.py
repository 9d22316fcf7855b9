"""A GGUF file's metadata and tensor index, read in a single pass over the header.

Why not ``gguf.GGUFReader``: it builds a numpy memmap view for every part of every field, and
the bundled model's header holds 49,152 vocabulary strings and 48,900 merges: 5.6 s and about
170 MB to open it on this machine's kind, paid by the gateway (for its tokenizer) and again by
every replica, before anything starts. Reading the same header with ``struct`` takes about
0.1 s. Everything else comes from the ``gguf`` package: the value and quantization type
enums, the block sizes, the byte shapes of quantized rows, and dequantization. The format
(versions 2 and 3, little-endian): magic ``GGUF``, version, tensor count, key/value count; the
key/value pairs; the tensor infos (name, dims, type, offset); the data at the next multiple of
``general.alignment`` (default 32). A tensor's ``data`` is a read-only memmap view, as
``GGUFReader`` gives it (quantized types as uint8 rows of their blocks).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_PLAIN = {  # tensor types stored as plain numpy items
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands (bad magic, an unsupported version, a value
    type it does not know, or a header that runs past the end of the file)."""


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (fastest-varying first), as GGUFReader gives it
    data: np.ndarray


class GGUFFile:
    """``fields`` (key -> ``Field``) and ``tensors`` (in file order) of a GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._buf = f.read(1 << 20)
            self._file = f
            self._pos = 0
            if self._take(4) != b"GGUF":
                raise GGUFFormatError(f"{self.path.name}: not a GGUF file (bad magic)")
            version = self._unpack("<I")
            if version not in (2, 3):
                raise GGUFFormatError(f"{self.path.name}: GGUF version {version} is not "
                                      "supported (2 and 3 are)")
            n_tensors, n_fields = self._unpack("<Q"), self._unpack("<Q")
            self.fields: dict[str, Field] = {}
            for _ in range(n_fields):
                name = self._string()
                self.fields[name] = Field(name, self._value(GGUFValueType(self._unpack("<I"))))
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
                infos.append((name, dims, GGMLQuantizationType(self._unpack("<I")),
                              self._unpack("<Q")))
        align = int(self.fields["general.alignment"].value) \
            if "general.alignment" in self.fields else 32
        start = -(-self._pos // align) * align
        mm = np.memmap(self.path, mode="r")
        self.tensors: list[Tensor] = []
        for name, dims, ttype, offset in infos:
            n = int(np.prod(dims))
            shape = tuple(reversed(dims))
            block, size = GGML_QUANT_SIZES[ttype]
            at = start + offset
            if ttype in _PLAIN:
                data = mm[at:at + n * np.dtype(_PLAIN[ttype]).itemsize].view(_PLAIN[ttype])
            else:
                data = mm[at:at + n * size // block]
                shape = quant_shape_to_byte_shape(shape, ttype)
            if at + data.nbytes > len(mm):
                raise GGUFFormatError(f"{self.path.name}: tensor {name} runs past the end")
            self.tensors.append(Tensor(name, ttype, dims, data.reshape(shape)))

    # ---- the header, read through a growing buffer -----------------------------------------
    def _take(self, n: int) -> bytes:
        while self._pos + n > len(self._buf):
            more = self._file.read(max(1 << 20, n))
            if not more:
                raise GGUFFormatError(f"{self.path.name}: the header runs past the end")
            self._buf += more
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._take(self._unpack("<Q")).decode("utf-8")

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
            if item in _SCALARS:  # one unpack for the whole array
                fmt = _SCALARS[item]
                return list(struct.unpack(f"<{count}{fmt[1]}",
                                          self._take(count * struct.calcsize(fmt))))
            return [self._value(item) for _ in range(count)]
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        raise GGUFFormatError(f"{self.path.name}: unknown GGUF value type {kind}")
