"""A headless Chromium driven over the DevTools protocol: open a page, wait for the app to
render, click by visible text, take a screenshot. Only what the UI tests need: the
Dagster UI is a client-side app, so a tab chosen by a click (not by the URL) needs a
browser that can click."""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import websocket

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1600,1000",
)
LISTENING = re.compile(r"DevTools listening on (ws://127\.0\.0\.1:(\d+)/\S+)")


class Page:
    def __init__(self, ws: websocket.WebSocket) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; events that arrive before its answer are skipped."""
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def eval(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Poll `expression` until it is truthy (errors while the page loads count as no)."""
        guarded = f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return null; }} }})()"
        deadline = time.monotonic() + timeout
        while not (value := self.eval(guarded)):
            if time.monotonic() >= deadline:
                shown = self.eval(
                    "(() => { try { return document.body.innerText; } catch (e) { return ''; } })()"
                )
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}; the page shows: {shown!r:.1500}"
                )
            time.sleep(0.5)
        return value

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def click_text(self, tag: str, text: str) -> bool:
        """Click the first `tag` element whose visible text is `text`; False if none."""
        return bool(
            self.eval(
                f"(() => {{ const el = [...document.querySelectorAll({json.dumps(tag)})]"
                f".find(e => e.textContent.trim() === {json.dumps(text)});"
                " if (el) { el.click(); return true; } return false; })()"
            )
        )

    def text(self) -> str:
        return str(self.eval("document.body.innerText"))

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


@contextmanager
def chromium() -> Iterator[Page]:
    binary = shutil.which("chromium")
    assert binary, "Debian's chromium is required (make system-deps installs it)"
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stderr is not None
            port = _devtools_port(process.stderr)
            with urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as answer:
                target = next(t for t in json.load(answer) if t["type"] == "page")
            ws = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=60)
            try:
                yield Page(ws)
            finally:
                ws.close()
        finally:
            process.kill()
            process.wait(timeout=30)


def _devtools_port(stderr: Any) -> int:
    for line in stderr:
        if found := LISTENING.search(line):
            return int(found.group(2))
    raise AssertionError("chromium exited before it listened for DevTools")
