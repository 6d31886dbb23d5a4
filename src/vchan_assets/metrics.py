"""Metrics in the Prometheus text exposition format (version 0.0.4).

Computed on each scrape from etcd and the log (no state of its own), so any process
can serve them: `vchan metrics` prints them once, `vchan metrics --serve PORT` answers
`GET /metrics` on 127.0.0.1:PORT. What is exported:

  vchan_datanode_sessions                    live DataNode sessions
  vchan_node_state{role,node,state}          1 per session (DataNode, active DataCoord) by state
  vchan_channels{node}                       vchannels watched per node ("remaining": none)
  vchan_channel_watch{vchannel,node,state}   1 per watch info
  vchan_channel_checkpoint_offset{vchannel}  offset of the channel checkpoint
  vchan_channel_lag_messages{vchannel}       log messages after the checkpoint
  vchan_channel_lag_seconds{vchannel}        head time tick minus checkpoint timestamp
  vchan_channel_checkpoint_age_seconds{vchannel}  now minus the checkpoint timestamp
  vchan_channel_syncs_total{vchannel}        committed syncs (the checkpoint key's etcd version)
  vchan_segments{collection,state,level}     segments by state and level
  vchan_segment_rows{collection,state,level} rows in them
  vchan_segment_bytes{collection,state,level} insert binlog bytes in them
  vchan_binlog_files{kind}                   insert, delta and stats log files in meta
  vchan_orphan_binlogs                       files no segment meta points to
  vchan_warnings{kind}                       warnings of `vchan status`

Sync durations are not recorded in etcd; the Dagster run metadata of the sync assets
holds them when syncs run under Dagster.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vchan_assets.catalog import Catalog
from vchan_assets.meta.errors import MalformedValueError
from vchan_assets.model import NodeSession
from vchan_assets.status import collect_status

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Metric:
    name: str
    help: str
    kind: str = "gauge"  # gauge | counter
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float | int | None, **labels: Any) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        self.samples.append(({k: str(v) for k, v in labels.items()}, float(value)))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def render(metrics: Iterable[Metric]) -> str:
    """The Prometheus text format: HELP and TYPE lines, then one line per sample."""
    lines = []
    for m in metrics:
        lines.append(f"# HELP {m.name} {m.help}")
        lines.append(f"# TYPE {m.name} {m.kind}")
        for labels, value in m.samples:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            lines.append(
                f"{m.name}{{{label_text}}} {_number(value)}" if labels else f"{m.name} {_number(value)}"
            )
    return "\n".join(lines) + "\n"


def collect(catalog: Catalog) -> list[Metric]:
    report = collect_status(catalog, orphans=True)
    return [
        *_node_metrics(catalog, report),
        *_channel_metrics(report),
        *_segment_metrics(catalog, report),
        _warning_metric(report),
    ]


def _node_metrics(catalog: Catalog, report: dict[str, Any]) -> list[Metric]:
    sessions = Metric("vchan_datanode_sessions", "Live DataNode sessions in etcd.")
    sessions.add(len(report["nodes"]))

    per_node = Metric("vchan_channels", "vchannels watched per node (node=remaining: waiting for one).")
    counts: dict[str, int] = {str(n["node_id"]): 0 for n in report["nodes"]}
    for c in report["channels"]:
        owner = c["owner_node"] or "none"
        counts[owner] = counts.get(owner, 0) + 1
    for node, n in sorted(counts.items()):
        per_node.add(n, node=node)

    watch = Metric("vchan_channel_watch", "1 per watch info, by node and watch state.")
    watches = catalog.watches()
    for entry in watches.entries:
        watch.add(1, vchannel=entry.vchannel, node=str(entry.node_id), state=entry.info.state.value)
    for bad in watches.malformed:
        watch.add(1, vchannel=bad.vchannel, node=bad.node, state="Malformed")
    states = Metric("vchan_node_state", "1 per session (DataNodes, the active DataCoord), by state.")
    for n in report["nodes"]:
        states.add(1, role="datanode", node=str(n["node_id"]), state=str(n["state"]))
    try:
        coord = catalog.store.get_model(catalog.store.keys.datacoord_session(), NodeSession)
    except MalformedValueError as exc:
        log.error("metrics: %s", exc)
        coord = None
    if coord is not None:
        states.add(1, role="datacoord", node=str(coord.model.node_id), state=coord.model.state.value)
    return [sessions, states, per_node, watch]


def _channel_metrics(report: dict[str, Any]) -> list[Metric]:
    offset = Metric(
        "vchan_channel_checkpoint_offset", "Offset of the channel checkpoint in the vchannel log."
    )
    lag = Metric(
        "vchan_channel_lag_messages", "Log messages after the channel checkpoint (not yet in binlogs)."
    )
    lag_s = Metric("vchan_channel_lag_seconds", "Head time tick minus the checkpoint timestamp, in seconds.")
    age = Metric("vchan_channel_checkpoint_age_seconds", "Now minus the checkpoint timestamp, in seconds.")
    syncs = Metric(
        "vchan_channel_syncs_total", "Syncs committed on the channel (checkpoint commits).", "counter"
    )
    for c in report["channels"]:
        labels = {"vchannel": c["vchannel"], "collection": c["collection"]}
        offset.add(c["checkpoint_offset"], **labels)
        lag.add(c["lag_rows"], **labels)
        lag_s.add(c["lag_seconds"], **labels)
        age.add(c["checkpoint_age_seconds"], **labels)
        syncs.add(c["syncs"], **labels)
    return [offset, lag, lag_s, age, syncs]


def _segment_metrics(catalog: Catalog, report: dict[str, Any]) -> list[Metric]:
    segments = Metric("vchan_segments", "Segments by collection, state and level.")
    rows = Metric("vchan_segment_rows", "Rows (L0: deletes) in segments by collection, state and level.")
    size = Metric("vchan_segment_bytes", "Insert binlog bytes in segments by collection, state and level.")
    files = Metric("vchan_binlog_files", "Binlog files referenced by segment meta, by kind.")
    seg_df = catalog.segments()
    if not seg_df.empty:
        grouped = seg_df.groupby(["collection", "state", "level"], dropna=False)
        for (coll, state, level), g in grouped:
            labels = {"collection": coll, "state": state, "level": level}
            segments.add(len(g), **labels)
            rows.add(int(g["num_rows"].sum()), **labels)
            size.add(int(g["size_bytes"].sum()), **labels)
        files.add(int(seg_df["binlog_count"].sum()), kind="insert")
        files.add(int(seg_df["deltalog_count"].sum()), kind="delta")
        files.add(int(seg_df["statslog_count"].sum()), kind="stats")

    orphans = Metric("vchan_orphan_binlogs", "Binlog files no segment meta points to (GC candidates).")
    orphans.add(report["orphan_binlogs"])
    return [segments, rows, size, files, orphans]


def _warning_metric(report: dict[str, Any]) -> Metric:
    warnings = Metric("vchan_warnings", "Warnings of `vchan status`, by kind.")
    kinds: dict[str, int] = {}
    for w in report["warnings"]:
        kinds[w["kind"]] = kinds.get(w["kind"], 0) + 1
    for kind, n in sorted(kinds.items()):
        warnings.add(n, kind=kind)
    return warnings


def exposition(catalog: Catalog) -> str:
    return render(collect(catalog))


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a text exposition by metric name (for tests and scripts; simple labels only)."""
    import re

    sample = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = sample.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, labels, value = match.groups()
        out.setdefault(name, []).append((dict(label.findall(labels or "")), float(value)))
    return out


class MetricsServer:
    """`GET /metrics` on 127.0.0.1:port, computed per request from `catalog`."""

    def __init__(self, catalog: Catalog, port: int, host: str = "127.0.0.1") -> None:
        lock = threading.Lock()  # one scrape at a time: the catalog caches log footers

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served")
                    return
                try:
                    with lock:
                        body = exposition(catalog).encode()
                except Exception as exc:  # a scrape must answer: say what failed
                    log.exception("metrics collection failed")
                    self.send_error(503, f"metrics collection failed: {exc}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.info("metrics %s", format % args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
