"""Run ``skippy up`` / ``skippy serve`` as real processes for API and launcher tests.

The command listens on port 0; the helper reads the URL it prints (stdout) and the stage pids it
announces (stderr), so nothing is guessed.  Output goes to files (no pipe can fill up).  Whatever
the test does, :meth:`UpProcess.stop` leaves no process behind (SIGTERM, then SIGKILL of the
launcher and of every stage pid it announced).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
_URL = re.compile(r"skippy API(?: for \S+)? on (http://\S+)")
_PID = re.compile(r"pid (\d+) ready on")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone
        return False
    return "\nState:\tZ" not in status


class UpProcess:
    """``python -m skippy <args>`` with its URL and stage pids."""

    def __init__(self, args: Sequence[str], directory: Path) -> None:
        self.args = list(args)
        self.stdout_path = directory / "up.out"
        self.stderr_path = directory / "up.err"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.stage_pids: list[int] = []

    def start(self, timeout: float = 120.0) -> "UpProcess":
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.process = subprocess.Popen([sys.executable, "-m", "skippy", *self.args], stdout=out, stderr=err,
                                            env=env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _URL.search(self.stdout())
            if match:
                self.url = match.group(1)
                self.stage_pids = [int(p) for p in _PID.findall(self.stderr())]
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"skippy {' '.join(self.args)} exited with {self.process.returncode}:\n"
                                   f"{self.stdout()}\n{self.stderr()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"skippy {' '.join(self.args)} did not come up:\n{self.stderr()}")

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def signal(self, number: int, timeout: float = 30.0) -> int:
        """Send ``number`` and wait for the exit status."""
        assert self.process is not None
        self.process.send_signal(number)
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for pid in self.stage_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
