"""The etcd key layout (docs/architecture.md, "Keys in etcd"), in one place.

Most keys come in families that share a prefix, declared once each as a template:
`keys.segment(c, p, s)` is one key, `keys.segment.prefix` the prefix of all of them (to
list or watch) and `keys.segment.under(c)` the prefix of one collection's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self, overload


@dataclass(frozen=True)
class KeyFamily:
    """The keys `{prefix}{id}/{id}/...`, one id for each name in `ids`."""

    prefix: str  # ends in "/"
    ids: tuple[str, ...]  # what the ids of a key are, outermost first: ("node", "vchannel")

    def __call__(self, *ids: int | str) -> str:
        """The key of these ids (all of them)."""
        if len(ids) != len(self.ids):
            raise TypeError(f"a key {self.template()} takes {len(self.ids)} ids, not {len(ids)}: {ids!r}")
        return self.prefix + "/".join(str(i) for i in ids)

    def under(self, *ids: int | str) -> str:
        """The prefix of the keys whose outer ids are these (fewer than a key has)."""
        if len(ids) >= len(self.ids):
            raise TypeError(f"a range of {self.template()} takes fewer than {len(self.ids)} ids: {ids!r}")
        return self.prefix + "".join(f"{i}/" for i in ids)

    def template(self) -> str:
        return self.prefix + "/".join(f"{{{name}}}" for name in self.ids)


class _Family:
    """Declares a KeyFamily on `Keys` by its template below the root, as the docs write it
    ("meta/segment/{collection}/{partition}/{segment}"); each `Keys` gets it under its root."""

    def __init__(self, template: str) -> None:
        path, _, ids = template.partition("/{")
        self.path, self.ids = path, tuple(ids.removesuffix("}").split("}/{"))
        if not path or not ids or any(not i or "/" in i for i in self.ids):
            raise ValueError(f"key family {template!r} is not path/{{id}}/...")

    @overload
    def __get__(self, keys: None, owner: type[Keys]) -> Self: ...
    @overload
    def __get__(self, keys: Keys, owner: type[Keys]) -> KeyFamily: ...
    def __get__(self, keys: Keys | None, owner: type[Keys]) -> KeyFamily | Self:
        return self if keys is None else KeyFamily(f"{keys.root}/{self.path}/", self.ids)


@dataclass(frozen=True)
class Keys:
    root: str = "vchan"

    def _k(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # sessions
    datanode_session = _Family("session/datanode/{node}")
    # a process that loads indexes (search): states the index engine versions it reads
    reader_session = _Family("session/reader/{reader}")

    def datacoord_session(self) -> str:
        return self._k("session", "datacoord")

    def sessions(self) -> str:
        """The prefix of every session (datanodes, the DataCoord, readers)."""
        return self._k("session", "")

    # channel watch: a vchannel waiting for a live node sits under the node name "remaining"
    channel_watch = _Family("channelwatch/{node}/{vchannel}")
    remaining_channel = _Family("channelwatch/remaining/{vchannel}")

    # meta
    collection = _Family("meta/collection/{collection}")
    segment = _Family("meta/segment/{collection}/{partition}/{segment}")
    # a Dropped segment's record, moved out of `segment` in the transaction that drops it
    # (meta/segments.py): live listings never read it; GC deletes it after the tolerance.
    # By vchannel: a sync reads its own vchannel's dropped records, one prefix
    dropped_segment = _Family("meta/dropped/{collection}/{vchannel}/{partition}/{segment}")
    # the segments of each vchannel: one entry per segment key, created and deleted with it
    # (meta/segments.py), so a vchannel's segments are read without its collection's
    channel_segment = _Family("meta/channel-segment/{vchannel}/{collection}/{partition}/{segment}")

    def channel_segment_index(self) -> str:
        """The mark that every segment key has its `channel_segment` entry (written once
        the backfill of a stack older than the index finished)."""
        return self._k("meta", "channel-segment-index")

    # a collection's segment meta counted (by vchannel, state and level), for `vchan status`
    segment_summary = _Family("meta/summary/{collection}")

    channel_checkpoint = _Family("meta/channel-cp/{vchannel}")
    channel_lease = _Family("meta/channel-lease/{vchannel}")
    channel_sync = _Family("meta/channel-sync/{vchannel}")

    # multi-writer log: per-channel head and append lock
    wal_head = _Family("wal-head/{vchannel}")
    wal_lock = _Family("wal-lock/{vchannel}")

    def id_allocator(self) -> str:
        return self._k("meta", "id")

    def tso(self) -> str:
        return self._k("meta", "tso")

    # segment lifecycle
    compaction_plan = _Family("meta/compaction/{plan}")

    # indexes: one per vector field, and the build of each on each segment
    field_index = _Family("meta/field-index/{collection}/{index}")
    segment_index = _Family("meta/segment-index/{collection}/{partition}/{segment}/{build}")

    # the DataCoord's sort and index tasks: one per (kind, segment)
    task = _Family("meta/task/{kind}/{collection}/{segment}")

    # bulk import
    import_job = _Family("meta/import/{job}")

    # reads that pin the segments they planned (GC keeps their files)
    read_pin = _Family("meta/read-pin/{pin}")

    # change streams: the offsets their sinks committed (log retention keeps what follows)
    stream = _Family("meta/stream/{stream}")

    # damaged files an operator quarantined (`vchan quarantine`): what was lost, kept for good
    data_loss = _Family("meta/data-loss/{collection}/{loss}")

    def gc_pause(self) -> str:
        return self._k("meta", "gc", "pause")

    def gc_last_run(self) -> str:
        return self._k("meta", "gc", "last-run")
