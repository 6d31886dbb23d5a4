"""deploy/postgres.py: a real PostgreSQL server (Debian's) under a temporary home: created
with initdb on its first start, killed -9 and started again on its data and port, stopped."""

from __future__ import annotations

from pathlib import Path

import psycopg2

from vchan_assets.deploy.postgres import PostgresServer, postgres_storage
from vchan_assets.meta.embedded import pid_alive


def _rows(server: PostgresServer) -> list[tuple[object, ...]]:
    with psycopg2.connect(server.url) as conn, conn.cursor() as cursor:
        cursor.execute("SELECT note FROM notes ORDER BY note")
        return list(cursor.fetchall())


def test_kill_9_then_start_again_keeps_the_data_and_the_port(tmp_path: Path) -> None:
    server = PostgresServer(tmp_path / "pg")
    try:
        url = server.start()
        assert url.endswith("/dagster") and server.missing() == []
        with psycopg2.connect(url) as conn, conn.cursor() as cursor:
            cursor.execute("CREATE TABLE notes (note text)")
            cursor.execute("INSERT INTO notes VALUES ('committed before the kill')")
        pid, port = server.process.pid if server.process else 0, server.port
        server.kill()
        assert not pid_alive(pid) and server.missing() == ["postgres"]

        again = PostgresServer(tmp_path / "pg")  # another process: from the record
        assert again.start() == url and again.port == port
        assert _rows(again) == [("committed before the kill",)]
        assert again.missing() == []
        again.stop()
        assert not again.running() and again.missing() == []
    finally:
        server.stop()


def test_the_dagster_storage_section_names_psycopg2() -> None:
    assert postgres_storage("postgresql://u:p@db:5432/dagster") == {
        "postgres": {"postgres_url": "postgresql+psycopg2://u:p@db:5432/dagster"}
    }
    assert postgres_storage("postgres://db/dagster")["postgres"]["postgres_url"].startswith(
        "postgresql+psycopg2://"
    )
    assert (
        postgres_storage("postgresql+pg8000://db/d")["postgres"]["postgres_url"] == "postgresql+pg8000://db/d"
    )
