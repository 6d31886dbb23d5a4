"""Every error of the package survives pickling (Spark ships them between processes) with
its type, its message and its fields, and declared errors keep exception semantics."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pickle
import pkgutil

import pyarrow as pa
import pytest

import vchan_assets
from vchan_assets.errors import DeclaredError
from vchan_assets.meta.errors import CasConflictError
from vchan_assets.model import SegmentInfo, SegmentLevel, SegmentState

_SEGMENT = SegmentInfo(
    id=7, collection_id=1, partition_id=2, vchannel="c_0", state=SegmentState.FLUSHED, level=SegmentLevel.L1
)

# Constructor arguments of every error whose constructor takes more than a message.
SAMPLES: dict[str, tuple[object, ...]] = {
    "config.ConfigError": ("VCHAN_X", "-1", "a number greater than 0"),
    "config.SettingsTableError": ("VCHAN_X", "unknown type 'flaot'"),
    "datacoord.collections.CollectionExistsError": ("docs", 3),
    "datacoord.collections.CollectionNotFoundError": (4,),
    "datacoord.collections.InvalidNameError": ("collection", "1x"),
    "datacoord.collections.InvalidSchemaError": ("docs", "no primary key"),
    "datacoord.collections.PartitionExistsError": ("docs", "p1"),
    "datacoord.collections.PartitionNotFoundError": ("docs", "p2"),
    "datacoord.collections.VchannelNotFoundError": ("c_9", "docs"),
    "datacoord.watchers.NotWatcherError": ("c_0", 5, "ToRelease"),
    "imports.executor.ImportFailed": ("file gone",),
    "indexes.build.IndexBuildError": (12, 7, "vectors unreadable"),
    "indexes.meta.IndexConflictError": ("docs", "vec", "'vec' on 'vec' (HNSW, L2)"),
    "indexes.meta.IndexNotFoundError": ("docs", "named 'vec'"),
    "indexes.meta.InvalidIndexError": ("docs", "vec", "nlist=0 is out of range [1, 65536]"),
    "imports.files.ImportInputError": ("in.parquet", "not a number", "age"),
    "imports.jobs.ImportJobConflictError": (8, "files"),
    "imports.jobs.ImportJobNotFoundError": (8,),
    "imports.jobs.ImportJobTakenError": (8,),
    "lifecycle.plans.CompactionConflictError": (9, "seg/1", "changed"),
    "lifecycle.task.CompactionInputError": (9, "a/b.parquet", "truncated"),
    "meta.channel_head.AppendLockLostError": ("c_0", "the commit"),
    "meta.channel_head.AppendLockTimeoutError": ("c_0", 2.5, None),
    "meta.errors.CasConflictError": ("k", 3, 4),
    "meta.errors.CheckpointRegressionError": ("c_0", 10, 5),
    "meta.errors.LeaseLostError": ("c_0", 11, None),
    "meta.errors.MalformedValueError": ("k", "not JSON"),
    "meta.errors.MetaAccessError": (("a:1", "b:2"), "authentication failed", "check VCHAN_ETCD_USER"),
    "meta.errors.MetaUnavailableError": (("a:1",), "get k", "deadline exceeded"),
    "meta.errors.NotLeaderError": ("election/1", 12, 13),
    "meta.errors.RetriesExhaustedError": ("allocate", 3, CasConflictError("k", 1, 2)),
    "meta.errors.RevisionCompactedError": ("vchan/meta/segment/1/", 40),
    "meta.errors.SegmentNotFoundError": (14,),
    "meta.errors.SyncSupersededError": ("c_0",),
    "meta.errors.TransactionTooLargeError": ("transaction on k", 129, 2048, 128, 1572864),
    "meta.errors.ValueTooLargeError": ("k", 1048577, 1048576),
    "meta.session.SessionConflictError": ("session/1", 0),
    "meta.session.SessionRefusedError": ("session/datanode/1", 7),
    "datacoord.read_pins.ReadPinLostError": (7, 600.0, "insert_log/1/2/3/4"),
    "query.asof.TimeTravelError": ("1999-01-01", "older than the time-travel window"),
    "query.asof.LogMovedError": ("by-dml_0_1v0", 41, 57),
    "query.stream_source.StreamCollectionDroppedError": ("books", 7, '{"c_0": 41}'),
    "query.stream_source.StreamOffsetError": ('{"c_0": "x"}', "offsets must be integers >= -1"),
    "query.stream_source.StreamOffsetRemovedError": ("c_0", 12, 40),
    "query.prune.FilterError": ("'pk' '~' 3", "unknown operator '~'"),
    "query.search_options.SearchError": ("docs", "k must be an integer in [1, 16384], got 0"),
    "query.spark_source.SegmentColumnError": (_SEGMENT, "vec", ["pk"]),
    "spark.session.SparkJobTimeoutError": ("sync c_0", 600.0),
    "spark.session.SparkUnavailableError": ("Py4JNetworkError: An error occurred while trying to connect",),
    "storage.fs.ObjectExistsError": ("a/b",),
    "storage.fs.StorageError": ("a/b", "permission denied"),
    "wal.backpressure.WriteLagExceededError": ("c_0", 2100.5, 310.0, "VCHAN_WRITE_LAG_LIMIT_MB=2048"),
    "wal.format.CorruptLogError": ("wal/c_0/1.parquet", "footer has no offsets"),
    "wal.format.SchemaMismatchError": (
        "wal/c_0/1.parquet",
        pa.schema([("pk", pa.int64()), ("v", pa.float32())]),
        pa.schema([("pk", pa.string()), ("w", pa.float32())]),
    ),
    "wal.format.UnknownMessageTypeError": ("wal/c_0/1.parquet", 3, "upsert"),
    "wal.quarantine.NotDamagedError": ("wal/c_0/1.parquet", "it reads (3 messages)"),
    "wal.writer.InvalidBatchError": ("c_0", "timestamps go back"),
    "wal.writer.LogConflictError": ("wal/c_0/1.parquet", "c_0"),
}


def _package_errors() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(vchan_assets.__path__, "vchan_assets."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{obj.__module__.removeprefix('vchan_assets.')}.{obj.__qualname__}"] = obj
    return [found[name] for name in sorted(found)]


ERRORS = [c for c in _package_errors() if c is not DeclaredError]  # a base, never raised


def _name(cls: type[BaseException]) -> str:
    return f"{cls.__module__.removeprefix('vchan_assets.')}.{cls.__qualname__}"


def _sample(cls: type[BaseException]) -> BaseException:
    return cls(*SAMPLES.get(_name(cls), ("a message",)))


def test_every_declared_error_has_a_sample() -> None:
    missing = [_name(c) for c in ERRORS if issubclass(c, DeclaredError) and _name(c) not in SAMPLES]
    assert not missing, f"add constructor arguments for {missing} to SAMPLES"


@pytest.mark.parametrize("cls", ERRORS, ids=_name)
def test_error_round_trips_through_pickle(cls: type[BaseException]) -> None:
    err = _sample(cls)
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err)
    if _name(cls) == "query.spark_source.SegmentColumnError":
        # Leaves a Spark Python worker as a plain LookupError: the message is what crosses.
        assert type(copy) is LookupError
        return
    assert type(copy) is cls
    assert repr(copy) == repr(err)
    if isinstance(err, DeclaredError):
        for f in dataclasses.fields(err):
            value, copied = getattr(err, f.name), getattr(copy, f.name)
            if isinstance(value, BaseException):  # compared by identity: compare what it says
                value, copied = repr(value), repr(copied)
            assert copied == value, f.name


@pytest.mark.parametrize("cls", [c for c in ERRORS if issubclass(c, DeclaredError)], ids=_name)
def test_declared_error_is_an_exception_like_any_other(cls: type[BaseException]) -> None:
    err, twin = _sample(cls), _sample(cls)
    assert err != twin and len({err, twin}) == 2  # identity, as for every exception
    assert repr(err) == f"{cls.__name__}({str(err)!r})"
    with pytest.raises(cls, match="."):
        raise err
