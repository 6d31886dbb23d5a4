"""The etcd key layout (docs/architecture.md, "Keys in etcd"), in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    root: str = "vchan"

    def _k(self, *parts: object) -> str:
        return "/".join([self.root, *(str(p) for p in parts)])

    # sessions
    def datanode_sessions(self) -> str:
        return self._k("session", "datanode") + "/"

    def datanode_session(self, node_id: int) -> str:
        return self._k("session", "datanode", node_id)

    def datacoord_session(self) -> str:
        return self._k("session", "datacoord")

    # channel watch
    def channel_watch_root(self) -> str:
        return self._k("channelwatch") + "/"

    def channel_watch_prefix(self, node_id: int | str) -> str:
        return self._k("channelwatch", node_id) + "/"

    def channel_watch(self, node_id: int | str, vchannel: str) -> str:
        return self._k("channelwatch", node_id, vchannel)

    def remaining_channel(self, vchannel: str) -> str:
        return self._k("channelwatch", "remaining", vchannel)

    # meta
    def collections(self) -> str:
        return self._k("meta", "collection") + "/"

    def collection(self, collection_id: int) -> str:
        return self._k("meta", "collection", collection_id)

    def segments(self, collection_id: int | None = None) -> str:
        if collection_id is None:
            return self._k("meta", "segment") + "/"
        return self._k("meta", "segment", collection_id) + "/"

    def segment(self, collection_id: int, partition_id: int, segment_id: int) -> str:
        return self._k("meta", "segment", collection_id, partition_id, segment_id)

    def channel_checkpoints(self) -> str:
        return self._k("meta", "channel-cp") + "/"

    def channel_checkpoint(self, vchannel: str) -> str:
        return self._k("meta", "channel-cp", vchannel)

    def channel_leases(self) -> str:
        return self._k("meta", "channel-lease") + "/"

    def channel_lease(self, vchannel: str) -> str:
        return self._k("meta", "channel-lease", vchannel)

    def channel_sync(self, vchannel: str) -> str:
        return self._k("meta", "channel-sync", vchannel)

    # multi-writer log: per-channel head and append lock
    def wal_heads(self) -> str:
        return self._k("wal-head") + "/"

    def wal_head(self, vchannel: str) -> str:
        return self._k("wal-head", vchannel)

    def wal_lock(self, vchannel: str) -> str:
        return self._k("wal-lock", vchannel)

    def id_allocator(self) -> str:
        return self._k("meta", "id")

    def tso(self) -> str:
        return self._k("meta", "tso")

    # segment lifecycle
    def compaction_plans(self) -> str:
        return self._k("meta", "compaction") + "/"

    def compaction_plan(self, plan_id: int) -> str:
        return self._k("meta", "compaction", plan_id)

    # bulk import
    def import_jobs(self) -> str:
        return self._k("meta", "import") + "/"

    def import_job(self, job_id: int) -> str:
        return self._k("meta", "import", job_id)

    def gc_pause(self) -> str:
        return self._k("meta", "gc", "pause")

    def gc_last_run(self) -> str:
        return self._k("meta", "gc", "last-run")
