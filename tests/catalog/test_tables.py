"""The catalog's tables keep the dtypes of their Arrow schema, empty or full: an empty
catalog's frames have the columns and dtypes of a populated one's (int64 stays int64, a
nullable int64 Int64, times stay UTC times, strings str objects, lists lists)."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import pyarrow as pa
import pytest

from vchan_assets import catalog_tables as tables
from vchan_assets.catalog import Catalog
from vchan_assets.imports.jobs import ImportFile, ImportJob, create_job
from vchan_assets.indexes.meta import create_index
from vchan_assets.lifecycle.compaction import CompactionTrigger
from vchan_assets.lifecycle.plans import CompactionType
from vchan_assets.model import Binlog, DataLoss, SegmentInfo, SegmentState
from vchan_assets.wal.producer import Producer
from vchan_assets.wal.quarantine import record_loss

from .helpers import SCHEMA, Known

# Each table with the catalog method that returns it.
FRAMES: list[tuple[tables.Table, Callable[[Catalog], pd.DataFrame]]] = [
    (tables.COLLECTIONS, lambda c: c.collections(include_dropped=True)),
    (tables.VCHANNELS, lambda c: c.vchannels()),
    (tables.SEGMENTS, lambda c: c.segments()),
    (tables.COMPACTIONS, lambda c: c.compactions()),
    (tables.DATA_LOSSES, lambda c: c.data_losses()),
    (tables.IMPORTS, lambda c: c.imports()),
    (tables.INDEXES, lambda c: c.indexes()),
    (tables.BINLOGS, lambda c: c.binlogs()),
    (tables.DELTALOGS, lambda c: c.deltalogs()),
    (tables.DELTALOGS, lambda c: c.statslogs()),
]
IDS = [f"{t.name}-{i}" for i, (t, _) in enumerate(FRAMES)]


def expected_dtypes(schema: pa.Schema) -> dict[str, str]:
    """The pandas dtype of each column by its Arrow field (catalog_tables' rule)."""

    def dtype(field: pa.Field) -> str:
        kind = field.type
        if pa.types.is_integer(kind):
            return "Int64" if field.nullable else "int64"
        if pa.types.is_boolean(kind):
            return "bool"
        if pa.types.is_floating(kind):
            return "float64"
        if pa.types.is_timestamp(kind):
            return "datetime64[ns, UTC]"
        return "object"  # strings, lists, maps

    return {f.name: dtype(f) for f in schema}


def dtypes(frame: pd.DataFrame) -> dict[str, str]:
    return {name: str(kind) for name, kind in frame.dtypes.items()}


def populate(catalog: Catalog, known: Known) -> None:
    """A row in the tables `known` leaves empty: an index, a compaction plan, an import
    job and a data loss, each a record in etcd as their own code writes it."""
    store, info = catalog.store, known.info
    create_index(store, info, "vec", "IVF_FLAT", "L2", {"nlist": 8})
    assert CompactionTrigger(catalog.system).trigger(info, CompactionType.SORT, manual=True)
    job = ImportJob(
        job_id=41,
        collection_id=info.id,
        collection=info.name,
        partition_id=info.partitions[0],
        partition=info.partition_names[0],
        files=(ImportFile("/nowhere/rows.parquet"),),
    )
    create_job(store, job)
    loss = DataLoss(
        loss_id=42,
        collection_id=info.id,
        kind="log",
        path="wal/x/1.parquet",
        moved_to="quarantine/wal/x/1.parquet",
        reason="footer has no offsets",
        vchannel=info.vchannels[0],
        first_offset=3,
        last_offset=5,
    )
    record_loss(catalog.system, loss)


@pytest.mark.parametrize(("table", "read"), FRAMES, ids=IDS)
def test_an_empty_catalog_returns_the_tables_columns_and_dtypes(
    catalog: Catalog, table: tables.Table, read: Callable[[Catalog], pd.DataFrame]
) -> None:
    frame = read(catalog)

    assert frame.empty
    assert list(frame.columns) == table.schema.names
    assert dtypes(frame) == expected_dtypes(table.schema)


def test_a_populated_catalog_returns_the_same_columns_and_dtypes(catalog: Catalog, known: Known) -> None:
    populate(catalog, known)

    for table, read in FRAMES:
        frame = read(catalog)
        assert len(frame), table.name
        assert list(frame.columns) == table.schema.names, table.name
        assert dtypes(frame) == expected_dtypes(table.schema), table.name
        for field in table.schema:
            value = frame[field.name].dropna().iloc[0] if frame[field.name].notna().any() else None
            if pa.types.is_list(field.type):
                assert isinstance(value, list), (table.name, field.name)
            elif pa.types.is_map(field.type):
                assert isinstance(value, dict), (table.name, field.name)
            elif pa.types.is_timestamp(field.type) and value is not None:
                assert isinstance(value, pd.Timestamp) and str(value.tz) == "UTC", (table.name, field.name)


def test_nulls_keep_the_columns_dtype(catalog: Catalog, known: Known) -> None:
    populate(catalog, known)
    Producer(catalog.system).create_collection("never_written", SCHEMA, num_channels=1)

    plan = catalog.compactions().iloc[0]
    channels = catalog.vchannels().set_index("collection")
    index = catalog.indexes().iloc[0]

    assert plan["state"] == "Pending" and pd.isna(plan["finished_at"])  # not finished: NaT
    fresh, synced = channels.loc["never_written"], channels.loc[known.info.name]
    assert (
        pd.isna(fresh["lease_id"])
        and pd.isna(fresh["checkpoint_offset"])
        and pd.isna(fresh["checkpoint_time"])
    )
    assert synced["lease_id"].notna().all() and (synced["lag_rows"] == 0).all()
    assert str(channels["lease_id"].dtype) == str(channels["checkpoint_offset"].dtype) == "Int64"
    assert index["params"] == {"nlist": 8} and index["fail_reasons"] == {}
    [loss] = catalog.data_losses().to_dict("records")
    assert (loss["first_offset"], loss["last_offset"], loss["messages"]) == (3, 5, 3)


def test_the_segment_table_asset_keeps_the_segments_dtypes(catalog: Catalog, known: Known) -> None:
    _, written = catalog.write_segment_table()

    assert written.schema.equals(tables.SEGMENTS.schema)
    assert dtypes(catalog.segment_table()) == dtypes(catalog.segments())
    assert catalog.segment_table().equals(catalog.segments())


def test_a_row_that_is_not_the_schemas_is_refused() -> None:
    segment = SegmentInfo(id=7, collection_id=1, partition_id=2, vchannel="c_0", state=SegmentState.FLUSHED)
    row = tables.file_row(segment, Binlog(log_id=3, path="p", entries=4, ts_from=5, ts_to=6, size_bytes=7))
    assert tables.DELTALOGS.frame([row])["size_bytes"].tolist() == [7]

    with pytest.raises(ValueError, match=r"does not match its schema: \['extra'\]"):
        tables.DELTALOGS.frame([{**row, "extra": 1}])
    with pytest.raises(ValueError, match="column 'path' of the deltalogs table is null in a row"):
        tables.DELTALOGS.frame([{**row, "path": None}])
