"""Typed errors of the metastore; each names the key, channel or endpoints involved."""

from __future__ import annotations


class MetaError(RuntimeError):
    """Base class of metastore errors."""


class MetaUnavailableError(MetaError):
    """etcd did not answer in time or refused the connection."""

    def __init__(self, endpoints: tuple[str, ...] | list[str], operation: str, reason: str) -> None:
        super().__init__(
            f"etcd at {','.join(endpoints)} is unavailable during {operation}: {reason} "
            "(check VCHAN_ETCD_ENDPOINTS, or that the embedded etcd is running)"
        )
        self.endpoints = tuple(endpoints)
        self.operation = operation
        self.reason = reason


class MetaAccessError(MetaError):
    """etcd answered but will not let this process in: its credentials were rejected,
    its TLS handshake failed, or its user may not read and write the root prefix. The
    message names the user and what to check; it never holds the password."""

    def __init__(self, endpoints: tuple[str, ...] | list[str], problem: str, check: str) -> None:
        super().__init__(f"etcd at {','.join(endpoints)}: {problem} ({check})")
        self.endpoints = tuple(endpoints)
        self.problem = problem
        self.check = check


class MalformedValueError(MetaError):
    """A value in etcd is not what its key should hold."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"malformed value at {key}: {reason}")
        self.key = key
        self.reason = reason


class CasConflictError(MetaError):
    """Compare-version-and-swap lost: somebody changed the key since it was read."""

    def __init__(self, key: str, expected_version: int, found_version: int) -> None:
        super().__init__(f"conflict on {key}: expected version {expected_version}, found {found_version}")
        self.key = key
        self.expected_version = expected_version
        self.found_version = found_version


class LeaseLostError(MetaError):
    """The writer no longer holds the channel's lease: its meta write was rejected whole."""

    def __init__(self, channel: str, expected: int, found: int | None) -> None:
        holder = "nobody" if found is None else f"lease {found}"
        super().__init__(
            f"channel {channel}: lease {expected} was revoked or replaced ({holder} holds it now); "
            "the write was rejected and nothing was committed"
        )
        self.channel = channel
        self.expected = expected
        self.found = found


class SyncSupersededError(MetaError):
    """Another sync of the channel (same lease, a later claim) began after this one: this
    one commits nothing, so no range is appended twice. Its files are orphans for GC; the
    channel itself is fine and the next sync goes on from the checkpoint."""

    def __init__(self, channel: str) -> None:
        super().__init__(
            f"channel {channel}: another sync of {channel} claimed the channel after this one began; "
            "this sync committed nothing (its files are orphans for garbage collection)"
        )
        self.channel = channel


class RetriesExhaustedError(MetaError):
    """Every attempt of an optimistic write lost a compare-and-swap to a concurrent writer."""

    def __init__(self, what: str, attempts: int, last: CasConflictError) -> None:
        super().__init__(
            f"{what}: gave up after {attempts} attempts, each lost to a concurrent change ({last})"
        )
        self.what = what
        self.attempts = attempts
        self.last = last


class SegmentNotFoundError(MetaError, LookupError):
    """No segment meta with this id (or at this key): never written, or dropped and
    garbage-collected, or under another root."""

    def __init__(self, segment: int | str) -> None:
        where = f"with id {segment}" if isinstance(segment, int) else f"at {segment}"
        super().__init__(f"no segment {where}")
        self.segment = segment


class CheckpointRegressionError(MetaError):
    """A sync would move a channel checkpoint back (checkpoints only move forward): the
    log's head is behind the committed checkpoint, or someone moved it meanwhile."""

    def __init__(self, channel: str, checkpoint: object, end: object) -> None:
        super().__init__(f"{channel}: refusing to move the checkpoint back from {checkpoint} to {end}")
        self.channel = channel


class NotLeaderError(MetaError):
    """A coordinator write was refused: the writer no longer holds the election it won
    (its term's election key is gone or belongs to a newer leader). Nothing was written."""

    def __init__(self, key: str, create_revision: int, found: int | None) -> None:
        holder = "nobody holds it" if found is None else f"the leader elected at revision {found} holds it"
        super().__init__(
            f"not the leader any more: {key} was created at revision {create_revision} for this "
            f"writer's term, now {holder}; the write was rejected and nothing was committed"
        )
        self.key = key
        self.create_revision = create_revision
        self.found = found
