"""Where hookcli.watch's lines go as they are made: the JSONL log (logfile.LogWriter: one run a
log, locked, never hurting the training) and, with tensorboard=DIR, each watched step's
scalars (trackers.TensorBoardWriter), whose failure ends it with one line on stderr."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hookcli.commands.watch.logfile import LogWriter
from hookcli.errors import UsageError, one_line
from hookcli.records import NonfiniteLine, StepLine, log_line


class LineSinks:
    """The log file and the TensorBoard folder of one watch, open between `open()` and
    `close()`."""

    def __init__(
        self, log_path: Path | None, tensorboard: object, *, rank: int, world_size: int
    ) -> None:
        self.log_path = log_path
        self.tensorboard = tensorboard
        self.rank = rank
        self.world_size = world_size
        self._file: LogWriter | None = None
        self._board: Any = None  # tensorboard=DIR: trackers.TensorBoardWriter

    def open(self) -> None:
        if self.tensorboard is not None:
            # its errors (not installed, a file where the folder goes) before any step, and
            # before the log is started (a refused watch leaves an earlier log as it was)
            from hookcli.commands.watch.trackers import TensorBoardWriter

            self._board = TensorBoardWriter(self._board_dir(self.tensorboard))
        if self.log_path is not None:
            # a new run starts a new log (a log holds one run: steps never repeat); written
            # so that it never hurts the training (logfile.py)
            self._file = LogWriter(self.log_path)

    def write(self, line: StepLine | NonfiniteLine) -> None:
        if self._file is not None:
            data = log_line(line)
            self._file.write(data)  # marks the line with the run's id
            line.run = data.get("run")
        board = self._board
        if board is not None and isinstance(line, StepLine):
            from hookcli.commands.watch.trackers import step_scalars

            def write() -> None:
                board.add(step_scalars(line))
                board.flush()

            self._sink(write)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            board, self._board = self._board, None
            self._sink(board.close)

    def _sink(self, write: Callable[[], None]) -> None:
        """A TensorBoard write that never hurts the training: a failure ends the sink with one
        line on stderr."""
        try:
            write()
        except Exception as exc:
            board, self._board = self._board, None
            if board is not None:
                with contextlib.suppress(Exception):
                    board.close()
            sys.stderr.write(f"hookcli.watch: TensorBoard stopped: {one_line(exc)}\n")

    def _board_dir(self, raw: object) -> Path:
        """tensorboard=DIR; under torchrun each rank's own subfolder (rank0, rank1, …: each
        rank's numbers are its shard's), as each writes its own log."""
        if not isinstance(raw, str | Path):
            raise UsageError(
                f"tensorboard must be a folder, got {type(raw).__name__}.",
                "e.g. tensorboard='runs/exp1'",
            )
        folder = Path(raw)
        return folder / f"rank{self.rank}" if self.world_size > 1 else folder
