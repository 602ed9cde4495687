"""Temporary (issue 50): what the tests still at tests/ root import from tests.test_cli, whose
tests are now tests/cli/test_cli.py. Goes once they import it from tests.support."""

from tests.support.cli import assert_one_line_error  # noqa: F401
from tests.support.paths import CAT  # noqa: F401
