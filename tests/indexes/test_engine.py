"""Index engine versions: the processes that load indexes state the versions they read in
their sessions, builds write the lowest current stated, each build records its version, a
reader that cannot load an index searches that segment exactly and says so, and
`vchan index --upgrade` rebuilds the older ones.

A process of newer code is played by a builder (or reader) given other versions than this
code's (`IndexEngine`), as a rolling upgrade would run them side by side."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.tasks import TaskScheduler, list_tasks
from vchan_assets.indexes.engine import (
    ENGINE_CURRENT,
    ENGINE_FAISS,
    OURS,
    faiss_series,
    reader_session,
    stated_engines,
    target_engine,
)
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.indexes.tasks import IndexTasks, upgrade_builds
from vchan_assets.model import IndexEngine, SegmentIndex, SegmentIndexState
from vchan_assets.query.search import IndexFallbackWarning, exact_segments, search
from vchan_assets.query.search_options import SearchOptions
from vchan_assets.system import System
from vchan_assets.testing.harness import VCHAN, cli_env
from vchan_assets.testing.index_data import Data, clustered, exact_neighbours, new_data, sorted_segments
from vchan_assets.wal.producer import Producer

K = 10
QUERIES = clustered(20, seed=777)
NEWER = IndexEngine(current=ENGINE_CURRENT + 1, minimal=ENGINE_CURRENT)  # newer code, reads ours too


@pytest.fixture
def data(system: System, producer: Producer) -> Data:
    """Two sorted segments (1,500 and 1,200 rows) with an IVF_FLAT index, not built yet."""
    data = new_data(producer)
    sorted_segments(system, producer, data, [1500, 1200])
    create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 8})
    return data


def builds(system: System, data: Data) -> list[SegmentIndex]:
    return [d.model for d in list_builds(system.store, data.info.id)]


def recall(frame: object, truth: list[set[int]]) -> float:
    found = [set(frame.loc[frame["query"] == q, "pk"]) for q in range(len(truth))]  # type: ignore[attr-defined]
    return float(np.mean([len(f & t) / len(t) for f, t in zip(found, truth, strict=True)]))


def test_the_installed_faiss_is_the_one_of_the_current_engine_version() -> None:
    assert faiss_series() == ENGINE_FAISS[ENGINE_CURRENT], "a new faiss major.minor is a new engine version"


def test_a_build_records_the_engine_version_it_was_written_for(system: System, data: Data) -> None:
    IndexBuilder(system, "local").run()

    assert [(b.state, b.engine) for b in builds(system, data)] == [
        (SegmentIndexState.FINISHED, ENGINE_CURRENT)
    ] * 2


def test_a_catalog_states_the_versions_it_reads_while_it_searches(
    system: System, settings: Settings, data: Data
) -> None:
    assert OURS not in stated_engines(system.store)
    catalog = Catalog.open(settings)

    catalog.search(data.info.name, QUERIES, k=K)
    assert OURS in stated_engines(system.store)
    catalog.close()

    assert OURS not in stated_engines(system.store)


def test_builds_write_the_lowest_current_version_a_live_reader_states(system: System, data: Data) -> None:
    assert target_engine(system.store, NEWER) == NEWER.current  # no reader: the builder's own
    with reader_session(system.store, system.settings.session_ttl, OURS):
        IndexBuilder(system, "local", versions=NEWER).run()

    assert [b.engine for b in builds(system, data)] == [OURS.current] * 2, "the old reader can load them"
    assert target_engine(system.store, NEWER) == NEWER.current


def test_a_reader_searches_exactly_the_indexes_of_a_version_it_cannot_load(
    system: System, data: Data
) -> None:
    IndexBuilder(system, "local", versions=NEWER).run()  # no reader states a version: the builder's
    assert {b.engine for b in builds(system, data)} == {NEWER.current}

    with pytest.warns(
        IndexFallbackWarning, match=f"engine version {NEWER.current}, this process reads 1 to 1"
    ):
        frame = Catalog(system).search(data.info.name, QUERIES, k=K)

    assert recall(frame, exact_neighbours(data, QUERIES, K)) == 1.0  # searched exactly
    listed = frame.attrs["exact_segments"]
    assert sorted(f["segment"] for f in listed) == sorted(b.segment_id for b in builds(system, data))
    assert all(b.state is SegmentIndexState.FINISHED for b in builds(system, data)), "nothing to rebuild"
    assert not list_tasks(system.store, "index")


def test_a_reader_searches_exactly_the_indexes_older_than_its_minimal(system: System, data: Data) -> None:
    IndexBuilder(system, "local").run()
    newest_only = IndexEngine(current=ENGINE_CURRENT + 2, minimal=ENGINE_CURRENT + 1)

    with pytest.warns(IndexFallbackWarning, match=f"this process reads {ENGINE_CURRENT + 1} to"):
        table = search(system, data.info, QUERIES, SearchOptions(k=K), engine=newest_only)

    assert len(exact_segments(table)) == 2
    with_ours = search(system, data.info, QUERIES, SearchOptions(k=K))
    assert exact_segments(with_ours) == []


def test_upgrade_rebuilds_older_builds_once_no_reader_needs_them(system: System, data: Data) -> None:
    old_reader = reader_session(system.store, system.settings.session_ttl, OURS)
    IndexBuilder(system, "local", versions=NEWER).run()
    first = {b.build_id: b for b in builds(system, data)}
    assert upgrade_builds(system.store, data.info.id, NEWER) == (OURS.current, []), "an old reader is live"

    old_reader.close()
    target, again = upgrade_builds(system.store, data.info.id, NEWER)

    assert target == NEWER.current and sorted(b.build_id for b in again) == sorted(first)
    assert sorted(d.model.segment_id for d in list_tasks(system.store, "index")) == sorted(
        b.segment_id for b in first.values()
    )
    TaskScheduler([IndexTasks(NEWER)], system.settings).round(system, "local")
    for b in builds(system, data):
        assert (b.state, b.engine, b.version) == (SegmentIndexState.FINISHED, NEWER.current, 2)
        assert b.files != first[b.build_id].files, "a new version: the old files are superseded (GC's)"
    assert not list_tasks(system.store, "index")
    assert upgrade_builds(system.store, data.info.id, NEWER)[1] == [], "nothing older left"


def test_cli_index_upgrade_queues_nothing_when_every_build_is_current(
    system: System, settings: Settings, data: Data
) -> None:
    IndexBuilder(system, "local").run()

    done = subprocess.run(
        [str(VCHAN), "index", "--upgrade", "--collection", data.info.name],
        env=cli_env(settings), capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert f"queued 0 index rebuilds of {data.info.name} to engine version {ENGINE_CURRENT}" in done.stdout
