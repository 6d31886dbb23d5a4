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
