"""etcd with TLS and authentication, all made here: a CA and a server certificate for
127.0.0.1, a user whose role may read and write the root prefix only. The whole pipeline
runs on it (a producer, a DataNode and a DataCoord process, `vchan status` and metrics, a
Dagster run); a wrong password, a CA that did not sign the server's certificate and a
user without permission each stop a process at start with a message naming what to
check; and no secret (etcd passwords, the server's private key, the AWS secret key)
reaches a log, `vchan status`, the metrics, a Dagster run's records or an exception."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import dagster as dg
import pytest

from vchan_assets.config import Settings
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.sync.assets import segment_table
from vchan_assets.deploy.etcd_cluster import EtcdCluster, EtcdTls
from vchan_assets.meta.errors import MetaAccessError
from vchan_assets.stack import Stack
from vchan_assets.system import System
from vchan_assets.testing.harness import (
    SCHEMA,
    VCHAN,
    Cluster,
    Produced,
    all_synced,
    cli_env,
    fast_settings,
    owners,
    produce,
)
from vchan_assets.testing.steps import assert_exactly_once
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer

from .certs import make_ca, make_server_tls
from .helpers import PATIENCE

ROOT = "vchan-secure"
USER = "vchan"
PASSWORD = f"pw-{uuid.uuid4().hex}"
ROOT_PASSWORD = f"root-{uuid.uuid4().hex}"
STRANGER, STRANGER_PASSWORD = "stranger", f"stranger-{uuid.uuid4().hex}"
AWS_SECRET = f"aws-{uuid.uuid4().hex}"


@dataclass
class SecureEtcd:
    cluster: EtcdCluster
    tls: EtcdTls
    wrong_ca: Path

    def settings(self, base: Settings, **changes: object) -> Settings:
        secure = replace(
            fast_settings(base),
            root=ROOT,
            etcd_endpoints=self.cluster.endpoints,
            etcd_ca_cert=str(self.tls.ca),
            etcd_user=USER,
            etcd_password=PASSWORD,
        )
        return replace(secure, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    """One etcd member serving TLS only, with authentication on: `vchan` may use ROOT/,
    `stranger` may log in and touch nothing."""
    home = tmp_path_factory.mktemp("etcd-tls")
    tls = make_server_tls(home / "certs")
    wrong_ca, _, _ = make_ca(home / "other-ca", "some-other-ca")
    cluster = EtcdCluster(home / "etcd", size=1, tls=tls).start()
    try:
        cluster.enable_auth(ROOT_PASSWORD, USER, PASSWORD, prefix=ROOT + "/")
        cluster.add_user(STRANGER, STRANGER_PASSWORD, root_password=ROOT_PASSWORD)
        yield SecureEtcd(cluster, tls, wrong_ca)
    finally:
        cluster.stop()


def _env(settings: Settings) -> dict[str, str]:
    """A command's environment: the settings' variables, credentials included."""
    return {**cli_env(settings), **settings.to_env()}


def _vchan(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VCHAN), *args], env=_env(settings), capture_output=True, text=True, timeout=120
    )


def _secrets(secure: SecureEtcd) -> list[str]:
    key_body = "".join(secure.tls.key.read_text().splitlines()[1:-1])
    return [PASSWORD, ROOT_PASSWORD, STRANGER_PASSWORD, AWS_SECRET, key_body[:40], key_body[-40:]]


def _assert_no_secret(secure: SecureEtcd, texts: dict[str, str]) -> None:
    for where, text in texts.items():
        for secret in _secrets(secure):
            if secret in text:  # not an assert: its report would print the secret
                pytest.fail(f"a secret appears in {where}")


def test_the_pipeline_runs_on_etcd_with_tls_and_a_user_limited_to_the_root_prefix_and_shows_no_secret(
    secure_etcd: SecureEtcd,
    settings: Settings,
    s3_server: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)  # moto takes any key; pyarrow reads it here
    secure = secure_etcd.settings(
        settings,
        storage_uri=f"s3://{s3_server['bucket']}/{uuid.uuid4().hex[:8]}",
        s3_endpoint=s3_server["endpoint"],
    )
    stack = Stack.open(secure)
    producer = Producer(System(secure, stack.store, stack.storage))
    info = producer.create_collection(f"tls{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)
    produced = Produced()
    produce(producer, info.name, produced, 500, 1, deletes=5)

    cluster = Cluster(secure, tmp_path, env_extra=secure.to_env())
    try:
        cluster.node()
        cluster.coordinator()
        wait_until(lambda: owners(stack.store, list(info.vchannels)), PATIENCE, "the channels watched")
        producer.time_tick(info.name)
        wait_until(lambda: all_synced(stack.store, stack.storage, [info]), PATIENCE, "every channel synced")
        assert_exactly_once(stack.store, stack.storage, info, produced)
        status, status_json, metrics = (
            _vchan(secure, *args) for args in (["status"], ["status", "--json"], ["metrics"])
        )
        for done in (status, status_json, metrics):
            assert done.returncode == 0, done.stderr[-2000:]
        assert info.vchannels[0] in status_json.stdout
        assert "vchan_" in metrics.stdout

        with dg.DagsterInstance.ephemeral() as instance:
            vchan = VchanResource.from_settings(secure)
            result = dg.materialize([segment_table], instance=instance, resources={"vchan": vchan})
            assert result.success
            (mat,) = result.asset_materializations_for_node("segment_table")
            assert mat.metadata["segments"].value >= 2
            run = instance.get_run_by_id(result.run_id)
            dagster_records = "\n".join(
                [repr(run), *(repr(entry) for entry in instance.all_logs(result.run_id))]
            )
        for role in cluster.roles:
            assert role.terminate() == 0
        texts = {
            **{role.log_path.name: role.log() for role in cluster.roles},
            "vchan status": status.stdout + status.stderr,
            "vchan status --json": status_json.stdout + status_json.stderr,
            "vchan metrics": metrics.stdout + metrics.stderr,
            "the Dagster run's records": dagster_records,
            "the settings' repr": repr(secure),
        }
        _assert_no_secret(secure_etcd, texts)
    finally:
        cluster.cleanup()
        stack.close()


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        ("password", [f"authentication of user '{USER}' failed", "VCHAN_ETCD_PASSWORD"]),
        ("ca", ["TLS handshake failed", "VCHAN_ETCD_CA_CERT"]),
        ("permission", [f"user '{STRANGER}' may not read and write keys under {ROOT}/", "readwrite"]),
    ],
)
def test_a_wrong_password_ca_or_permission_stops_a_process_at_start_with_what_to_check(
    secure_etcd: SecureEtcd, settings: Settings, wrong: str, says: list[str]
) -> None:
    changes: dict[str, object] = {
        "password": {"etcd_password": STRANGER_PASSWORD},
        "ca": {"etcd_ca_cert": str(secure_etcd.wrong_ca)},
        "permission": {"etcd_user": STRANGER, "etcd_password": STRANGER_PASSWORD},
    }[wrong]
    bad = secure_etcd.settings(settings, **changes)
    with pytest.raises(MetaAccessError) as raised:
        Stack.open(bad)
    node = subprocess.run(
        [str(VCHAN), "datanode", "--engine", "local"],
        env=_env(bad), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert node.returncode == 1, node.stderr[-2000:]
    assert node.stdout == ""  # it never announced itself as started
    for text in (str(raised.value), node.stderr):
        for expected in says:
            assert expected in text, text
    _assert_no_secret(
        secure_etcd, {"the exception": f"{raised.value!r} {raised.value}", "the node's stderr": node.stderr}
    )
