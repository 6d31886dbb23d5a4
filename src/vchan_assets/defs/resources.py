"""Resources: the system (etcd + storage + settings) and Spark, from the environment.

`VchanResource` has one field per row of the settings table (`config.VARIABLES`), each
declared with its variable's meaning and default as its description; `from_env()` fills
them with `EnvVar`s for every VCHAN_* variable that is set (the rest keep the defaults of
the settings table), so the UI shows where each value comes from and nothing is
hard-coded. Its behaviour lives in `VchanRuntime` (runtime.py), a plain class.

Spark goes through dagster-pyspark's `PySparkResource`. With VCHAN_SPARK_REMOTE set
(`vchan up` starts a local Spark Connect server and sets it) its session is a Spark
Connect client: a run pays ~1 s instead of ~9 s for a fresh JVM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
from dagster_pyspark import PySparkResource
from pydantic import Field

from vchan_assets.config import VARIABLES, Settings
from vchan_assets.defs.runtime import VchanRuntime, open_runtime
from vchan_assets.spark.session import spark_conf


class OpensSystem:
    """What both resources of the system do with their settings: open it for a run or a
    sensor tick (`VchanRuntime`, closed when the block ends)."""

    def settings(self) -> Settings:
        raise NotImplementedError

    @contextmanager
    def open(self) -> Iterator[VchanRuntime]:
        with open_runtime(self.settings()) as runtime:
            yield runtime


class VchanResource(OpensSystem, dg.ConfigurableResource):
    """The vchan system: etcd, object storage, Spark and every other setting.

    One field per row of the settings table (`settings.toml`, `config.VARIABLES`), named like
    its `Settings` field, in the table's order (tests/defs/test_resources.py checks they
    agree). Each field holds its variable's text as the environment would (None: the table's
    default); `Settings.from_env`, the one parser, validates them. Fields are text because
    Dagster's `EnvVar` supplies text only.
    """

    home: str | None = Field(
        default=None,
        description="VCHAN_HOME: directory of the embedded stack (etcd data, local storage) [default: `.vchan`]",
    )
    root: str | None = Field(
        default=None, description="VCHAN_ROOT: root prefix of every etcd key [default: `vchan`]"
    )
    etcd_endpoints: str | None = Field(
        default=None,
        description="VCHAN_ETCD_ENDPOINTS: `host:port,host2:port` of an etcd v3 cluster [default: unset: embedded etcd]",
    )
    etcd_user: str | None = Field(
        default=None,
        description="VCHAN_ETCD_USER: etcd user (set together with `VCHAN_ETCD_PASSWORD`) [default: unset]",
    )
    etcd_password: str | None = Field(
        default=None, description="VCHAN_ETCD_PASSWORD: etcd password [default: unset]"
    )
    etcd_ca_cert: str | None = Field(
        default=None,
        description="VCHAN_ETCD_CA_CERT: CA certificate file: enables TLS to etcd [default: unset]",
    )
    etcd_cert: str | None = Field(
        default=None,
        description="VCHAN_ETCD_CERT: client certificate file for etcd TLS (with `VCHAN_ETCD_KEY`) [default: unset]",
    )
    etcd_key: str | None = Field(
        default=None, description="VCHAN_ETCD_KEY: client key file for etcd TLS [default: unset]"
    )
    etcd_timeout: str | None = Field(
        default=None,
        description="VCHAN_ETCD_TIMEOUT: seconds before an etcd call fails with `MetaUnavailableError` [default: `5`]",
    )
    etcd_connect_timeout: str | None = Field(
        default=None,
        description="VCHAN_ETCD_CONNECT_TIMEOUT: seconds a process (`vchan datanode`, `vchan datacoord`, `vchan produce`, any command) retries, with backoff, an etcd it cannot reach when it starts, before it fails with the error (0: no retry); an etcd that refuses the user or the certificate fails at once [default: `15`]",
    )
    storage_uri: str | None = Field(
        default=None,
        description="VCHAN_STORAGE_URI: object storage root: a local path or `s3://bucket/prefix` [default: `$VCHAN_HOME/storage`]",
    )
    s3_endpoint: str | None = Field(
        default=None,
        description="VCHAN_S3_ENDPOINT: endpoint of an S3-compatible server (`http://host:port`); credentials from the usual `AWS_*` variables [default: unset]",
    )
    s3_region: str | None = Field(
        default=None, description="VCHAN_S3_REGION: S3 region [default: `us-east-1`]"
    )
    spark_master: str | None = Field(
        default=None,
        description="VCHAN_SPARK_MASTER: Spark master URL (standalone, YARN, k8s) [default: `local[*]`]",
    )
    spark_remote: str | None = Field(
        default=None,
        description="VCHAN_SPARK_REMOTE: Spark Connect URL `sc://host:port` (wins over the master) [default: unset]",
    )
    session_ttl: str | None = Field(
        default=None,
        description="VCHAN_SESSION_TTL: seconds a node session lives without keep-alive (production: 30) [default: `10`]",
    )
    stop_timeout: str | None = Field(
        default=None,
        description="VCHAN_STOP_TIMEOUT: seconds a node may stay STOPPING (graceful stop); then the DataCoord revokes its session [default: `30`]",
    )
    health_interval: str | None = Field(
        default=None,
        description="VCHAN_HEALTH_INTERVAL: seconds between a DataNode's health probes of its engine (with `--engine spark`: its Spark session's JVM answers); a failed probe makes it ABNORMAL (its channels move) until its Spark session is started again [default: `5`]",
    )
    balance_version: str | None = Field(
        default=None,
        description="VCHAN_BALANCE_VERSION: auto balance of channels waits while a DataNode older than this package version is alive [default: unset: the DataCoord's own version]",
    )
    append_lock_ttl: str | None = Field(
        default=None,
        description="VCHAN_APPEND_LOCK_TTL: seconds a channel's append lock outlives a killed producer (etcd lease TTL) [default: `10`]",
    )
    client_retry_timeout: str | None = Field(
        default=None,
        description="VCHAN_CLIENT_RETRY_TIMEOUT: seconds a producer call retries while etcd or storage is unavailable [default: `30`]",
    )
    write_lag_limit_mb: str | None = Field(
        default=None,
        description="VCHAN_WRITE_LAG_LIMIT_MB: log MiB a vchannel may hold after its checkpoint (not synced yet): from half of it inserts and deletes slow down (a sleep of up to 1 s per call, in proportion), past it they are refused with `WriteLagExceededError` naming the channel and its lag, until its DataNode catches up; flushes go on (0: no limit; docs/protection.md) [default: `2048`]",
    )
    write_lag_limit_seconds: str | None = Field(
        default=None,
        description="VCHAN_WRITE_LAG_LIMIT_SECONDS: age in seconds the oldest unsynced message of a vchannel may reach: the same slowing and refusal as `VCHAN_WRITE_LAG_LIMIT_MB` (0: no limit; set it above `VCHAN_SYNC_MAX_AGE`) [default: `0`]",
    )
    watch_timeout: str | None = Field(
        default=None,
        description="VCHAN_WATCH_TIMEOUT: seconds before a stuck ToWatch/ToRelease is reassigned [default: `300`]",
    )
    auto_balance: str | None = Field(
        default=None,
        description="VCHAN_AUTO_BALANCE: the DataCoord moves channels from the busiest DataNode to the idlest until their counts differ by at most one (`off`: channels stay where they are, but those of a dead node are still reassigned) [default: `on`]",
    )
    tickler_interval: str | None = Field(
        default=None,
        description="VCHAN_TICKLER_INTERVAL: seconds between watch progress updates [default: `15`]",
    )
    segment_max_size_mb: str | None = Field(
        default=None,
        description="VCHAN_SEGMENT_MAX_SIZE_MB: segment size at which it is sealed [default: `1024`]",
    )
    segment_seal_proportion: str | None = Field(
        default=None,
        description="VCHAN_SEGMENT_SEAL_PROPORTION: share of the max size at which a growing segment may be sealed [default: `0.12`]",
    )
    segment_max_life: str | None = Field(
        default=None,
        description="VCHAN_SEGMENT_MAX_LIFE: seconds after which a growing segment is sealed [default: `86400`]",
    )
    segment_max_idle: str | None = Field(
        default=None,
        description="VCHAN_SEGMENT_MAX_IDLE: seconds without inserts after which a segment is sealed [default: `600`]",
    )
    segment_max_binlog_files: str | None = Field(
        default=None,
        description="VCHAN_SEGMENT_MAX_BINLOG_FILES: binlog files per column group at which a growing segment is sealed (bounds its etcd value) [default: `32`]",
    )
    sync_buffer_mb: str | None = Field(
        default=None,
        description="VCHAN_SYNC_BUFFER_MB: buffered log data that triggers a sync [default: `16`]",
    )
    sync_max_age: str | None = Field(
        default=None,
        description="VCHAN_SYNC_MAX_AGE: age in seconds of the oldest unsynced row that triggers a sync [default: `600`]",
    )
    timetick_lag_warn: str | None = Field(
        default=None,
        description="VCHAN_TIMETICK_LAG_WARN: seconds of time-tick lag before a warning [default: `120`]",
    )
    gc_enabled: str | None = Field(
        default=None,
        description="VCHAN_GC_ENABLED: the DataCoord's lifecycle step garbage-collects (`off`: nothing is removed but by `vchan gc`) [default: `on`]",
    )
    gc_interval: str | None = Field(
        default=None, description="VCHAN_GC_INTERVAL: seconds between garbage collections [default: `3600`]"
    )
    gc_missing_tolerance: str | None = Field(
        default=None,
        description="VCHAN_GC_MISSING_TOLERANCE: seconds before an orphan file is removed [default: `86400`]",
    )
    gc_drop_tolerance: str | None = Field(
        default=None,
        description="VCHAN_GC_DROP_TOLERANCE: seconds before a dropped segment's files are removed [default: `10800`]",
    )
    wal_retention: str | None = Field(
        default=None,
        description="VCHAN_WAL_RETENTION: seconds a log file wholly below its channel checkpoint is kept before GC removes it [default: `86400`]",
    )
    lifecycle_interval: str | None = Field(
        default=None,
        description="VCHAN_LIFECYCLE_INTERVAL: seconds between the active DataCoord's lifecycle steps (plans, sort, compaction, GC) [default: `300`]",
    )
    time_travel: str | None = Field(
        default=None,
        description="VCHAN_TIME_TRAVEL: seconds back a read at a timestamp (`as_of`) may go; garbage collection keeps a dropped segment's files at least this long [default: `3600`]",
    )
    read_pin_ttl: str | None = Field(
        default=None,
        description="VCHAN_READ_PIN_TTL: seconds a read (catalog or Spark job) pins the segments it planned: GC keeps their files until the read ends or this passes [default: `600`]",
    )
    read_pin_reuse: str | None = Field(
        default=None,
        description="VCHAN_READ_PIN_REUSE: seconds a search's read pin may be taken again by the next searches of the same collection in the process (at most half of `VCHAN_READ_PIN_TTL`): back-to-back searches pay one pin, not two etcd writes and a revoke each; the pin ends this long after it was taken, or with its last search (0: a pin per search) [default: `5`]",
    )
    stream_idle_timeout: str | None = Field(
        default=None,
        description='VCHAN_STREAM_IDLE_TIMEOUT: seconds after its last commit or planning a change stream (`readStream.format("vchan")`) stops holding back log retention [default: `86400`]',
    )
    sort_scan_interval: str | None = Field(
        default=None,
        description="VCHAN_SORT_SCAN_INTERVAL: seconds between the active DataCoord's full scans for unsorted flushed segments (a safety net: each flush pushes its segments to the sort at once, through an etcd watch) [default: `60`]",
    )
    sort_leftover_after: str | None = Field(
        default=None,
        description="VCHAN_SORT_LEFTOVER_AFTER: seconds a flushed segment is left to Dagster's sort sensor (its sort shows as a materialization of `sorted_segments` with its check) before the Dagster-hosted DataCoord's lifecycle step sorts it as a leftover (the sensor stopped, or its runs cannot start) [default: `120`]",
    )
    compaction_enabled: str | None = Field(
        default=None,
        description="VCHAN_COMPACTION_ENABLED: the DataCoord plans L0 and mix compactions (`off`: none is planned; the sort after flush, which makes segments visible, still runs; `vchan compact` still works) [default: `on`]",
    )
    compaction_check_interval: str | None = Field(
        default=None,
        description="VCHAN_COMPACTION_CHECK_INTERVAL: seconds between the active DataCoord's compaction checks between lifecycle steps: L0 compaction of a partition past the L0 thresholds, mix compaction of small segments [default: `10`]",
    )
    l0_compaction_trigger_count: str | None = Field(
        default=None,
        description="VCHAN_L0_COMPACTION_TRIGGER_COUNT: a partition with this many L0 segments below their checkpoint gets an L0 compaction at the next compaction check (otherwise at the lifecycle step) [default: `10`]",
    )
    l0_compaction_trigger_mb: str | None = Field(
        default=None,
        description="VCHAN_L0_COMPACTION_TRIGGER_MB: a partition whose L0 segments below their checkpoint hold this many MiB of delta logs gets an L0 compaction at the next compaction check [default: `8`]",
    )
    invisible_segment_limit: str | None = Field(
        default=None,
        description="VCHAN_INVISIBLE_SEGMENT_LIMIT: flushed segments of a vchannel that may wait for their sort (invisible, served as growing) before the Dagster check `invisible_segments_bounded` fails: the sort is not running or not keeping up (a flush makes one per partition at once) [default: `16`]",
    )
    index_handoff_timeout: str | None = Field(
        default=None,
        description="VCHAN_INDEX_HANDOFF_TIMEOUT: seconds a mix compaction output of an indexed collection waits for its index builds before it replaces its inputs in the query view without them (searched exactly until built) [default: `1800`]",
    )
    index_recall_floor: str | None = Field(
        default=None,
        description="VCHAN_INDEX_RECALL_FLOOR: recall@10 that each built segment index must reach on a sample of its own vectors, searched at the default search parameters against exact search, before the Dagster check `index_recall` fails (IVF_PQ is measured, not judged: its codes are lossy) [default: `0.9`]",
    )
    compaction_small_proportion: str | None = Field(
        default=None,
        description="VCHAN_COMPACTION_SMALL_PROPORTION: a Flushed segment below this fraction of the max size is merged by mix compaction [default: `0.5`]",
    )
    compaction_tier_factor: str | None = Field(
        default=None,
        description="VCHAN_COMPACTION_TIER_FACTOR: mix compaction merges small segments of one size tier: at most this many times the tier's smallest [default: `2`]",
    )
    compaction_delete_ratio: str | None = Field(
        default=None,
        description="VCHAN_COMPACTION_DELETE_RATIO: a Flushed segment with more deleted rows than this fraction is rewritten by mix compaction [default: `0.2`]",
    )
    compaction_timeout: str | None = Field(
        default=None,
        description="VCHAN_COMPACTION_TIMEOUT: seconds before an executing plan is failed [default: `900`]",
    )
    compaction_plan_retention: str | None = Field(
        default=None,
        description="VCHAN_COMPACTION_PLAN_RETENTION: seconds a finished compaction plan stays in etcd (for status) before cleanup deletes it [default: `86400`]",
    )
    import_job_retention: str | None = Field(
        default=None,
        description="VCHAN_IMPORT_JOB_RETENTION: seconds a finished import job stays in etcd (for status, and to import a resubmitted job id once) before the import step deletes it [default: `86400`]",
    )
    task_slots: str | None = Field(
        default=None,
        description="VCHAN_TASK_SLOTS: slots of the DataCoord's task scheduler (sort and index tasks run at once; a task takes one slot per million rows) [default: `4`]",
    )
    task_memory_mb: str | None = Field(
        default=None,
        description="VCHAN_TASK_MEMORY_MB: memory budget of the tasks run at once (each task's estimate; one task over it runs alone) [default: `2048`]",
    )
    task_max_attempts: str | None = Field(
        default=None,
        description="VCHAN_TASK_MAX_ATTEMPTS: attempts of a sort or index task before it is Failed (shown by `vchan status`; `vchan index --retry` re-queues index builds); a worker's death under a task spends one only from the second in a row [default: `3`]",
    )
    task_timeout: str | None = Field(
        default=None,
        description="VCHAN_TASK_TIMEOUT: seconds before an InProgress task is taken for dead and goes back to its queue [default: `900`]",
    )
    task_retry_backoff: str | None = Field(
        default=None,
        description="VCHAN_TASK_RETRY_BACKOFF: seconds a failed sort or index task waits before its second attempt, doubled at each further one (0: retried in the next round) [default: `10`]",
    )
    task_retry_backoff_max: str | None = Field(
        default=None,
        description="VCHAN_TASK_RETRY_BACKOFF_MAX: the longest wait between two attempts of a failed task [default: `600`]",
    )
    task_failed_retry: str | None = Field(
        default=None,
        description="VCHAN_TASK_FAILED_RETRY: seconds before a Failed sort or index task is tried again on its own (its attempts reset), doubled each further time it ends Failed, at most a day (0: only `vchan tasks --retry`) [default: `1800`]",
    )
    import_interval: str | None = Field(
        default=None,
        description="VCHAN_IMPORT_INTERVAL: seconds between the active DataCoord's import steps (start Pending jobs, take over stuck ones) [default: `2`]",
    )
    import_buffer_mb: str | None = Field(
        default=None,
        description="VCHAN_IMPORT_BUFFER_MB: rows an import task buffers before writing binlogs (memory per task, flat in the rows imported) [default: `128`]",
    )
    import_timeout: str | None = Field(
        default=None,
        description="VCHAN_IMPORT_TIMEOUT: seconds without progress after which the DataCoord takes over (resumes or retries) an import job [default: `900`]",
    )
    import_max_attempts: str | None = Field(
        default=None,
        description="VCHAN_IMPORT_MAX_ATTEMPTS: attempts of an import job's pre-import and import before it fails [default: `3`]",
    )
    spark_partitions: str | None = Field(
        default=None,
        description='VCHAN_SPARK_PARTITIONS: Spark tasks per sync job; a `format("vchan")` read plans at least twice as many [default: `2`]',
    )
    sync_in_process_mb: str | None = Field(
        default=None,
        description="VCHAN_SYNC_IN_PROCESS_MB: log MB up to which a sync writes its binlogs in the DataNode's process (one thread per task), not as a Spark job: a Spark job's fixed cost is most of a small sync's time (0: always Spark) [default: `32`]",
    )
    dagster_datanodes: str | None = Field(
        default=None,
        description="VCHAN_DAGSTER_DATANODES: DataNodes hosted by Dagster sensors (`datanode_1` .. `datanode_N`) [default: `2`]",
    )
    checkpoint_freshness: str | None = Field(
        default=None,
        description="VCHAN_CHECKPOINT_FRESHNESS: seconds the oldest unsynced message of a vchannel may wait for its checkpoint to advance before the `checkpoints_fresh` check of `channel_checkpoints` fails (keep it above VCHAN_SYNC_MAX_AGE) [default: `900`]",
    )
    dagster_postgres_url: str | None = Field(
        default=None,
        description="VCHAN_DAGSTER_POSTGRES_URL: PostgreSQL database of the Dagster instance `vchan up` starts (`postgresql://user:password@host:5432/dagster`), shared by the daemons and webservers of a cluster; unset: SQLite files under `$VCHAN_HOME/dagster/instance` [default: unset]",
    )
    dagster_sync_loop: str | None = Field(
        default=None,
        description="VCHAN_DAGSTER_SYNC_LOOP: seconds a Dagster-hosted DataNode's sync loop run lives before the next one takes over; each sync is a set of materializations of that run (docs/dagster.md). 0: no loop, every sync is a run of its own [default: `3600`]",
    )
    dagster_retention_days: str | None = Field(
        default=None,
        description="VCHAN_DAGSTER_RETENTION_DAYS: days a finished Dagster run and its event log (the materializations and check results of its syncs) are kept before the retention sensor deletes them [default: `7`]",
    )

    @classmethod
    def from_env(cls) -> VchanResource:
        """An `EnvVar` for every VCHAN_* variable that is set, so the UI shows its source."""
        return cls(**{var.field: dg.EnvVar(var.name) for var in VARIABLES if os.environ.get(var.name)})

    @classmethod
    def from_settings(cls, settings: Settings) -> VchanResource:
        return cls(**{var.field: var.text(getattr(settings, var.field)) for var in VARIABLES})

    def settings(self) -> Settings:
        """The settings these fields describe (an unset field: the table's default),
        validated by `Settings.from_env` (ConfigError on a bad value)."""
        return Settings.from_env(
            {var.name: str(value) for var in VARIABLES if (value := getattr(self, var.field))}
        )


class VchanEnvResource(OpensSystem, dg.ConfigurableResource):
    """The vchan system for the sensors: the settings `vchan` has, read from the code
    server's VCHAN_* environment at each evaluation, with no field per setting.

    Dagster builds a sensor's resources at every evaluation, and the build of
    `VchanResource` (one field per setting) goes over its fields once per field in pydantic
    and Dagster's config schema: measured by `bench.sensor_ticks`, a tick's resource and its
    opening of the system cost 110 ms of CPU with `vchan`, 35 ms with this resource. Runs
    and assets keep `vchan`, whose fields the UI shows with their sources.
    """

    # Not named `env`: Dagster reads a config value {"env": NAME} as the variable NAME.
    variables: dict[str, str] | None = Field(
        default=None,
        description="VCHAN_* variables to read instead of the code server's environment (unset in a deployment)",
    )

    @classmethod
    def from_settings(cls, settings: Settings) -> VchanEnvResource:
        """`settings`, whatever the process environment holds."""
        return cls(variables=settings.to_env())

    def settings(self) -> Settings:
        """The settings of `variables`, or of the process environment, validated by
        `Settings.from_env` (ConfigError on a bad value)."""
        return Settings.from_env(os.environ if self.variables is None else self.variables)


def pyspark_resource(settings: Settings) -> PySparkResource:
    """dagster-pyspark's resource, configured like `spark.session.get_spark`; the sync
    asset runs on its session. Nothing in the process environment changes."""
    if settings.spark_remote:
        return PySparkResource(spark_config={"spark.remote": settings.spark_remote})
    # Python workers must run this interpreter (it has vchan_assets), not `python3`.
    return PySparkResource(
        spark_config={
            "spark.master": settings.spark_master,
            **spark_conf(settings),
            "spark.pyspark.python": sys.executable,
        }
    )
