"""Shared fixtures for the native tests: the built native tree (fakes, workload, hook)."""

from pathlib import Path

import pytest

from greyhound.fakejob import native_build_dir


@pytest.fixture(scope="session")
def native_build() -> Path:
    return native_build_dir()
