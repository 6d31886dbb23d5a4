"""What Spark's own records say about where tasks ran: the application's event log
(`spark.eventLog.*`, written by the driver) and the process tree of each worker."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from vchan_assets.deploy.processes import command_line, descendants

EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


def event_log_conf(conf_dir: Path, event_dir: Path) -> dict[str, str]:
    """A SPARK_CONF_DIR whose spark-defaults.conf turns the event log on (plain JSON lines);
    every spark-submit started with it (a PySpark driver, a Spark Connect server) reads it."""
    conf_dir.mkdir(parents=True, exist_ok=True)
    event_dir.mkdir(parents=True, exist_ok=True)
    defaults = {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": f"file://{event_dir}",
        "spark.eventLog.compress": "false",
        "spark.eventLog.rolling.enabled": "false",
        "spark.executor.memory": "512m",
    }
    (conf_dir / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in defaults.items()))
    return {"SPARK_CONF_DIR": str(conf_dir)}


@dataclass
class AppEvents:
    """One application's event log, reduced to jobs, tasks and executors."""

    app_name: str = ""
    job_descriptions: dict[int, str] = field(default_factory=dict)
    job_stages: dict[int, list[int]] = field(default_factory=dict)
    task_executor: list[tuple[int, str]] = field(default_factory=list)  # (stage, executor id)
    executor_ui_port: dict[str, int] = field(default_factory=dict)  # executor -> its worker's UI port

    def executors_of_jobs(self, description_prefix: str) -> set[str]:
        stages = {
            s
            for job, desc in self.job_descriptions.items()
            if desc.startswith(description_prefix)
            for s in self.job_stages.get(job, [])
        }
        return {executor for stage, executor in self.task_executor if stage in stages}

    def worker_ports(self, executors: set[str]) -> set[int]:
        return {self.executor_ui_port[e] for e in executors}


def read_event_logs(event_dir: Path) -> list[AppEvents]:
    apps = []
    for path in sorted(p for p in event_dir.rglob("*") if p.is_file() and not p.name.endswith(".inprogress")):
        apps.append(_parse(path))
    return apps


def _parse(path: Path) -> AppEvents:
    app = AppEvents()
    for line in path.read_text().splitlines():
        event = json.loads(line)
        kind = event["Event"]
        if kind == "SparkListenerApplicationStart":
            app.app_name = event["App Name"]
        elif kind == "SparkListenerJobStart":
            props = event.get("Properties") or {}
            app.job_descriptions[event["Job ID"]] = props.get("spark.job.description") or ""
            app.job_stages[event["Job ID"]] = list(event["Stage IDs"])
        elif kind == "SparkListenerTaskEnd":
            app.task_executor.append((event["Stage ID"], event["Task Info"]["Executor ID"]))
        elif kind == "SparkListenerExecutorAdded":
            urls = event["Executor Info"].get("Log Urls") or {}
            match = re.search(r"://[^:/]+:(\d+)/", next(iter(urls.values()), ""))
            if match:
                app.executor_ui_port[event["Executor ID"]] = int(match.group(1))
    return app


def python_workers_under(pid: int) -> list[int]:
    """Python processes (PySpark's daemon and its forked workers) below an executor JVM
    below the Spark worker `pid`."""
    found = []
    for executor in descendants(pid):
        if EXECUTOR_CLASS not in command_line(executor):
            continue
        found += [p for p in descendants(executor) if "pyspark" in command_line(p)]
    return found
