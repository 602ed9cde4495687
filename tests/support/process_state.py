"""The process state a test can leave behind, taken at the session's start (tests/conftest.py
puts it back after every test)."""

from __future__ import annotations

import os
import sys

import torch


class ProcessState:
    """What a test can leave behind in the process: the recursion limit (torch.compile's
    inductor raises it), the default dtype, grad mode, deterministic algorithms, threads,
    matmul precision, the random states (torch's CPU generator, numpy's, Python's), the
    working folder and the environment."""

    def __init__(self) -> None:
        import random

        import numpy as np

        self.limit = sys.getrecursionlimit()
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.threads = torch.get_num_threads()
        self.matmul = torch.get_float32_matmul_precision()
        self.rng = torch.random.get_rng_state()
        self.np_rng = np.random.get_state()
        self.py_rng = random.getstate()
        self.cwd = os.getcwd()
        self.environ = dict(os.environ)

    def restore(self) -> None:
        import random

        import numpy as np

        sys.setrecursionlimit(self.limit)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        torch.use_deterministic_algorithms(self.deterministic)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.set_float32_matmul_precision(self.matmul)
        torch.random.set_rng_state(self.rng)
        np.random.set_state(self.np_rng)
        random.setstate(self.py_rng)
        os.chdir(self.cwd)
        # pytest's own variables (PYTEST_CURRENT_TEST) are pytest's to set and unset
        wanted = {k: v for k, v in self.environ.items() if not k.startswith("PYTEST_")}
        wanted |= {k: v for k, v in os.environ.items() if k.startswith("PYTEST_")}
        if dict(os.environ) != wanted:
            os.environ.clear()
            os.environ.update(wanted)


AT_START: list[ProcessState] = []  # the session's, taken by tests/conftest.py before any test
