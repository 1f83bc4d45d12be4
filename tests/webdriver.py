"""A small W3C WebDriver client for the system's ChromeDriver driving headless Chromium.

Only what the page test needs: open a URL, find elements, type, click, run a script, read the
browser's console log, take a screenshot.  It speaks the WebDriver HTTP protocol with the standard
library (no selenium, whose driver manager would try to download a browser).  Chromium runs
headless with its own profile in a temporary directory and with host resolution mapped to
nothing except 127.0.0.1, so the page cannot reach any other host.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, TypeVar

#: The W3C key of an element reference.
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"

T = TypeVar("T")


def browser_paths() -> tuple[str, str] | None:
    """(chromium, chromedriver) when both are installed (Debian: chromium, chromium-driver)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class WebDriverError(RuntimeError):
    """ChromeDriver answered an error."""


class Browser:
    """One headless Chromium session through ChromeDriver; :meth:`close` ends both."""

    def __init__(self, browser: str, driver: str, profile: Path, log: Path) -> None:
        port = _free_port()
        self._log = log.open("wb")
        self.driver = subprocess.Popen([driver, f"--port={port}", "--allowed-ips=127.0.0.1"], stdout=self._log,
                                       stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                self._call("GET", "/status")
                break
            except (OSError, WebDriverError):  # not listening yet
                if time.monotonic() > deadline or self.driver.poll() is not None:
                    self.close()
                    raise RuntimeError(f"chromedriver did not start (log: {log})") from None
                time.sleep(0.1)
        options = {"binary": browser, "args": [
            "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
            f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-default-apps", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]}
        try:
            answer = self._call("POST", "/session", {"capabilities": {"alwaysMatch": {
                "browserName": "chrome", "goog:chromeOptions": options, "goog:loggingPrefs": {"browser": "ALL"}}}})
        except BaseException:  # no browser session: the driver must not outlive this constructor
            self.close()
            raise
        self.session = answer["sessionId"]

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # WebDriver errors come as 4xx/5xx with a JSON body
            raise WebDriverError(exc.read().decode("utf-8", "replace")[:2000]) from exc
        return answer.get("value")

    def _session(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._call(method, f"/session/{self.session}{path}", body)

    def get(self, url: str) -> None:
        self._session("POST", "/url", {"url": url})

    def script(self, source: str, *args: Any) -> Any:
        """Run ``source`` as a function body in the page (``arguments[i]`` are ``args``)."""
        return self._session("POST", "/execute/sync", {"script": source, "args": list(args)})

    def find(self, css: str) -> str:
        return str(self._session("POST", "/element", {"using": "css selector", "value": css})[ELEMENT])

    def type(self, css: str, text: str) -> None:
        element = self.find(css)
        self._session("POST", f"/element/{element}/clear", {})
        self._session("POST", f"/element/{element}/value", {"text": text})

    def click(self, css: str) -> None:
        self._session("POST", f"/element/{self.find(css)}/click", {})

    def console(self) -> list[dict[str, Any]]:
        """The browser's console entries since the last call (ChromeDriver's log endpoint)."""
        return list(self._session("POST", "/se/log", {"type": "browser"}))

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self._session("GET", "/screenshot")))
        return path

    def wait(self, what: Callable[[], T], timeout: float, description: str, interval: float = 0.05) -> T:
        """Poll ``what`` until it returns something truthy; that value."""
        deadline = time.monotonic() + timeout
        while True:
            value = what()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {description}")
            time.sleep(interval)

    def close(self) -> None:
        try:
            if getattr(self, "session", None):
                self._call("DELETE", f"/session/{self.session}", timeout=30)
        except (OSError, WebDriverError):
            pass  # the browser is gone already: the driver is stopped below either way
        finally:
            self.session = ""
            if self.driver.poll() is None:
                self.driver.terminate()
                try:
                    self.driver.wait(10)
                except subprocess.TimeoutExpired:
                    self.driver.kill()
                    self.driver.wait(10)
            self._log.close()
