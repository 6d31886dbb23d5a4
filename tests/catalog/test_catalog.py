"""The catalog API against known produced data: counts, deletes applied, lag."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pandas as pd
import pytest
from rich.console import Console

from vchan_assets.catalog import Catalog, SegmentNotFoundError
from vchan_assets.config import Settings
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.storage.rows import apply_deletes_to
from vchan_assets.system import System
from vchan_assets.testing.steps import sync_all
from vchan_assets.wal.producer import Producer, generate_rows

from .helpers import SCHEMA, Known, produce_known


def test_collections_list_the_collection_with_its_rows_and_deletes(catalog: Catalog, known: Known) -> None:
    df = catalog.collections()
    row = df[df["name"] == known.info.name].iloc[0]
    assert row["num_vchannels"] == 2
    assert row["partitions"] == ["_default", "p1"]
    assert row["rows"] == 805
    assert row["deletes"] == 62


def test_segments_are_flushed_with_rows_sizes_and_binlog_counts(catalog: Catalog, known: Known) -> None:
    df = catalog.segments(known.info.name)
    l1 = df[df["level"] == "L1"]
    assert set(l1["state"]) == {"Flushed"}
    assert l1["num_rows"].sum() == 805
    assert (l1["column_groups"] == 2).all()  # scalars, and the one vector field
    assert (l1["binlog_count"] % 2 == 0).all() and (l1["binlog_count"] >= 2).all()
    assert (l1["statslog_count"] == l1["binlog_count"] // 2).all()
    assert (l1["size_bytes"] > 0).all()
    assert not l1["is_sorted"].any()
    l0 = df[df["level"] == "L0"]
    assert l0["num_rows"].sum() == 62
    assert (l0["deltalog_count"] >= 1).all()


def test_binlogs_and_deltalogs_account_for_every_row_and_delete(catalog: Catalog, known: Known) -> None:
    binlogs = catalog.binlogs(known.info.name)
    assert binlogs[binlogs["group"] == 0]["entries"].sum() == 805
    assert set(binlogs["group"]) == {0, SCHEMA.field("vec").field_id}
    assert (binlogs["size_bytes"] > 0).all()
    deltalogs = catalog.deltalogs(known.info.name)
    assert deltalogs["entries"].sum() == 62
    assert set(deltalogs["level"]) == {"L0"}


def test_read_collection_applies_deletes_per_partition_by_timestamp(catalog: Catalog, known: Known) -> None:
    df = catalog.read_collection(known.info.name)
    assert sorted(df["pk"]) == sorted(known.visible)
    # 100 and 101 were deleted in p1 only: their _default rows stay.
    assert {100, 101} <= set(df["pk"])
    # pks 0..4 were deleted and then inserted again: only the newer row is visible.
    assert df[df["pk"] < 5].shape[0] == 5
    raw = catalog.read_collection(known.info.name, apply_deletes=False)
    assert len(raw) == 805
    assert {"vec", "n", "s", "timestamp", "row_id", "segment_id", "partition_id"} <= set(raw.columns)


def test_read_segment_returns_its_rows_with_deletes_applied(catalog: Catalog, known: Known) -> None:
    segs = catalog.segments(known.info.name)
    total = 0
    for segment_id in segs[segs["level"] == "L1"]["segment_id"]:
        rows = catalog.read_segment(int(segment_id), apply_deletes=False)
        assert len(rows) == int(segs.set_index("segment_id").loc[segment_id, "num_rows"])
        total += len(catalog.read_segment(int(segment_id)))
    assert total == len(known.visible)
    l0 = int(segs[segs["level"] == "L0"]["segment_id"].iloc[0])
    assert {"pk", "timestamp"} <= set(catalog.read_segment(l0).columns)
    with pytest.raises(SegmentNotFoundError):
        catalog.read_segment(1)


def test_apply_deletes_keeps_rows_inserted_after_the_delete() -> None:
    import pyarrow as pa

    rows = pa.table({"pk": [1, 2, 3, 1], "timestamp": [10, 10, 10, 30]})
    deletes = pa.table({"pk": [1, 3], "timestamp": [20, 5]})
    kept = apply_deletes_to(rows, deletes, "pk")
    assert kept.to_pydict() == {"pk": [2, 3, 1], "timestamp": [10, 10, 30]}


def test_vchannel_lag_counts_log_messages_after_the_checkpoint(
    catalog: Catalog, known: Known, system: System
) -> None:
    df = catalog.vchannels(known.info.name).set_index("vchannel")
    assert (df["lag_rows"] == 0).all()
    assert (df["lag_seconds"] == 0).all()
    assert (df["lease_node"] == 1).all()
    assert (df["syncs"] == 1).all()
    # 100 new rows: a batch of inserts plus a time tick per vchannel, not yet synced.
    from vchan_assets.wal.producer import Producer

    producer = Producer(system)
    appended = producer.insert(known.info.name, generate_rows(SCHEMA, 100, start_pk=5000, seed=9))
    df = catalog.vchannels(known.info.name).set_index("vchannel")
    for vchannel, result in appended.items():
        assert df.loc[vchannel, "lag_rows"] == result.rows + 1
        assert df.loc[vchannel, "head_offset"] == result.last_offset
        assert df.loc[vchannel, "lag_seconds"] >= 0
    sync_all(system, known.info)
    df = catalog.vchannels(known.info.name)
    assert (df["lag_rows"] == 0).all() and (df["syncs"] == 2).all()


def test_catalog_open_reads_a_configured_etcd_and_s3_storage(
    settings: Settings, store: MetaStore, s3_server: dict[str, str]
) -> None:
    s3 = replace(
        settings,
        storage_uri=f"s3://{s3_server['bucket']}/{uuid.uuid4().hex[:8]}",
        s3_endpoint=s3_server["endpoint"],
    )
    _, known = produce_known(System(s3, store, Storage.from_settings(s3)), "on_s3")
    with Catalog.open(s3) as catalog:
        assert catalog.storage.is_s3
        assert sorted(catalog.read_collection("on_s3")["pk"]) == sorted(known.visible)
        assert (catalog.vchannels("on_s3")["lag_rows"] == 0).all()


def test_a_corrupt_log_file_is_reported_on_its_channel_and_the_others_still_show(
    catalog: Catalog, known: Known, settings: Settings
) -> None:
    broken, healthy = known.info.vchannels
    storage = Storage.from_settings(settings)
    end = int(catalog.vchannels(known.info.name).set_index("vchannel").loc[broken, "end_offset"])
    storage.write_atomic(f"wal/{broken}/{end:020d}.parquet", b"not parquet")
    df = catalog.vchannels(known.info.name).set_index("vchannel")
    assert f"{end:020d}.parquet" in df.loc[broken, "log_error"]
    assert df.loc[healthy, "log_error"] == "" and df.loc[healthy, "lag_rows"] == 0
    from vchan_assets.status import collect_status

    warnings = collect_status(catalog)["warnings"]
    assert [w["vchannel"] for w in warnings if w["kind"] == "log_error"] == [broken]


def test_a_damaged_file_the_sync_needs_makes_the_lag_unknown_not_zero(
    catalog: Catalog, known: Known, settings: Settings, store: MetaStore
) -> None:
    producer = Producer(System(settings, store, catalog.storage))
    producer.insert(known.info.name, generate_rows(SCHEMA, 30, start_pk=5000, seed=9))
    broken = known.info.vchannels[0]
    waiting = catalog.reader(known.info, broken).files()[-1]  # after the checkpoint
    catalog.storage.write_atomic(waiting.key, b"damaged")

    row = (
        Catalog(System(settings, store, catalog.storage))
        .vchannels(known.info.name)
        .set_index("vchannel")
        .loc[broken]
    )

    assert waiting.key in row["log_error"]
    assert pd.isna(row["lag_rows"]) and pd.isna(row["end_offset"])
    from vchan_assets.status import collect_status, render_status

    report = collect_status(Catalog(System(settings, store, catalog.storage)), orphans=False)
    channel = next(c for c in report["channels"] if c["vchannel"] == broken)
    assert channel["lag_rows"] is None
    console = Console(width=200, record=True)
    console.print(render_status(report))
    line = next(line for line in console.export_text().splitlines() if broken in line)
    assert [cell.strip() for cell in line.split("│")[-3:-1]] == ["?", "?"]  # lag msgs, lag s


def test_a_damaged_file_below_the_checkpoint_is_a_warning_and_the_lag_is_known(
    catalog: Catalog, known: Known, settings: Settings, store: MetaStore
) -> None:
    vchannel = known.info.vchannels[0]
    synced = catalog.reader(known.info, vchannel).files()[1]
    catalog.storage.write_atomic(synced.key, b"damaged")
    from vchan_assets.status import collect_status

    report = collect_status(Catalog(System(settings, store, catalog.storage)), orphans=False)

    channel = next(c for c in report["channels"] if c["vchannel"] == vchannel)
    assert channel["log_error"] == "" and channel["lag_rows"] == 0
    damage = [w for w in report["warnings"] if w["kind"] == "log_damaged_below_checkpoint"]
    assert [w["vchannel"] for w in damage] == [vchannel] and synced.key in damage[0]["message"]


def test_segment_table_reads_the_dagster_assets_table_or_says_how_to_get_it(
    catalog: Catalog, known: Known
) -> None:
    with pytest.raises(FileNotFoundError, match="materialize the segment_table asset"):
        catalog.segment_table()
    import pyarrow as pa
    import pyarrow.parquet as pq

    segments = catalog.segments(known.info.name)[["segment_id", "state", "num_rows"]]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pandas(segments, preserve_index=False), sink)
    catalog.storage.write_atomic("catalog/segments.parquet", sink.getvalue())
    assert catalog.segment_table()["num_rows"].sum() == 805 + 62
