"""Opening the running system: metastore (embedded etcd or a cluster) and storage.

`Stack.open(settings)` starts the embedded etcd when no endpoints are configured (or
reuses a running one; `start_etcd=False`, for Dagster's sensors and runs and Spark's
workers, only reuses one), connects, and prepares storage. A `Stack` is the `System`
it opened (pass it to any service) plus the embedded etcd; `close()` stops what it
started. Spark is started lazily by whoever needs it (`spark.session.get_spark`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import EmbeddedEtcd, server_version
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.system import System

log = logging.getLogger(__name__)


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
        store = MetaStore.connect(settings, endpoints)
        try:
            store.check_access(settings)
        except Exception:
            store.close()
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
