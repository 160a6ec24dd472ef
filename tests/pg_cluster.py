"""A private PostgreSQL cluster for a test or benchmark run: initdb into a temporary folder,
listening on loopback only, stopped by its postmaster's PID (never by name).

Debian's server binaries (postgresql-15) are used from /usr/lib/postgresql/*/bin; .ci/run
installs the package when it is missing. PostgreSQL refuses to run as root, so under root
the cluster runs as the ``postgres`` system user the package creates.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    def __init__(self):
        # under root the server user must reach the folder: pytest's tmp_path is 0700 root
        self.base = Path(tempfile.mkdtemp(prefix="carnator-pg-"))
        self.data = self.base / "data"
        self.port = free_port()
        self.bin = pg_bin()
        self.pid: int | None = None
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _run(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, timeout=120)

    def start(self) -> "PgCluster":
        if self.bin is None:
            raise RuntimeError("PostgreSQL server binaries not found (apt-get install postgresql)")
        if not self.data.exists():
            if self.as_user:
                shutil.chown(self.base, "postgres", "postgres")
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                      "--auth=trust", "-E", "UTF8", "--no-sync")
        opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.base} "
                "-c fsync=on -c max_connections=100 -c shared_buffers=64MB")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts,
                  "-l", str(self.base / "server.log"), "-w", "-t", "60", "start")
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])
        self._watch()
        return self

    def _watch(self) -> None:
        """A watchdog that stops this cluster if the process that started it dies without
        stopping it (a killed pytest must not leave a server running for good)."""
        code = (f"import os, signal, time\n"
                f"while True:\n"
                f"    time.sleep(1)\n"
                f"    try: os.kill({os.getpid()}, 0)\n"
                f"    except ProcessLookupError: break\n"
                f"    try: os.kill({self.pid}, 0)\n"
                f"    except ProcessLookupError: raise SystemExit\n"
                f"try: os.kill({self.pid}, signal.SIGINT)\n"
                f"except ProcessLookupError: pass\n"
                f"for _ in range(60):\n"
                f"    time.sleep(1)\n"
                f"    try: os.kill({self.pid}, 0)\n"
                f"    except ProcessLookupError: break\n"
                f"import shutil; shutil.rmtree({str(self.base)!r}, ignore_errors=True)\n")
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def url(self, db: str = "postgres") -> str:
        if db != "postgres":
            self.create_db(db)
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def create_db(self, db: str) -> None:
        import psycopg
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres",
                             autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db]).fetchone() is None:
                conn.execute(f'CREATE DATABASE "{db}"')

    def processes(self) -> list[int]:
        """The postmaster and every backend and helper it started (from /proc)."""
        found = [self.pid] if self.pid else []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if self.pid and int(fields[1]) == self.pid:
                found.append(int(Path(stat).parent.name))
        return found

    def freeze(self) -> None:
        """SIGSTOP the whole cluster: connections stay open, the kernel still ACKs, nothing
        answers — a hung host as a client sees it."""
        for pid in self.processes():
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.processes():
            os.kill(pid, signal.SIGCONT)

    def stop(self, remove: bool = False) -> None:
        """Fast shutdown of this cluster's own postmaster, by PID."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            self.pid = None
        if remove:
            shutil.rmtree(self.base, ignore_errors=True)
