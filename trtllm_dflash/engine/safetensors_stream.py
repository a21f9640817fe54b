"""Write a .safetensors file one tensor at a time, so a build never holds a whole rank in memory.

The safetensors library only writes from a complete in-memory dict. This writer produces the same
format (8-byte little-endian header length, JSON header padded with spaces to 8 bytes, then the raw
tensor bytes in header order) by streaming the tensor bytes to a side file first and assembling the
final file when the header is known; files are read back with `safetensors` itself in the tests.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


class SafetensorsWriter:
    """`with SafetensorsWriter(path, metadata) as w: w.add(name, tensor)`; the file appears on close."""

    def __init__(self, path: Path, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._data_path = self.path.with_name(self.path.name + ".data")
        self._data = self._data_path.open("wb")
        self._header: dict[str, dict] = {"__metadata__": metadata} if metadata else {}
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._header:
            raise ValueError(f"duplicate tensor name {name!r}")
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._data.write(raw.tobytes())
        end = self._offset + raw.nbytes
        self._header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self._offset, end]}
        self._offset = end

    def close(self) -> None:
        self._data.close()
        header = json.dumps(self._header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with self.path.open("wb") as out, self._data_path.open("rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(data, out, length=16 << 20)
        self._data_path.unlink()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._data.close()
            self._data_path.unlink(missing_ok=True)
