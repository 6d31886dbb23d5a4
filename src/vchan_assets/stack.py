"""Opening the running system: metastore (embedded etcd or a cluster) and storage.

`Stack.open(settings)` starts the embedded etcd when no endpoints are configured (or
reuses a running one; `start_etcd=False`, for Dagster's sensors and runs and Spark's
workers, only reuses one), connects, and prepares storage. A `Stack` is the `System`
it opened (pass it to any service) plus the embedded etcd; `close()` stops what it
started. Spark is started lazily by whoever needs it (`spark.session.get_spark`).

An etcd that does not answer at start (restarting, not up yet) is tried again with backoff
for VCHAN_ETCD_CONNECT_TIMEOUT (`connect_with_retry`), so a process or a `vchan produce`
started during an etcd restart waits a few seconds instead of failing; an etcd that answers
and refuses (user, password, certificate, permissions) fails at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import EmbeddedEtcd, server_version
from vchan_assets.meta.errors import MetaUnavailableError
from vchan_assets.meta.retry import retry_transient
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.system import System

log = logging.getLogger(__name__)


def connect_with_retry(settings: Settings, endpoints: tuple[str, ...]) -> MetaStore:
    """A client of `endpoints` whose access is checked, retried while etcd is unavailable
    for VCHAN_ETCD_CONNECT_TIMEOUT; then MetaUnavailableError saying how long it tried."""

    def attempt() -> MetaStore:
        store = MetaStore.connect(settings, endpoints)
        try:
            store.check_access(settings)
        except Exception:
            store.close()
            raise
        return store

    timeout = settings.etcd_connect_timeout
    try:
        return retry_transient("connect to etcd", attempt, timeout, (MetaUnavailableError,), max_pause=2.0)
    except MetaUnavailableError as exc:
        if timeout <= 0:
            raise
        tried = f"{exc.operation}, tried for {timeout:g}s (VCHAN_ETCD_CONNECT_TIMEOUT)"
        raise MetaUnavailableError(exc.endpoints, tried, exc.reason) from exc


@dataclass(frozen=True)
class Stack(System):
    etcd: EmbeddedEtcd | None = None

    @classmethod
    def open(cls, settings: Settings, detach: bool = False, start_etcd: bool = True) -> Stack:
        """Connect to VCHAN_ETCD_ENDPOINTS, or to the embedded etcd under VCHAN_HOME,
        starting it if needed (`start_etcd=False`: only a running one, else
        EmbeddedEtcdError)."""
        etcd = None
        endpoints = settings.etcd_endpoints
        if endpoints is None:
            embedded = EmbeddedEtcd(settings.etcd_dir)
            etcd = embedded.start(detach=detach) if start_etcd else embedded.attach()
            endpoints = (etcd.endpoint,)
        try:
            store = connect_with_retry(settings, endpoints)
        except Exception:
            if etcd is not None and etcd.owned:
                etcd.stop()
            raise
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        return cls(settings, store, storage, etcd=etcd)

    def health(self, with_spark: bool = False) -> dict[str, Any]:
        """What is running, for `vchan demo` / `vchan up` and operators."""
        info: dict[str, Any] = {
            "etcd_endpoints": ",".join(self.store.endpoints),
            "etcd_embedded": self.etcd is not None,
            "etcd_revision": self.store.revision(),
            "storage": self.storage.uri,
            "key_root": self.settings.root,
        }
        if self.etcd is not None:
            info["etcd_version"] = server_version(self.etcd.endpoint)
            info["etcd_pid"] = self.etcd.pid
        else:
            status = self.store.client.status()
            info["etcd_version"] = status.version
        if with_spark:
            from vchan_assets.spark.session import get_spark

            spark = get_spark(self.settings)
            info["spark_version"] = spark.version
            info["spark_master"] = self.settings.spark_remote or self.settings.spark_master
        return info

    def close(self, stop_etcd: bool = True) -> None:
        self.store.close()
        if self.etcd is not None and self.etcd.owned and stop_etcd:
            self.etcd.stop()
