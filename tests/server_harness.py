"""Start and drive a real ComfyUI server on loopback with only this pack enabled.

Follows ComfyUI's own execution tests: ``main.py --cpu --listen`` in a subprocess, POST an
API-format prompt to ``/prompt``, poll ``/history/{id}``. User, output and input folders
live under a test directory so runs never touch a person's ComfyUI data; the Carnator
cache defaults to ``<user dir>/carnator_cache`` exactly as for a user.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from comfy_host import host_path


class HTTPStatusError(RuntimeError):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:2000]}")
        self.status, self.body = status, body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    def __init__(self, workdir: Path, port: int | None = None, startup_timeout: float = 180.0,
                 host: Path | None = None, env: dict[str, str] | None = None,
                 front_end_root: Path | None = None):
        self.workdir = Path(workdir)
        self.host = Path(host) if host else host_path()
        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "comfyui.log"
        self.user_dir = self.workdir / "user"
        self.output_dir = self.workdir / "output"
        self.client_id = uuid.uuid4().hex
        self.extra_env = dict(env or {})  # e.g. CARNATOR_CACHE_URL for a farm worker
        self.front_end_root = Path(front_end_root) if front_end_root else None  # None: the bundled one

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cache_dir(self) -> Path:
        return self.user_dir / "carnator_cache"

    def start(self) -> "ComfyServer":
        for d in (self.user_dir, self.output_dir, self.workdir / "input", self.workdir / "temp"):
            d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--disable-all-custom-nodes", "--whitelist-custom-nodes", "carnator",
               "--user-directory", str(self.user_dir), "--output-directory", str(self.output_dir),
               "--input-directory", str(self.workdir / "input"),
               "--temp-directory", str(self.workdir / "temp"), "--disable-auto-launch",
               "--database-url", f"sqlite:///{self.workdir / 'comfyui.db'}"]
        if self.front_end_root is not None:
            cmd += ["--front-end-root", str(self.front_end_root)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("CARNATOR_CACHE_DIR", None)
        env.pop("CARNATOR_CACHE_URL", None)
        env.update(self.extra_env)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=self.host, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited during start-up:\n{self.log_tail()}")
            try:
                self.get("/system_stats")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {self.startup_timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if getattr(self, "_log", None):
            self._log.close()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    # -------------------------------------------------------------- HTTP
    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 30):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                ctype = resp.headers.get("Content-Type", "")
                return json.loads(raw) if "json" in ctype else raw
        except urllib.error.HTTPError as e:
            raise HTTPStatusError(e.code, e.read().decode(errors="replace")) from None

    def get(self, path: str, timeout: float = 30):
        return self.request("GET", path, timeout=timeout)

    def queue(self, prompt: dict) -> str:
        answer = self.request("POST", "/prompt", {"prompt": prompt, "client_id": self.client_id})
        if answer.get("node_errors"):
            raise RuntimeError(f"prompt rejected: {answer['node_errors']}")
        return answer["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            hist = self.get(f"/history/{prompt_id}")
            if prompt_id in hist and hist[prompt_id].get("status", {}).get("completed") is not None:
                entry = hist[prompt_id]
                if entry["status"].get("status_str") == "error":
                    raise RuntimeError(f"prompt failed: {json.dumps(entry['status'])[:3000]}\n{self.log_tail()}")
                return entry
            time.sleep(0.3)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout}s\n{self.log_tail()}")

    def run(self, prompt: dict, timeout: float = 300) -> dict:
        return self.wait(self.queue(prompt), timeout)

    def __enter__(self) -> "ComfyServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def carnator_outputs(history_entry: dict) -> list[dict]:
    """The summaries Carnator nodes put in the history (ui['carnator'])."""
    found = []
    for out in history_entry.get("outputs", {}).values():
        found.extend(out.get("carnator", []))
    return found
