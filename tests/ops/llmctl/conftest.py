"""Fixtures for the llmctl tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fake_pulumi(tmp_path: Path) -> str:
    """A PATH folder with a `pulumi` that succeeds: the checks before Pulumi run, Pulumi does nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pulumi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "pulumi").chmod(0o755)
    return str(bin_dir)
