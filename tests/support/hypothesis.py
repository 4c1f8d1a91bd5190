"""How many examples a property runs: few under `make test`'s profile, many under `make test-deep`.

The profiles themselves are registered in tests/conftest.py (`HYPOTHESIS_PROFILE`, default
"fast"). Each property names both counts, since a property that sends HTTP requests costs far
more per example than one that calls a pure function.
"""

from __future__ import annotations

import os

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "fast")


def examples(*, fast: int, deep: int) -> int:
    return deep if PROFILE == "deep" else fast
