"""A TCP proxy on loopback, run as its own process (`Endpoint`, or
`python -m vchan_assets.testing.tcp_proxy PORT TARGET_PORT`). Killing it resets every
connection through it and refuses new ones until it is started again on the same port: to
clients, the server behind it went down and came back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from vchan_assets.meta.embedded import free_port


class Endpoint:
    """An endpoint in front of a server at `target` (such as the S3 server): a proxy process."""

    def __init__(self, target: str, log: Path) -> None:
        self.target_port = int(target.rsplit(":", 1)[1])
        self.port = free_port()
        self.log = log
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.port), str(self.target_port)],
                stdout=subprocess.PIPE, stderr=out, text=True,
            )  # fmt: skip
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "listening"

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _serve(port: int, target: int) -> None:
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, server_writer), _pipe(server_reader, client_writer))

    server = await asyncio.start_server(handle, "127.0.0.1", port, reuse_address=True)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), int(sys.argv[2])))
