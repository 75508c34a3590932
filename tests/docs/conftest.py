"""The docs' lines run against the API tests' live API (one token per role, seeded rows)."""

from tests.services.api.conftest import api

__all__ = ["api"]
