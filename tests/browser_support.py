"""Headless Chromium for the page tests, driven over the Chrome DevTools Protocol on a pipe
(--remote-debugging-pipe: NUL-terminated JSON on file descriptors 3 and 4), so no websocket client or other
Python package is needed. `find_chromium` says where the browser is or why there is none; `install_chromium`
installs Debian's package where that is allowed (root, apt-get, TILEDSL_INSTALL_CHROMIUM=1: CI sets it)."""
from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe")
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
INSTALL_SECONDS = 600


def find_chromium() -> str | None:
    """The browser binary ($TILEDSL_CHROMIUM, else the first of CANDIDATES on PATH), or None."""
    chosen = os.environ.get("TILEDSL_CHROMIUM")
    if chosen:
        return chosen if Path(chosen).exists() else None
    return next((found for name in CANDIDATES if (found := shutil.which(name))), None)


def install_chromium() -> str:
    """Try Debian's chromium package; returns "" on success, else why it was not installed."""
    if os.environ.get("TILEDSL_INSTALL_CHROMIUM") != "1":
        return "set TILEDSL_INSTALL_CHROMIUM=1 to let the tests install it (apt-get install -y chromium)"
    if not shutil.which("apt-get"):
        return "no apt-get on this machine to install it with"
    if os.geteuid() != 0:
        return "installing it needs root (apt-get install -y chromium)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        try:
            done = subprocess.run(command, check=False, env=env, capture_output=True, text=True,
                                  timeout=INSTALL_SECONDS)
        except subprocess.TimeoutExpired:
            return f"{' '.join(command)} took over {INSTALL_SECONDS} s"
        if done.returncode:
            return f"{' '.join(command)} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
    return "" if find_chromium() else "apt-get installed chromium but no binary is on PATH"


class Browser:
    """One headless Chromium with one page, driven over CDP. Use as a context manager."""

    def __init__(self, binary: str, width: int = 1500, height: int = 1100):
        self.profile = tempfile.mkdtemp(prefix="tiledsl-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire():   # the child's fd 3 reads our commands, fd 4 carries its replies
            a, b = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     preexec_fn=wire, close_fds=False, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer, self._id, self.events = b"", 0, []
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        for domain in ("Page", "Runtime"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
        self.call("Emulation.setEmulatedMedia", session=True,
                  features=[{"name": "prefers-reduced-motion", "value": "reduce"}])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def call(self, method: str, session: bool = False, timeout: float = 60, **params):
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
                self.events.append(reply)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{method}: no reply in {timeout} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError(f"{method}: the browser closed its pipe (exit status {self.proc.poll()})")
            self._buffer += chunk

    def open(self, path: Path) -> None:
        self.events.clear()
        self.call("Page.navigate", session=True, url=Path(path).resolve().as_uri())
        deadline = time.monotonic() + 60
        while self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: did not finish loading")
            time.sleep(0.05)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def press(self, key: str, code: int) -> None:
        """One key press (down and up) on the focused page: `key` is the DOM key name, `code` its key code."""
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", session=True, type=kind, key=key, code=key,
                      windowsVirtualKeyCode=code, nativeVirtualKeyCode=code)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png")["data"])

    def console_errors(self) -> list[str]:
        return [str(e["params"]) for e in self.events if e.get("method") == "Runtime.exceptionThrown"]


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit truecolor PNG, decoded with zlib (no imaging library)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), f"PNG depth {depth}, color type {color}"
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride = zlib.decompress(idat), width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(line))
        previous = line
    return width, height, rows
