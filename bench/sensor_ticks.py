"""What a sensor tick costs the code server, and what its resource costs of it.

    .venv/bin/python -m bench.sensor_ticks [--ticks 30] [--repeat 3]

Dagster builds a sensor's resources at every evaluation. The sensors used `vchan`
(`VchanResource`: one field per setting, ~75), whose build goes over its fields once per
field in pydantic and Dagster's config schema; they now use `vchan_env` (`VchanEnvResource`:
one field, the settings read from the environment). On one scratch etcd, with two
Dagster-hosted DataNodes registered and a collection of two vchannels assigned, this times
(CPU seconds of this process, Dagster's own `build_sensor_context`, as the code server
evaluates a tick):

- a sensor that only opens the system, once with `vchan` and once with `vchan_env`: the part
  of every tick that the resource decides (the ratio is the figure);
- a tick of each sensor that ticks every second (a DataNode, the DataCoord, the sync
  sensor), as shipped.

The designs alternate within each of `--repeat` rounds; medians over the rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import dagster as dg

from bench import bench_parser, bench_system, write_report
from vchan_assets.defs.cluster.datacoord import datacoord_sensor
from vchan_assets.defs.cluster.datanodes import datanode_sensor
from vchan_assets.defs.resources import VchanEnvResource, VchanResource
from vchan_assets.defs.sync.sensor import sync_sensor
from vchan_assets.model import CollectionSchema
from vchan_assets.wal.producer import Producer

SCHEMA = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64"})


@dg.sensor(name="opens_with_vchan")
def opens_with_vchan(context: dg.SensorEvaluationContext, vchan: VchanResource) -> dg.SkipReason:
    with vchan.open():
        return dg.SkipReason("opened")


@dg.sensor(name="opens_with_vchan_env")
def opens_with_vchan_env(context: dg.SensorEvaluationContext, vchan_env: VchanEnvResource) -> dg.SkipReason:
    with vchan_env.open():
        return dg.SkipReason("opened")


def cpu_per_call(call: Callable[[], object], n: int) -> float:
    started = time.process_time()
    for _ in range(n):
        call()
    return (time.process_time() - started) / n


def main() -> None:
    parser = bench_parser(__doc__, 0, "bench/results/sensor_ticks.json")
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with bench_system("vchan-bench-ticks-") as (_, system), dg.DagsterInstance.ephemeral() as instance:
        settings = system.settings
        Producer(system).create_collection("ticks", SCHEMA, num_channels=2)
        # Each evaluation builds only the resource its sensor takes, as the code server does.
        runs = {"vchan": VchanResource.from_settings(settings)}
        sensors = {"vchan_env": VchanEnvResource.from_settings(settings)}
        nodes = [datanode_sensor("1", min_session_ttl=0), datanode_sensor("2", min_session_ttl=0)]
        cursors: dict[str, str | None] = {node.name: None for node in nodes}
        coordinator: dict[str, str | None] = {"cursor": None}

        def tick(sensor: dg.SensorDefinition, cursor: str | None = None) -> object:
            resources = runs if sensor is opens_with_vchan else sensors
            context = dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources)
            return sensor(context)

        def node_tick(node: dg.SensorDefinition) -> None:
            result = tick(node, cursors[node.name])
            assert isinstance(result, dg.SensorResult)
            cursors[node.name] = result.cursor

        def coordinator_tick() -> None:
            result = tick(datacoord_sensor, coordinator["cursor"])
            assert isinstance(result, dg.SensorResult)
            coordinator["cursor"] = result.cursor

        for _ in range(5):  # register both nodes, elect the coordinator, assign the channels
            for node in nodes:
                node_tick(node)
            coordinator_tick()
            time.sleep(0.2)

        designs: dict[str, Callable[[], object]] = {
            "opens the system, vchan (75 fields)": lambda: tick(opens_with_vchan),
            "opens the system, vchan_env (1 field)": lambda: tick(opens_with_vchan_env),
            "datanode sensor tick": lambda: node_tick(nodes[0]),
            "datacoord sensor tick": coordinator_tick,
            "sync sensor tick": lambda: tick(sync_sensor),
        }
        rounds: dict[str, list[float]] = {name: [] for name in designs}
        for _ in range(args.repeat):
            for name, call in designs.items():
                rounds[name].append(cpu_per_call(call, args.ticks))
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    ratio = medians["opens the system, vchan (75 fields)"] / medians["opens the system, vchan_env (1 field)"]
    for name, value in medians.items():
        print(f"{name:40s} {1000 * value:7.1f} ms CPU (rounds {[round(1000 * v, 1) for v in rounds[name]]})")
    print(f"a tick's resource and open with vchan over vchan_env: {ratio:.1f}x")
    write_report(
        args.out,
        {
            "ticks": args.ticks,
            "repeat": args.repeat,
            "cpu_ms_median": {k: round(1000 * v, 2) for k, v in medians.items()},
            "cpu_ms_rounds": {k: [round(1000 * v, 2) for v in vs] for k, vs in rounds.items()},
            "vchan_over_vchan_env": round(ratio, 2),
        },
    )


if __name__ == "__main__":
    main()
