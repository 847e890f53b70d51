"""Whether the suite runs as CI, for tests/conftest.py and any test that reads it (a module of its own: in a
whole-suite run `conftest` names whichever folder's conftest.py was loaded last, so it cannot be imported by name)."""

from __future__ import annotations

import os


def in_ci() -> bool:
    """Whether the suite runs as CI (`CI` set to true, as GitHub Actions, GitLab and .ci/run's callers do)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
