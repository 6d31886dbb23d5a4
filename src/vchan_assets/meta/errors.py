"""Typed errors of the metastore; each names the key, channel or endpoints involved."""

from __future__ import annotations

from vchan_assets.errors import DeclaredError


class MetaError(RuntimeError):
    """Base class of metastore errors."""


class MetaUnavailableError(DeclaredError, MetaError):
    """etcd did not answer in time or refused the connection."""

    endpoints: tuple[str, ...]
    operation: str
    reason: str

    def __str__(self) -> str:
        return (
            f"etcd at {','.join(self.endpoints)} is unavailable during {self.operation}: {self.reason} "
            "(check VCHAN_ETCD_ENDPOINTS, or that the embedded etcd is running)"
        )


class MetaAccessError(DeclaredError, MetaError):
    """etcd answered but will not let this process in: its credentials were rejected,
    its TLS handshake failed, or its user may not read and write the root prefix. The
    message names the user and what to check; it never holds the password."""

    endpoints: tuple[str, ...]
    problem: str
    check: str

    def __str__(self) -> str:
        return f"etcd at {','.join(self.endpoints)}: {self.problem} ({self.check})"


class MalformedValueError(DeclaredError, MetaError):
    """A value in etcd is not what its key should hold."""

    key: str
    reason: str
    message = "malformed value at {key}: {reason}"


class CasConflictError(DeclaredError, MetaError):
    """Compare-version-and-swap lost: somebody changed the key since it was read."""

    key: str
    expected_version: int
    found_version: int
    message = "conflict on {key}: expected version {expected_version}, found {found_version}"


class LeaseLostError(DeclaredError, MetaError):
    """The writer no longer holds the channel's lease: its meta write was rejected whole."""

    channel: str
    expected: int
    found: int | None

    def __str__(self) -> str:
        holder = "nobody" if self.found is None else f"lease {self.found}"
        return (
            f"channel {self.channel}: lease {self.expected} was revoked or replaced ({holder} holds it now); "
            "the write was rejected and nothing was committed"
        )


class SyncSupersededError(DeclaredError, MetaError):
    """Another sync of the channel (same lease, a later claim) began after this one: this
    one commits nothing, so no range is appended twice. Its files are orphans for GC; the
    channel itself is fine and the next sync goes on from the checkpoint."""

    channel: str
    message = (
        "channel {channel}: another sync of {channel} claimed the channel after this one began; "
        "this sync committed nothing (its files are orphans for garbage collection)"
    )


class RetriesExhaustedError(DeclaredError, MetaError):
    """Every attempt of an optimistic write lost a compare-and-swap to a concurrent writer."""

    what: str
    attempts: int
    last: CasConflictError
    message = "{what}: gave up after {attempts} attempts, each lost to a concurrent change ({last})"


class SegmentNotFoundError(DeclaredError, MetaError, LookupError):
    """No segment meta with this id (or at this key): never written, or dropped and
    garbage-collected, or under another root."""

    segment: int | str

    def __str__(self) -> str:
        where = f"with id {self.segment}" if isinstance(self.segment, int) else f"at {self.segment}"
        return f"no segment {where}"


class CheckpointRegressionError(DeclaredError, MetaError):
    """A sync would move a channel checkpoint back (checkpoints only move forward): the
    log's head is behind the committed checkpoint, or someone moved it meanwhile."""

    channel: str
    checkpoint: object
    end: object
    message = "{channel}: refusing to move the checkpoint back from {checkpoint} to {end}"


class NotLeaderError(DeclaredError, MetaError):
    """A coordinator write was refused: the writer no longer holds the election it won
    (its term's election key is gone or belongs to a newer leader). Nothing was written."""

    key: str
    create_revision: int
    found: int | None

    def __str__(self) -> str:
        holder = (
            "nobody holds it"
            if self.found is None
            else f"the leader elected at revision {self.found} holds it"
        )
        return (
            f"not the leader any more: {self.key} was created at revision {self.create_revision} for this "
            f"writer's term, now {holder}; the write was rejected and nothing was committed"
        )


class ValueTooLargeError(DeclaredError, MetaError):
    """A value over the size bound of one etcd value: refused before it is sent, so a
    listing of its prefix can always be read in pages under gRPC's receive limit."""

    key: str
    size: int
    limit: int
    message = "refusing to write {key}: its value is {size} bytes, over the bound of {limit} bytes"


class TransactionTooLargeError(DeclaredError, MetaError):
    """A transaction over etcd's bounds (operations per branch, bytes per request),
    refused before it is sent: etcd would refuse it whole with an opaque message."""

    operation: str
    operations: int
    size: int
    max_operations: int
    max_size: int
    message = (
        "refusing {operation}: {operations} operations and {size} bytes, over etcd's bounds of "
        "{max_operations} operations and {max_size} bytes per transaction"
    )


class RevisionCompactedError(DeclaredError, MetaError):
    """A read at a revision etcd has compacted away: the caller lists again from now."""

    prefix: str
    revision: int
    message = "listing {prefix} at revision {revision}: the revision was compacted"
