"""An S3-compatible server on loopback: moto's server as its own process, for
`vchan demo --cluster` and the tests (a real deployment points `VCHAN_S3_ENDPOINT` at its
S3 service).

moto keeps objects in memory. With `persist=True` the server also appends every request
it receives to `{home}/requests.jsonl` (moto's recorder), and a start on the same home
replays that log before it answers: the objects (and deletes) of the process before come
back, so the server process itself can be killed and restarted, as a real S3 service's
can. A request cut off by the kill (the log's last line, partly written) is dropped: its
client saw the connection fail and retries it. moto logs a request's body only when it
comes with a Content-Length: its clients must not stream aws-chunked bodies (for the AWS
SDKs, pyarrow's included: AWS_REQUEST_CHECKSUM_CALCULATION=when_required).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from vchan_assets.deploy.processes import ServiceError, spawn, stop_tree
from vchan_assets.meta.embedded import free_port, pid_alive

log = logging.getLogger(__name__)


class S3ServerError(ServiceError):
    """The S3 server did not start."""


def _moto_command() -> list[str]:
    binary = Path(sys.executable).parent / "moto_server"
    if binary.exists():
        return [str(binary)]
    if importlib.util.find_spec("moto") is None:
        # moto is a test dependency, not the package's: say what to install.
        raise S3ServerError(
            "the loopback S3 server is moto's: pip install 'moto[s3]' flask flask-cors (the [test] extra has them)"
        )
    return [sys.executable, "-m", "moto.server"]


@dataclass
class S3Server:
    home: Path
    port: int = 0
    detach: bool = False
    persist: bool = False
    process: subprocess.Popen[bytes] | None = None

    @property
    def request_log(self) -> Path:
        return self.home / "requests.jsonl"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1).close()
        except urllib.error.HTTPError:
            return True  # it answered, with an error page
        except OSError:
            return False
        return True

    def start(self, timeout: float = 60.0) -> str:
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        command = [*_moto_command(), "-H", "127.0.0.1", "-p", str(self.port)]
        env = None
        if self.persist:
            self._drop_torn_last_request()
            env = {
                **os.environ,
                "MOTO_ENABLE_RECORDING": "1",
                "MOTO_RECORDER_FILEPATH": str(self.request_log),
            }
        self.process = spawn(command, self.home / "s3.log", env=env, detach=self.detach)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise S3ServerError(f"S3 server did not start on {self.endpoint}; see {self.home / 's3.log'}")
            time.sleep(0.1)
        if self.persist and self.request_log.exists() and self.request_log.stat().st_size:
            self._replay(timeout)
        log.info("S3 server at %s", self.endpoint)
        return self.endpoint

    def _drop_torn_last_request(self) -> None:
        """A kill -9 mid-append leaves a partial last line, which moto's replay cannot parse."""
        if not self.request_log.exists():
            return
        lines = self.request_log.read_bytes().splitlines(keepends=True)
        if lines:
            try:
                json.loads(lines[-1])
            except ValueError:
                self.request_log.write_bytes(b"".join(lines[:-1]))

    def _replay(self, timeout: float) -> None:
        """The objects of the server before this one: the request log re-run against this
        server, in order, with recording paused (the log keeps the original requests).

        Not moto's own replay: a multipart upload gets a new upload id from the new server,
        and the parts and the completion recorded with the old id must carry the new one."""
        started = time.monotonic()
        self._recorder("stop-recording")
        new_ids: dict[str, str] = {}  # upload id in the log -> the one this server gave
        latest: dict[str, str] = {}  # object path -> upload id of its latest CreateMultipartUpload
        entries = [json.loads(line) for line in self.request_log.read_text().splitlines() if line.strip()]
        for entry in entries:
            url = urlsplit(entry["url"])
            if url.path.startswith("/moto-api/"):
                continue
            query = parse_qsl(url.query, keep_blank_values=True)
            old = dict(query).get("uploadId")
            if old is not None:
                new_ids.setdefault(old, latest.get(url.path) or old)
                query = [(k, new_ids[old] if k == "uploadId" else v) for k, v in query]
            raw = entry.get("body") or ""
            body = base64.b64decode(raw) if entry.get("body_encoded") else raw.encode()
            headers = {
                k: v
                for k, v in entry["headers"].items()
                if k.lower() not in ("transfer-encoding", "content-length", "host")
            }
            target = urlunsplit(("http", f"127.0.0.1:{self.port}", url.path, urlencode(query), ""))
            method = entry["method"]
            request = urllib.request.Request(target, data=body or None, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    answer = response.read()
            except urllib.error.HTTPError as exc:
                answer = b""  # the request failed the first time too (a 404 of a HEAD, say)
                log.debug("replay of %s %s: HTTP %s %s", method, url.path, exc.code, exc.read()[:300])
                exc.close()
            if method == "POST" and "uploads" in dict(query):
                found = re.search(rb"<UploadId>([^<]+)</UploadId>", answer)
                if found:
                    latest[url.path] = found.group(1).decode()
        self._recorder("start-recording")
        log.info(
            "S3 server replayed %d requests of %s in %.1fs",
            len(entries),
            self.request_log,
            time.monotonic() - started,
        )

    def _recorder(self, action: str) -> None:
        request = urllib.request.Request(f"{self.endpoint}/moto-api/recorder/{action}", method="POST")
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except OSError as exc:
            raise S3ServerError(f"S3 server at {self.endpoint}: recorder {action} failed: {exc}") from exc

    def kill(self) -> None:
        """kill -9 of the server process (what a crash does)."""
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def create_bucket(self, bucket: str, region: str = "us-east-1") -> None:
        from pyarrow import fs

        s3 = fs.S3FileSystem(
            endpoint_override=self.endpoint, scheme="http", region=region, allow_bucket_creation=True
        )
        s3.create_dir(bucket)

    def stop(self) -> None:
        if self.process is not None and pid_alive(self.process.pid):
            stop_tree(self.process.pid, timeout=10)
        self.process = None
