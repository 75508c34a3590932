"""A JSONB column that holds a typed document (services.common.db.documents): a model in, the
same model out, never a dict.

Each stored value carries its schema version under ``"v"``. A row written before its column was
typed has none (version 0): the same keys, but nothing ever checked them, so the reader keeps
what fits the model and drops, with a warning, the keys that do not, rather than fail every
read of the table on one old row. A later change to a document's shape raises ``VERSION`` and
adds the upgrade from the version before to ``UPGRADES``; writes are always checked and always
the newest version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter, ValidationError
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

from services.common.db.documents import Document

log = logging.getLogger(__name__)

VERSION = 1
KEY = "v"
Upgrade = Callable[[dict[str, Any]], dict[str, Any]]
# version n -> the function that makes a version n + 1 value of it
UPGRADES: dict[int, Upgrade] = {}
_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def _adapter(kind: Any) -> TypeAdapter[Any]:
    if kind not in _ADAPTERS:
        _ADAPTERS[kind] = TypeAdapter(kind)
    return _ADAPTERS[kind]


def stored(value: Any, kind: Any) -> dict[str, Any]:
    """``value`` (a model of ``kind``) as the column stores it."""
    doc = _adapter(kind).validate_python(value)  # a dict from a writer is checked here too
    # a document keeps the keys its writer set; a bus message (a delivery's) every field, its
    # event id and time included, which a reader must get back as they were
    data: dict[str, Any] = (doc.as_json() if isinstance(doc, Document)
                            else doc.model_dump(mode="json"))
    return {KEY: VERSION, **data}


def loaded(raw: dict[str, Any], kind: Any) -> Any:
    """The model a stored value holds, brought up to this version."""
    data = dict(raw)
    version = int(data.pop(KEY, 0))
    if version == 0:
        return _lenient(data, kind)
    while version < VERSION:
        data = UPGRADES[version](data)
        version += 1
    return _adapter(kind).validate_python(data)


def _lenient(data: dict[str, Any], kind: Any) -> Any:
    """A version 0 value: the keys the model takes; those it does not (or not of that type) go."""
    adapter = _adapter(kind)
    for _ in range(len(data) + 1):
        try:
            return adapter.validate_python(data)
        except ValidationError as exc:
            bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
            if not bad & set(data):
                break
            log.warning("an old %s document lost keys %s that its model does not take",
                        getattr(kind, "__name__", "JSON"), sorted(bad & set(data)))
            data = {k: v for k, v in data.items() if k not in bad}
    return adapter.validate_python({})


class JsonDocument(TypeDecorator[Any]):
    """``mapped_column(JsonDocument(Culprit))``: the model class (or an annotated union of
    models) whose values the column holds."""

    impl = JSONB
    cache_ok = True

    def __init__(self, kind: Any) -> None:
        super().__init__()
        self.kind = kind

    def process_bind_param(self, value: Any, dialect: Dialect) -> dict[str, Any] | None:
        return None if value is None else stored(value, self.kind)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return None if value is None else loaded(value, self.kind)
