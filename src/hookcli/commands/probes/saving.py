"""--save as a probe: every hooked tensor written to a safetensors file as it is measured
(io/saving.py); the file is complete, or not there at all. One batch's tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hookcli._version import __version__
from hookcli.engine.probes import Armed, Measured, Probe
from hookcli.options import RunOptions
from hookcli.records import Report


class Save(Probe):
    option = "save"
    flag = "save"

    def __init__(self, dest: Any, command: str) -> None:
        self.dest = dest  # an io.output.Destination
        self.command = command
        self.saver: Any = None

    @classmethod
    def of(cls, run: RunOptions, command: str) -> Save:
        return cls(run.save, command)

    @classmethod
    def asked(cls, run: RunOptions, rules: Any = None) -> bool:
        return run.save is not None  # (a destination, whatever its truth value)

    @contextlib.contextmanager
    def arm(self, armed: Armed) -> Iterator[None]:
        from hookcli.io.saving import TensorSaver

        prepared = armed.prepared
        saver = TensorSaver(
            self.dest,
            {
                "format": "pt",
                "hookcli_version": __version__,
                "command": self.command,
                "model": prepared.loaded.spec,
                "weights": prepared.loaded.weights_label,
                "input": armed.model_input.description,
                "device": str(prepared.device),
            },
        )
        self.saver = armed.saver = saver
        try:
            yield
        except BaseException:
            saver.discard()  # never a half-written file
            raise
        saver.close()

    def finish(self, measured: Measured, report: Report) -> None:
        saver = self.saver
        report.notes.append(f"saved {len(saver.entries)} tensors to {saver.dest.label}")
        if saver.skipped:
            skipped = ", ".join(saver.skipped[:5])
            report.notes.append(f"not saved (no safetensors dtype): {skipped}")
