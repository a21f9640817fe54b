"""Reading tensors from a directory of safetensors files, one tensor at a time.

Handles a single `model.safetensors`, several shards with `model.safetensors.index.json`, or several
shards without an index. Every failure names the file and the tensor. Pickled checkpoints are never
read.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import read_json_object

INDEX_FILE = "model.safetensors.index.json"


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, whose file-system errors are OSErrors naming `path`, as Python's own writes give.

    safetensors reports a full disk as `SafetensorError('... I/O error: No space left on device (os error 28)')`:
    without the errno and the file, it would pass every handler of the user's file-system errors as a bug."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number) if number in errno.errorcode else str(exc), str(path)) from None


class SafetensorsDir:
    """Name -> file map over a checkpoint directory's safetensors files."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files: dict[str, Path] = {}  # tensor name -> file
        index = directory / INDEX_FILE
        if index.exists():
            weight_map = read_json_object(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise UserError(f"{index}: field 'weight_map' is missing or not an object.")
            files = sorted({directory / f for f in weight_map.values()})
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise UserError(f"{directory}: no *.safetensors files found (pickled checkpoints are not read).")
        for path in files:
            for name in self._names_in(path):
                self.files[name] = path
        if index.exists():
            for name, fname in weight_map.items():
                if name not in self.files:
                    raise UserError(f"{directory / fname}: tensor {name!r} listed in {INDEX_FILE} is not in the file.")

    @staticmethod
    def _names_in(path: Path) -> list[str]:
        if not path.is_file():
            raise UserError(f"{path}: safetensors file is missing.")
        try:
            with safe_open(path, framework="pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(f"{path}: not a readable safetensors file ({exc}).") from None

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return sorted(self.files)

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        path = self.files[name]
        with safe_open(path, framework="pt") as f:
            sl = f.get_slice(name)
            return tuple(sl.get_shape()), sl.get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._read(self.files[name], name, name)

    @staticmethod
    def _read(path: Path, stored: str, name: str) -> torch.Tensor:
        try:
            with safe_open(path, framework="pt") as f:
                return f.get_tensor(stored)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"{path}: tensor {name!r} cannot be read ({exc}); the file may be truncated.") from None


class RenamedSafetensorsDir(SafetensorsDir):
    """A checkpoint directory whose tensors are presented under renamed prefixes ({stored prefix: our prefix});
    tensors under no listed prefix are left out. E.g. {"model.language_model.": "model."} reads the text model of a
    multimodal Gemma 4 directory as a causal LM's."""

    def __init__(self, directory: Path, prefixes: dict[str, str]):
        super().__init__(directory)
        self.stored: dict[str, str] = {}  # our name -> stored name
        for name in list(self.files):
            for old, new in prefixes.items():
                if name.startswith(old):
                    self.stored[new + name[len(old):]] = name
        self.files = {ours: self.files[stored] for ours, stored in self.stored.items()}

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        with safe_open(self.files[name], framework="pt") as f:
            sl = f.get_slice(self.stored[name])
            return tuple(sl.get_shape()), sl.get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return super()._read(self.files[name], self.stored[name], name)


# safetensors dtype names that hold model weights in our formats
FLOAT_DTYPES = {"F32", "F16", "BF16"}


def check_tensors(store: SafetensorsDir, expected: dict[str, tuple[int, ...]], what: str) -> None:
    """Every expected tensor is present, floating point, and of the expected shape."""
    for name, shape in expected.items():
        if name not in store:
            raise UserError(f"{store.directory}: {what} tensor {name!r} is missing.")
        got_shape, dtype = store.shape_dtype(name)
        if got_shape != shape:
            raise UserError(
                f"{store.files[name]}: {what} tensor {name!r} has shape {list(got_shape)}, "
                f"expected {list(shape)} from config.json."
            )
        if dtype not in FLOAT_DTYPES:
            raise UserError(
                f"{store.files[name]}: {what} tensor {name!r} has dtype {dtype}, expected one of F32, F16, BF16."
            )
