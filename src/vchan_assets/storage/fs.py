"""The one door to files: local directories and S3 buckets through pyarrow's filesystems.

`Storage` holds a storage root; everything above it uses relative keys
("wal/ch0/00000000000000000000.parquet"), so local and S3 are one code path (the
FileIO layer of PyIceberg, in its role). It reads and writes Parquet and bytes for
everyone and turns pyarrow's errors into `StorageError` naming the path; no other
module touches the filesystem. It is picklable, so Spark tasks rebuild it on the
executors.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from vchan_assets.config import Settings
from vchan_assets.errors import DeclaredError


class StorageError(DeclaredError, OSError):
    """Object storage could not be read or written; names the path."""

    path: str
    reason: str
    message = "storage error at {path}: {reason}"


class ObjectExistsError(StorageError):
    """An exclusive write found the object already there; nothing was written."""

    reason: str = "already exists"


# Linux starts writing a file's dirty pages back when told they are not needed; where
# posix_fadvise is missing (macOS) the pages wait for `make_durable`'s fsync.
_START_WRITEBACK = hasattr(os, "posix_fadvise")


@dataclass(frozen=True)
class Storage:
    """A storage root: `uri` is a local directory or s3://bucket/prefix."""

    uri: str
    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"

    @classmethod
    def from_settings(cls, settings: Settings) -> Storage:
        return cls(settings.storage_uri, settings.s3_endpoint, settings.s3_region)

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")

    @property
    def base(self) -> str:
        """Base path inside the filesystem (bucket/prefix on S3, absolute dir locally)."""
        if self.is_s3:
            return self.uri.removeprefix("s3://").rstrip("/")
        return os.path.abspath(self.uri)

    @property
    def filesystem(self) -> pafs.FileSystem:
        # Looked up per call (one per process and root) so that Storage stays picklable;
        # keyed by pid: a client made before a fork is not used after it.
        return _filesystem(os.getpid(), self.is_s3, self.s3_endpoint, self.s3_region)

    def open_input_file(self, key: str) -> pa.NativeFile:
        """A random-access reader of one object; pyarrow's own errors (the log reader
        turns them into its typed ones)."""
        return self.filesystem.open_input_file(self.path(key))

    def read_parquet(self, key: str, columns: list[str] | None = None) -> pa.Table:
        """A Parquet object as a table (only `columns`, if given); StorageError naming the path."""
        path = self.path(key)
        try:
            with self.filesystem.open_input_file(path) as f:
                return pq.read_table(f, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(path, str(exc)) from exc

    def write_parquet(self, key: str, table: pa.Table, durable: bool = True, **options: Any) -> int:
        """Write `table` as one Parquet object, atomically (`write_atomic_with`, `durable`
        as there); its bytes."""
        try:
            return self.write_atomic_with(
                key, lambda sink: pq.write_table(table, sink, **options), durable=durable
            )
        except pa.ArrowException as exc:
            raise StorageError(self.path(key), str(exc)) from exc

    def path(self, key: str) -> str:
        """Full filesystem path of a relative key."""
        return f"{self.base}/{key.lstrip('/')}"

    def key_of(self, path: str) -> str:
        """Relative key of a full filesystem path."""
        prefix = self.base + "/"
        if not path.startswith(prefix):
            raise StorageError(path, f"not under the storage root {self.base}")
        return path[len(prefix) :]

    def ensure_root(self) -> None:
        try:
            self.filesystem.create_dir(self.base, recursive=True)
        except OSError as exc:
            raise StorageError(self.base, str(exc)) from exc

    def write_atomic(
        self, key: str, data: bytes | pa.Buffer, exclusive: bool = False, durable: bool = True
    ) -> str:
        """Write a whole object so readers never see half of it; returns the full path.

        Locally: write a temporary name, then rename (or, `exclusive`, hard-link: the
        link fails if the name exists, so of two writers of one name exactly one wins and
        the other gets ObjectExistsError). On S3 a single PUT is atomic; `exclusive` is a
        check before the PUT there (pyarrow has no conditional PUT), so two writers must
        not race for one name (the append lock sees to that for log files).

        Locally the file is fsynced before it takes its name. `durable=False` skips that
        wait and only starts the write-back: for a writer of many files that calls
        `make_durable` on them all before anything refers to them (a sync task), so the
        disk writes one file while the task reads and encodes the next.
        """
        self.write_atomic_with(key, lambda out: out.write(memoryview(data)), exclusive, durable)
        return self.path(key)

    def write_atomic_with(
        self, key: str, write: Callable[[Any], None], exclusive: bool = False, durable: bool = True
    ) -> int:
        """Like `write_atomic`, but `write(sink)` streams the object into a file-like sink
        (no intermediate buffer); returns the bytes written."""
        fs = self.filesystem
        final = self.path(key)
        try:
            if self.is_s3:
                if exclusive and self.exists(key):
                    raise ObjectExistsError(final)
                with fs.open_output_stream(final) as out:
                    write(out)
                    return int(out.tell())
            parent = final.rsplit("/", 1)[0]
            fs.create_dir(parent, recursive=True)
            tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as out:
                write(out)
                out.flush()
                if durable:
                    os.fsync(out.fileno())
                elif _START_WRITEBACK:  # start writing it back now, without waiting
                    os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                size = out.tell()
            if not exclusive:
                os.rename(tmp, final)
                return size
            try:
                os.link(tmp, final)
            except FileExistsError:
                raise ObjectExistsError(final) from None
            finally:
                os.unlink(tmp)
            return size
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(final, str(exc)) from exc

    def make_durable(self, keys: Iterable[str]) -> None:
        """Wait until the files written with `durable=False` are on disk (fsync each);
        nothing to wait for on S3, where a PUT is durable when it returns."""
        if self.is_s3:
            return
        for key in keys:
            path = self.path(key)
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise StorageError(path, f"could not be made durable: {exc}") from exc

    def exists(self, key: str) -> bool:
        path = self.path(key)
        try:
            return self.filesystem.get_file_info(path).type == pafs.FileType.File
        except OSError as exc:
            raise StorageError(path, str(exc)) from exc

    def list_files(self, prefix: str) -> list[pafs.FileInfo]:
        """Every file under a relative prefix, recursively, skipping temporary files."""
        selector = pafs.FileSelector(self.path(prefix), recursive=True, allow_not_found=True)
        try:
            infos = self.filesystem.get_file_info(selector)
        except OSError as exc:
            raise StorageError(self.path(prefix), str(exc)) from exc
        return sorted(
            (i for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith(".tmp-")),
            key=lambda i: i.path,
        )

    @property
    def lists_from_key(self) -> bool:
        """True if `list_keys(start_after=...)` costs the keys returned, not the whole
        prefix (S3); a local directory is read whole."""
        return self.is_s3

    def list_keys(self, prefix: str, start_after: str | None = None) -> list[str]:
        """Sorted keys of the files directly under a relative prefix (a "directory"),
        skipping temporary files; only keys after `start_after` if given.

        Names only: nothing is opened or stat'ed. Locally the directory is read once and
        the names after `start_after` are kept; on S3 the listing starts after the key
        (ListObjectsV2's StartAfter), so its cost follows the keys returned, not the ones
        skipped."""
        if self.is_s3:
            return self._s3_keys(prefix, start_after)
        path = self.path(prefix)
        try:
            with os.scandir(path) as entries:
                names = [e.name for e in entries if not e.name.startswith(".tmp-") and e.is_file()]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StorageError(path, str(exc)) from exc
        keys = (prefix.rstrip("/") + "/" + name for name in names)
        return sorted(k for k in keys if start_after is None or k > start_after)

    def _s3_keys(self, prefix: str, start_after: str | None) -> list[str]:
        bucket, _, root = self.base.partition("/")
        full_prefix = f"{root}/{prefix}" if root else prefix
        strip = len(root) + 1 if root else 0
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": full_prefix, "Delimiter": "/"}
        if start_after is not None:
            kwargs["StartAfter"] = f"{root}/{start_after}" if root else start_after
        from botocore.exceptions import BotoCoreError, ClientError

        client = _s3_client(os.getpid(), self.s3_endpoint, self.s3_region)
        keys = []
        try:
            for page in client.get_paginator("list_objects_v2").paginate(**kwargs):
                for item in page.get("Contents", ()):
                    key = item["Key"][strip:]
                    if not key.rsplit("/", 1)[-1].startswith(".tmp-"):
                        keys.append(key)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(self.path(prefix), str(exc)) from exc
        return sorted(keys)

    def read_bytes(self, key: str) -> bytes:
        path = self.path(key)
        try:
            with self.filesystem.open_input_stream(path) as f:
                return bytes(f.read())
        except OSError as exc:
            raise StorageError(path, str(exc)) from exc

    def delete(self, key: str) -> None:
        try:
            self.filesystem.delete_file(self.path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StorageError(self.path(key), str(exc)) from exc


def filesystem_for(uri: str, s3_endpoint: str | None, s3_region: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) of a file outside the storage root: a local path, or
    s3://bucket/key on the configured S3 endpoint (bulk import reads its input here)."""
    if uri.startswith("s3://"):
        return _filesystem(os.getpid(), True, s3_endpoint, s3_region), uri.removeprefix("s3://")
    return _filesystem(os.getpid(), False, None, s3_region), os.path.abspath(uri.removeprefix("file://"))


@functools.cache
def _filesystem(pid: int, s3: bool, endpoint: str | None, region: str) -> pafs.FileSystem:
    if s3:
        scheme, _, host = (endpoint or "").partition("://")
        kwargs: dict[str, object] = {"region": region}
        if endpoint:
            kwargs["endpoint_override"] = host or scheme
            kwargs["scheme"] = scheme if host else "https"
        return pafs.S3FileSystem(**kwargs)  # credentials from the AWS_* environment
    return pafs.LocalFileSystem()


@functools.cache
def _s3_client(pid: int, endpoint: str | None, region: str) -> Any:
    """A boto3 S3 client (pyarrow's S3 filesystem cannot list from a key); credentials
    from the AWS_* environment, as pyarrow's."""
    import boto3  # only S3 roots pay its import

    return boto3.client("s3", endpoint_url=endpoint or None, region_name=region)
