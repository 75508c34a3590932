"""Where a tracker keeps each job's detector state across restarts: a JetStream object store.

A job's state (JobTracker.state_dict plus the hang monitor's learned times) is a few hundred KB
of JSON for 256 ranks, over NATS's 1 MB message limit for large jobs, so it goes into an object
store (chunked by the server) rather than a KV bucket, compressed. Keys are job ids (subject
tokens, hence valid object names). Any tracker partition can load any job, so a job that moves to
another partition (the partition count changed) resumes there with its state.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

BUCKET = "gh-tracker-state"


class TrackerStateStore:
    def __init__(self, js: JetStreamContext, bucket: str = BUCKET) -> None:
        self._js = js
        self.bucket = bucket
        self._store: ObjectStore | None = None

    async def open(self) -> TrackerStateStore:
        try:
            self._store = await self._js.object_store(self.bucket)
        except (BucketNotFoundError, NotFoundError):
            self._store = await self._js.create_object_store(
                self.bucket, config=ObjectStoreConfig(
                    bucket=self.bucket, storage=StorageType.FILE,
                    description="per-job tracker detector state, for restarts"))
        return self

    def _obs(self) -> ObjectStore:
        if self._store is None:
            raise RuntimeError("TrackerStateStore.open() was not awaited")
        return self._store

    async def save(self, job: str, state: dict[str, Any]) -> None:
        data = zlib.compress(json.dumps(state, separators=(",", ":")).encode(), 1)
        await self._obs().put(job, data)

    async def load(self, job: str) -> dict[str, Any] | None:
        try:
            res = await self._obs().get(job)
        except (ObjectNotFoundError, NotFoundError):
            return None
        if res.data is None:
            return None
        state: dict[str, Any] = json.loads(zlib.decompress(res.data))
        return state

    async def delete(self, job: str) -> None:
        try:
            await self._obs().delete(job)
        except (ObjectNotFoundError, NotFoundError):
            return
