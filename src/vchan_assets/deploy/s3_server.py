"""An S3-compatible server on loopback: moto's server as its own process, for
`vchan demo --cluster` (a real deployment points `VCHAN_S3_ENDPOINT` at its S3 service).
It keeps objects in memory: what it holds is gone once it stops.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

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
            "the loopback S3 server is moto's: pip install 'moto[server]' (the [test] extra has it)"
        )
    return [sys.executable, "-m", "moto.server"]


@dataclass
class S3Server:
    home: Path
    port: int = 0
    detach: bool = False
    process: subprocess.Popen[bytes] | None = None

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
        self.process = spawn(command, self.home / "s3.log", detach=self.detach)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise S3ServerError(f"S3 server did not start on {self.endpoint}; see {self.home / 's3.log'}")
            time.sleep(0.1)
        log.info("S3 server at %s", self.endpoint)
        return self.endpoint

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
