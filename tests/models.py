"""Temporary (issue 50): the tests still at tests/ root load their models as tests/models.py:Name;
they are tests/support/models.py's. Goes once those tests name tests/support/models.py."""

from tests.support.models import *  # noqa: F403
