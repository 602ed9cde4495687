"""`--save FILE.safetensors`: the selected calls' inputs, outputs and gradients, streamed.

Each tensor's bytes go to a temporary data file the moment a hook sees it (on a GPU that is a
copy to the host, the price of saving), and only its name, dtype, shape and offsets stay in
memory. At the end the safetensors file is assembled — an 8-byte header length, the JSON
header with a `__metadata__` entry, then the data — beside the target and renamed into place.
Keys: `{layer}#{call}/{kind}/{path}`, e.g. `layer1.0.relu#1/output/out`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import tempfile
from typing import Any

import torch

from hookcli.errors import UsageError
from hookcli.io.output import Destination, write_with

DTYPE_NAMES = {  # the dtypes a safetensors file names, and their names
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


class TensorSaver:
    """Collects tensors into a safetensors file without holding them."""

    def __init__(self, dest: Destination, metadata: dict[str, str]) -> None:
        self.dest = dest
        self.metadata = metadata
        self.entries: dict[str, dict[str, Any]] = {}
        self.skipped: list[str] = []
        # Nameless (O_TMPFILE, or unlinked the moment it is made): only the descriptor holds
        # the data, so no signal (SIGTERM, SIGKILL, the OOM killer) can leave a file behind;
        # it is read back through the descriptor.
        self._data = tempfile.TemporaryFile(  # noqa: SIM115 — lives until close() or discard()
            "w+b", prefix=".hookcli-save.", suffix=".data", dir=dest.scratch_dir
        )
        self._offset = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        if t.is_quantized:
            t = t.dequantize()
        dtype = DTYPE_NAMES.get(t.dtype)
        if dtype is None or t.layout != torch.strided:
            self.skipped.append(f"{key} ({t.dtype})")
            return
        if key in self.entries:
            return
        flat = t.detach().contiguous().reshape(-1)
        data = flat.view(torch.uint8).cpu().numpy().tobytes() if flat.numel() else b""
        try:
            self._data.write(data)
        except OSError as exc:  # the disk full, or a file-size limit (ulimit -f): one line
            raise UsageError(
                f"cannot write {self.dest.label}: {exc.strerror or exc}.",
                "free space, raise the file-size limit or choose another path.",
            ) from exc
        self.entries[key] = {
            "dtype": dtype,
            "shape": list(t.shape),
            "data_offsets": [self._offset, self._offset + len(data)],
        }
        self._offset += len(data)

    def close(self) -> None:
        """Assemble the file (hookcli.io.output's policy: atomic for a regular file); the
        temporary data goes either way."""
        header: dict[str, Any] = {"__metadata__": self.metadata, **self.entries}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        data = self._data

        def assemble(tmp: str) -> None:
            data.flush()
            data.seek(0)
            with open(tmp, "wb") as out:
                out.write(struct.pack("<Q", len(raw)))
                out.write(raw)
                shutil.copyfileobj(data, out, 1 << 20)

        try:
            write_with(self.dest, assemble)
        finally:
            self.discard()

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self._data.close()
