"""Where a tracker keeps each job's detector state across restarts: a JetStream object store.

A job's state (JobTracker.state_dict plus the hang monitor's learned times) is a few hundred KB
of JSON for 256 ranks, over NATS's 1 MB message limit for large jobs, so it goes into an object
store (chunked by the server) rather than a KV bucket, compressed. Keys are job ids (subject
tokens, hence valid object names). Any tracker partition can load any job, so a job that moves to
another partition (the partition count changed) resumes there with its state.

The bucket is bounded: an object not rewritten for ``ttl_s`` (a job idle that long; live jobs
are saved every few seconds) expires, and the bucket holds at most ``max_bytes`` (past that a
save fails and is retried, the job's state staying in memory). An existing bucket is brought to
these limits when a tracker opens it.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import OBJ_STREAM_TEMPLATE, ObjectStore

BUCKET = "gh-tracker-state"
DEFAULT_TTL_S = 7 * 24 * 3600.0
DEFAULT_MAX_BYTES = 1 << 30


class TrackerStateStore:
    def __init__(self, js: JetStreamContext, bucket: str = BUCKET, *,
                 ttl_s: float = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 replicas: int = 1) -> None:
        self._js = js
        self.replicas = replicas  # the streams' count (GREYHOUND_STREAM_REPLICAS): 3 on a cluster
        self.bucket = bucket
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._store: ObjectStore | None = None

    async def open(self) -> TrackerStateStore:
        try:
            self._store = await self._js.object_store(self.bucket)
        except (BucketNotFoundError, NotFoundError):
            self._store = await self._js.create_object_store(
                self.bucket, config=ObjectStoreConfig(
                    bucket=self.bucket, storage=StorageType.FILE, ttl=self.ttl_s,
                    max_bytes=self.max_bytes, replicas=self.replicas,
                    description="per-job tracker detector state, for restarts"))
            return self
        await self._limit()
        return self

    async def _limit(self) -> None:
        """A bucket made before it had limits (or with others, or another replica count) gets
        this store's: the bucket is the trackers' own, all started with the same settings."""
        info = await self._js.stream_info(OBJ_STREAM_TEMPLATE.format(bucket=self.bucket))
        cfg = info.config
        if (cfg.max_age, cfg.max_bytes, cfg.num_replicas) == (self.ttl_s, self.max_bytes,
                                                               self.replicas):
            return
        cfg.max_age, cfg.max_bytes, cfg.num_replicas = self.ttl_s, self.max_bytes, self.replicas
        await self._js.update_stream(cfg)

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
