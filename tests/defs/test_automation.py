"""When declarative automation requests the catalog table (`segment_table`, defs/automation.py):
the condition evaluated by Dagster's own evaluator on a real (temporary) instance that holds
the events a sync loop reports (`reported_events`: the materializations and checks of a sync)."""

from collections.abc import Iterator
from datetime import datetime, timedelta

import dagster as dg
import pytest

from vchan_assets.defs.checks import reported_events
from vchan_assets.defs.definitions import defs
from vchan_assets.defs.partitions import VCHANNELS
from vchan_assets.defs.sync.assets import CHANNEL_CHECKPOINTS

TABLE = dg.AssetKey("segment_table")
VCHANNEL_NAMES = ("c1_v0", "c1_v1")
START = datetime(2026, 11, 26, 10, 0, 30)  # 30 s past a 2-minute tick


class Automation:
    """The catalog condition evaluated tick by tick, as the automation sensor does (its
    cursor carried from one evaluation to the next)."""

    def __init__(self, instance: dg.DagsterInstance) -> None:
        self.instance = instance
        self.cursor = None
        self.now = START

    def tick(self, after: timedelta = timedelta(seconds=10)) -> bool:
        """One evaluation `after` the previous one: whether `segment_table` is requested."""
        self.now += after
        result = dg.evaluate_automation_conditions(
            defs=defs,
            instance=self.instance,
            asset_selection=dg.AssetSelection.assets(TABLE),
            evaluation_time=self.now,
            cursor=self.cursor,
        )
        self.cursor = result.cursor
        return result.get_num_requested(TABLE) > 0

    def sync(self, vchannel: str, passed: bool = True) -> None:
        """The events of one sync of `vchannel` (its checkpoint materialized, its blocking
        `checkpoint_monotonic` check evaluated), yielded by the op of a run as the sync loop
        yields them."""
        config = {"ops": {"report_sync": {"config": {"vchannel": vchannel, "passed": passed}}}}
        assert report_sync_job.execute_in_process(instance=self.instance, run_config=config).success

    def materialized(self) -> None:
        self.instance.report_runless_asset_event(dg.AssetMaterialization(TABLE))

    def failed_run(self) -> None:
        """A run of `segment_table` that failed (its catalog could not be written)."""
        assert not dg.materialize([broken_table], instance=self.instance, raise_on_error=False).success


@dg.op(config_schema={"vchannel": str, "passed": bool}, out={})
def report_sync(
    context: dg.OpExecutionContext,
) -> Iterator[dg.AssetMaterialization | dg.AssetCheckEvaluation]:
    results: list[dg.MaterializeResult | dg.AssetCheckResult] = [
        dg.MaterializeResult(asset_key=CHANNEL_CHECKPOINTS.key, metadata={"offset": 1}),
        dg.AssetCheckResult(
            asset_key=CHANNEL_CHECKPOINTS.key,
            check_name="checkpoint_monotonic",
            passed=context.op_config["passed"],
        ),
    ]
    yield from reported_events(results, context.op_config["vchannel"])


report_sync_job = dg.GraphDefinition(name="report_sync", node_defs=[report_sync]).to_job()


@dg.asset(key=TABLE)
def broken_table() -> None:
    raise OSError("the catalog's storage is unreachable")


@pytest.fixture
def automation() -> Iterator[Automation]:
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(VCHANNELS, list(VCHANNEL_NAMES))
        yield Automation(instance)


def test_a_missing_catalog_table_is_requested_at_the_first_evaluation(automation: Automation) -> None:
    """On a new stack the table is missing from the first evaluation on: it is requested at
    once (the old condition waited only for a *newly* missing table, never the case on a new
    stack, then for a cron tick after a sync: minutes, or for ever on an idle stack)."""
    assert automation.tick()


def test_a_missing_catalog_table_waits_while_a_blocking_check_failed(automation: Automation) -> None:
    automation.sync(VCHANNEL_NAMES[0], passed=False)
    assert not automation.tick()

    automation.sync(VCHANNEL_NAMES[0])
    assert automation.tick()


def test_a_failed_run_of_a_missing_table_is_not_retried_at_every_tick(automation: Automation) -> None:
    assert automation.tick()
    automation.failed_run()

    assert not any(automation.tick() for _ in range(3))
    automation.sync(VCHANNEL_NAMES[0])
    assert automation.tick(timedelta(minutes=2)), "the next tick after a sync tries again"


def test_the_table_is_not_requested_again_while_nothing_changed(automation: Automation) -> None:
    assert automation.tick()
    automation.materialized()

    assert not any(automation.tick() for _ in range(5))


def test_after_syncs_it_is_refreshed_at_the_next_two_minute_tick(automation: Automation) -> None:
    automation.tick()
    automation.materialized()
    automation.tick()

    automation.sync(VCHANNEL_NAMES[1])

    assert not automation.tick(), "before the tick"
    assert automation.tick(timedelta(minutes=2)), "at the first tick after the sync"


def test_a_failed_exactly_once_check_of_any_vchannel_blocks_the_table(automation: Automation) -> None:
    """A sync whose blocking check failed, on one vchannel of two, stops the catalog from
    publishing; the table is requested again once that vchannel's next sync passes."""
    automation.tick()
    automation.materialized()
    automation.sync(VCHANNEL_NAMES[0])
    automation.sync(VCHANNEL_NAMES[1], passed=False)

    assert not automation.tick()
    assert not automation.tick(timedelta(minutes=2))

    automation.sync(VCHANNEL_NAMES[1])
    assert automation.tick(timedelta(minutes=2))
