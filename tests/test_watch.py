"""Temporary (issue 50): what the tests still at tests/ root import from tests.test_watch, whose
tests are now tests/commands/watch/test_watch.py. Goes once they import it from tests.support."""

from tests.support.watch import Tiny  # noqa: F401
from tests.support.watch import tiny_batches as _batches  # noqa: F401
