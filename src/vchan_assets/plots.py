"""Plotly figures over the catalog's tables, so notebook cells stay one line long.

Each function takes the DataFrame a `Catalog` method returns (or a history of them) and
returns a `plotly.graph_objects.Figure`; nothing here reads etcd or storage itself.

    plots.lag(catalog.vchannels())                    # messages waiting, per vchannel
    plots.lag_over_time(history)                      # history: vchannels() snapshots + "t"
    plots.segment_sizes(catalog.segments())           # size distribution by state/level
    plots.storage_by_state(catalog.segments())        # bytes per segment state
    plots.compaction_gains(catalog.compactions())     # rows and bytes in vs out per plan
    plots.sync_throughput(runs)                       # rows/s of sync runs over time
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

MB = 1e6


def _require(df: pd.DataFrame, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"plots.{what} needs columns {missing}; got {list(df.columns)}")


def _empty(title: str, why: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title)
    fig.add_annotation(text=why, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    return fig


def lag(vchannels: pd.DataFrame) -> go.Figure:
    """Log messages not yet persisted per vchannel (an unknown lag is drawn as missing)."""
    _require(vchannels, ["vchannel", "lag_rows"], "lag")
    title = "Checkpoint lag per vchannel"
    if vchannels.empty:
        return _empty(title, "no vchannels")
    color = "owner_node" if "owner_node" in vchannels.columns else None
    frame = vchannels.assign(owner_node=vchannels["owner_node"].astype(str)) if color else vchannels
    return px.bar(frame, x="vchannel", y="lag_rows", color=color, title=title,
                  labels={"lag_rows": "messages not yet persisted"})  # fmt: skip


def lag_over_time(history: pd.DataFrame, t: str = "t") -> go.Figure:
    """Lag per vchannel over time from stacked `vchannels()` snapshots with a time column."""
    _require(history, ["vchannel", "lag_rows", t], "lag_over_time")
    return px.line(history, x=t, y="lag_rows", color="vchannel", markers=True,
                   labels={t: "time", "lag_rows": "messages not yet persisted"},
                   title="Checkpoint lag per vchannel over time")  # fmt: skip


def segment_sizes(segments: pd.DataFrame) -> go.Figure:
    """Distribution of segment sizes (MB of insert binlogs), by state and level."""
    _require(segments, ["size_bytes", "state", "level"], "segment_sizes")
    title = "Segment sizes"
    rows = segments[segments["level"] != "L0"]
    if rows.empty:
        return _empty(title, "no segments with rows")
    frame = rows.assign(size_mb=rows["size_bytes"] / MB)
    return px.histogram(frame, x="size_mb", color="state", facet_col="level", nbins=30, title=title,
                        labels={"size_mb": "MB of insert binlogs"})  # fmt: skip


def storage_by_state(segments: pd.DataFrame) -> go.Figure:
    """Bytes held per segment state: insert, delta and stats logs stacked."""
    _require(segments, ["state", "size_bytes", "delta_bytes", "stats_bytes"], "storage_by_state")
    title = "Storage by segment state"
    if segments.empty:
        return _empty(title, "no segments")
    totals = segments.groupby("state")[["size_bytes", "delta_bytes", "stats_bytes"]].sum().reset_index()
    long = totals.melt(id_vars="state", var_name="kind", value_name="bytes")
    long["MB"] = long["bytes"] / MB
    long["kind"] = long["kind"].map({"size_bytes": "insert", "delta_bytes": "delta", "stats_bytes": "stats"})
    return px.bar(long, x="state", y="MB", color="kind", title=title)


def compaction_gains(compactions: pd.DataFrame) -> go.Figure:
    """Rows and MB in vs out of each completed compaction plan."""
    _require(compactions, ["plan_id", "type", "state", "rows_in", "rows_out", "bytes_in", "bytes_out"],
             "compaction_gains")  # fmt: skip
    title = "Compaction: in vs out per plan"
    done = compactions[compactions["state"] == "Completed"]
    if done.empty:
        return _empty(title, "no completed compactions")
    long = pd.concat(
        [
            done.assign(side="in", rows=done["rows_in"], MB=done["bytes_in"] / MB),
            done.assign(side="out", rows=done["rows_out"], MB=done["bytes_out"] / MB),
        ]
    )
    long["plan"] = long["plan_id"].astype(str) + " " + long["type"]
    return px.bar(long, x="plan", y="MB", color="side", barmode="group", hover_data=["rows"], title=title)


def sync_throughput(runs: pd.DataFrame) -> go.Figure:
    """Rows per second of sync runs over time (columns: end_time, vchannel, rows, seconds)."""
    _require(runs, ["end_time", "vchannel", "rows", "seconds"], "sync_throughput")
    title = "Sync throughput"
    done = runs[runs["seconds"] > 0]
    if done.empty:
        return _empty(title, "no sync runs with rows")
    frame = done.assign(rows_per_s=done["rows"] / done["seconds"])
    return px.scatter(frame, x="end_time", y="rows_per_s", color="vchannel", size="rows", title=title,
                      labels={"rows_per_s": "rows/s", "end_time": "run finished"})  # fmt: skip
