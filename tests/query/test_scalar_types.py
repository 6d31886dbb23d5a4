"""Every scalar type of Milvus, nullable fields and defaults, end to end: inserted (fields
left out and nulls given), deleted, synced into binlogs, sorted and compacted, imported,
read back by pandas, Spark and the change stream, and returned by search. Real etcd, real
files, a real local Spark."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pytest
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, ByteType, IntegerType, ShortType, StringType

from vchan_assets.catalog import Catalog
from vchan_assets.imports.jobs import ImportState
from vchan_assets.model import CollectionInfo, CollectionSchema
from vchan_assets.query.spark_source import spark_session
from vchan_assets.query.stream_source import VchanStreamReader
from vchan_assets.system import System
from vchan_assets.testing.import_files import run_import, write_parquet
from vchan_assets.testing.steps import compact_all, new_collection, sync_all
from vchan_assets.testing.streams import stream_options
from vchan_assets.wal.producer import Producer, generate_rows

TYPED = CollectionSchema.build(
    "pk",
    {"vec": 4},
    {
        "i8": "int8",
        "i16": "int16?",
        "i32": "int32=-1",
        "f": "float",
        "d": "double?",
        "b": "bool=false",
        "name": "varchar(12)",
        "meta": "json?",
        "tags": "array(varchar(6), 4)",
        "ranks": "array(int64, 3)?",
    },
)
COLUMNS = ["pk", "i8", "i16", "i32", "f", "d", "b", "name", "meta", "tags", "ranks"]


def typed_rows(n: int, start_pk: int, seed: int) -> pa.Table:
    """Rows with every field; every third row's nullable fields null; `i32` and `b` left
    out (their defaults fill them)."""
    table = generate_rows(TYPED, n, start_pk=start_pk, seed=seed)
    nulls = pa.array(np.arange(n) % 3 == 0)
    for name in ("i16", "d", "meta", "ranks"):
        column = table[name].combine_chunks()
        table = table.set_column(
            table.schema.get_field_index(name), name, pa.compute.if_else(nulls, None, column)
        )
    return table.drop_columns(["i32", "b"])


@pytest.fixture
def typed(producer: Producer, system: System) -> tuple[CollectionInfo, pd.DataFrame]:
    """A collection of TYPED: 2 rounds of 150 rows, 20 deletes, flushed and synced; the rows
    a reader must see."""
    info = new_collection(producer, schema=TYPED, prefix="typed")
    first, second = typed_rows(150, 0, seed=1), typed_rows(150, 1000, seed=2)
    producer.insert(info.name, first)
    producer.insert(info.name, second)
    producer.delete(info.name, list(range(20)))
    producer.flush(info.name)
    sync_all(system, info)
    expected = pa.concat_tables([first, second]).to_pandas()
    expected = expected[expected["pk"] >= 20].assign(i32=-1, b=False)
    return info, expected.sort_values("pk").reset_index(drop=True)[COLUMNS]


def _read(catalog: Catalog, info: CollectionInfo) -> pd.DataFrame:
    frame = catalog.read_collection(info.name)
    return frame.sort_values("pk").reset_index(drop=True)[COLUMNS]


def _assert_same(got: pd.DataFrame, expected: pd.DataFrame) -> None:
    for name in COLUMNS:  # lists and None compare as Python values
        assert [_plain(v) for v in got[name]] == [_plain(v) for v in expected[name]], name


def _plain(value: object) -> object:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, float) and np.isnan(value):
        return None
    return value


def test_every_scalar_type_is_read_back_as_inserted_after_sync_sort_and_compaction(
    system: System, typed: tuple[CollectionInfo, pd.DataFrame]
) -> None:
    info, expected = typed
    catalog = Catalog(system)
    got = _read(catalog, info)
    assert {n: str(t) for n, t in got.dtypes.items() if n in ("i8", "i16", "f")} == {
        "i8": "int8",
        "i16": "float64",
        "f": "float32",  # i16 has nulls: pandas widens it
    }
    assert got["i32"].dtype == "int32" and got["b"].dtype == bool
    _assert_same(got, expected)
    assert got["meta"].dropna().map(json.loads).map(type).eq(dict).all()

    compact_all(system, info)  # sorted and merged, the deleted rows dropped from the files
    assert catalog.segments(info.name).query("level == 'L1' and state == 'Flushed'")["is_sorted"].all()
    _assert_same(_read(catalog, info), expected)


def test_spark_reads_each_type_as_its_own_and_json_with_from_json(
    system: System, typed: tuple[CollectionInfo, pd.DataFrame]
) -> None:
    info, expected = typed
    spark_session(system)
    df = Catalog(system).spark_collection(info.name, with_vectors=False)
    types = {f.name: f.dataType for f in df.schema.fields}
    assert types["i8"] == ByteType() and types["i16"] == ShortType() and types["i32"] == IntegerType()
    assert types["meta"] == StringType() and types["tags"] == ArrayType(StringType())
    parsed = df.select("pk", F.from_json("meta", "rank INT, even BOOLEAN").alias("m")).where("m IS NOT NULL")
    ranks = {r["pk"]: r["m"]["rank"] for r in parsed.collect()}
    want = {pk: json.loads(m)["rank"] for pk, m in zip(expected["pk"], expected["meta"], strict=True) if m}
    assert ranks == want
    _assert_same(df.toPandas().sort_values("pk").reset_index(drop=True)[COLUMNS], expected)


def test_the_change_stream_carries_every_type(
    system: System, typed: tuple[CollectionInfo, pd.DataFrame]
) -> None:
    info, _ = typed
    reader = VchanStreamReader(
        stream_options(system.settings, system.store, info.name, fields="i8,tags,meta")
    )
    start = reader.initialOffset()
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    changes = pa.Table.from_batches([b for p in reader.partitions(start, end) for b in reader.read(p)])
    inserts = changes.filter(pa.compute.equal(changes["op"], "insert"))
    assert inserts.num_rows == 300
    assert inserts.schema.field("i8").type == pa.int8()
    assert inserts.schema.field("tags").type == pa.list_(pa.string())


def test_search_filters_on_the_new_types_and_returns_them(
    system: System, typed: tuple[CollectionInfo, pd.DataFrame]
) -> None:
    info, expected = typed
    hits = Catalog(system).search(
        info.name, np.ones(4, dtype=np.float32), k=5, filter="i8 < 50", output_fields=("i8", "name", "tags")
    )
    assert len(hits) == 5 and (hits["i8"] < 50).all()
    by_pk = expected.set_index("pk")
    for _, hit in hits.iterrows():
        assert hit["name"] == by_pk.loc[hit["pk"], "name"]
        assert list(hit["tags"]) == list(by_pk.loc[hit["pk"], "tags"])


def test_an_import_converts_each_type_and_fills_defaults(
    system: System, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer, schema=TYPED, prefix="typed")
    table = typed_rows(50, 5000, seed=4)
    # As a user's file holds them: int64 for every integer, vectors as lists, JSON as text.
    vectors = np.frombuffer(table["vec"].combine_chunks().buffers()[1], dtype="<f4")[: 50 * 4]
    table = table.set_column(
        table.schema.get_field_index("vec"), "vec", pa.FixedSizeListArray.from_arrays(pa.array(vectors), 4)
    )
    for name in ("i8", "i16"):
        table = table.set_column(table.schema.get_field_index(name), name, table[name].cast(pa.int64()))
    job = run_import(system.store, system.settings, info, [write_parquet(tmp_path / "typed.parquet", table)])
    assert job.state is ImportState.COMPLETED, job.reason
    got = _read(Catalog(system), info)
    assert got["i8"].dtype == "int8" and (got["i32"] == -1).all() and not got["b"].any()
    assert got["tags"].map(list).tolist() == table["tags"].to_pylist()


@pytest.mark.parametrize(
    ("column", "values", "says"),
    [
        ("name", lambda n: ["ok"] * (n - 1) + ["far too long!"], "is 13 bytes long, over its max_length of 12 at row 9"),
        ("i8", lambda n: [1] * 3 + [200] + [1] * (n - 4), "cannot be read as int8"),
        ("tags", lambda n: [["a"]] * 4 + [["a"] * 5] + [["a"]] * (n - 5), "has 5 elements, over its max_capacity 4 at row 4"),
        ("meta", lambda n: ['{"a": 1}'] * 2 + ["{not json"] + ["{}"] * (n - 3), "is not JSON"),
        ("f", lambda n: [0.5] * 6 + [None] * (n - 6), "is null, and the field is not nullable and has no default value at row 6"),
    ],
)  # fmt: skip
def test_an_import_refuses_a_value_the_field_refuses_naming_file_column_and_row(
    system: System, producer: Producer, tmp_path: Path, column: str, values: object, says: str
) -> None:
    info = new_collection(producer, schema=TYPED, prefix="typed")
    table = typed_rows(10, 0, seed=5)
    table = table.drop_columns(["vec"]).append_column("vec", pa.array([json.dumps([0.5] * 4)] * 10))
    table = table.set_column(table.schema.get_field_index(column), column, pa.array(values(10)))  # type: ignore[operator]
    path = tmp_path / "bad.csv" if column != "tags" else tmp_path / "bad.parquet"
    if column == "tags":
        write_parquet(path, table)
    else:
        pcsv.write_csv(
            table.drop_columns(["tags", "ranks"]).append_column("tags", pa.array(['["a"]'] * 10)), path
        )
    job = run_import(system.store, system.settings, info, [str(path)], format=path.suffix[1:])
    assert job.state is ImportState.FAILED
    assert str(path) in job.reason and repr(column) in job.reason and says in job.reason
    assert Catalog(system).read_collection(info.name).empty


def test_reads_and_searches_filter_on_json_paths_and_array_functions(
    system: System, typed: tuple[CollectionInfo, pd.DataFrame]
) -> None:
    info, expected = typed
    catalog = Catalog(system)
    want = {
        pk
        for pk, meta, tags in zip(expected["pk"], expected["meta"], expected["tags"], strict=True)
        if meta and json.loads(meta)["rank"] < 50 and len(tags) >= 2
    }
    got = catalog.read_collection(info.name, filter="meta['rank'] < 50 and array_length(tags) >= 2")
    assert want and set(got["pk"]) == want
    hits = catalog.search(
        info.name, np.ones(4, dtype=np.float32), k=8, filter="meta['even'] == True", output_fields=("meta",)
    )
    assert len(hits) == 8 and all(json.loads(m)["even"] for m in hits["meta"])


DYNAMIC = CollectionSchema.build("pk", {"vec": 4}, {"n": "int64"}, dynamic=True)


def test_the_dynamic_field_keeps_the_keys_the_schema_lacks_through_sync_import_and_filters(
    system: System, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer, schema=DYNAMIC, prefix="dynamic")
    inserted = generate_rows(DYNAMIC, 60, seed=3).drop_columns(["$meta"])
    producer.insert(info.name, inserted.append_column("color", pa.array(["red", "blue", "green"] * 20)))
    producer.flush(info.name)
    sync_all(system, info)
    imported = generate_rows(DYNAMIC, 20, start_pk=1000, seed=4).drop_columns(["$meta"])
    vectors = np.frombuffer(imported["vec"].combine_chunks().buffers()[1], dtype="<f4")[: 20 * 4]
    at = imported.schema.get_field_index("vec")
    imported = imported.set_column(at, "vec", pa.FixedSizeListArray.from_arrays(pa.array(vectors), 4))
    imported = imported.append_column("size", pa.array(range(20)))
    job = run_import(system.store, system.settings, info, [write_parquet(tmp_path / "d.parquet", imported)])
    assert job.state is ImportState.COMPLETED, job.reason

    catalog = Catalog(system)
    red = catalog.read_collection(info.name, filter="color == 'red'")
    assert sorted(red["pk"]) == list(range(0, 60, 3))
    assert all(json.loads(m) == {"color": "red"} for m in red["$meta"])
    big = catalog.read_collection(info.name, filter="size >= 15")
    assert sorted(big["pk"]) == list(range(1015, 1020))
    hits = catalog.search(
        info.name, np.ones(4, dtype=np.float32), k=5, filter="color == 'blue'", output_fields=("$meta",)
    )
    assert len(hits) == 5 and all(json.loads(m)["color"] == "blue" for m in hits["$meta"])
