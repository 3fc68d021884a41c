"""Real Redis servers for the tier tests: started on free loopback ports, stopped at teardown.

No mocks: every test talks to a ``redis-server`` process of its own (persistence off, bound to
127.0.0.1). A missing ``redis-server`` fails the test with a message saying how to install it;
CI's ``.ci/run`` installs it.

    with running_server(tmp_path) as server:      # one server
        kv = RedisKV(server.url)
        server.stop(); server.start()              # same port, data gone (no persistence)

    with running_cluster(tmp_path) as cluster:    # three primaries, no replicas
        kv = RedisKV(cluster.url)                  # redis+cluster://127.0.0.1:P1
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 10.0
_CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on port + 10000


def server_binary(name: str = "redis-server") -> str:
    """Path of ``redis-server`` (or ``redis-cli``); fails the test, saying how to install it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} not found on PATH: the Redis tier tests start real servers. Install it "
            f"with `apt-get install -y redis-server` (CI's .ci/run does).",
            pytrace=False,
        )
    return path


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A loopback port free now (and, for a cluster node, its bus port ``port + 10000`` too)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((LOOPBACK, 0))
            port = probe.getsockname()[1]
        if not cluster_bus:
            return port
        if port + _CLUSTER_BUS_OFFSET < 65536 and _port_free(port + _CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free loopback port found")


@dataclass
class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port``, its files in ``workdir``."""

    workdir: Path
    port: int = 0
    extra_args: tuple[str, ...] = ()
    password: str | None = field(default=None, repr=False)  # requirepass; not in `url`
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / "redis.log"

    def client(self) -> redis.Redis:
        """A plain redis-py client on this server (for checks behind the store's back)."""
        return redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=5, password=self.password)

    def start(self) -> None:
        """Start on ``port`` (picked when 0) and wait for PING; a fresh, empty server."""
        if self.process is not None:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.port == 0:
            self.port = free_port(cluster_bus="--cluster-enabled" in self.extra_args)
        args = [
            server_binary(),
            "--port",
            str(self.port),
            "--bind",
            LOOPBACK,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.log_path),
            *self.extra_args,
            *(("--requirepass", self.password) if self.password else ()),
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        client = self.client()
        try:
            while True:
                if self.process.poll() is not None:
                    log = self.log_path.read_text() if self.log_path.exists() else ""
                    self.process = None
                    raise RuntimeError(
                        f"redis-server on port {self.port} exited at start; log:\n{log[-2000:]}"
                    )
                try:
                    # Ours, not a server another test started on this port between `free_port`
                    # and this start (ours then fails to bind and exits: a retry, above).
                    if client.ping() and client.info("server")["process_id"] == self.process.pid:
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
                time.sleep(0.01)
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its data is gone (no persistence)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.process = None

    def restart(self) -> None:
        """Stop and start again on the same port: an empty server where the old one was."""
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill: nothing is flushed on the way out."""
        if self.process is None:
            return
        self.process.kill()
        self.process.wait(timeout=5)
        self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing until `resume`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def running_server(
    workdir: Path, extra_args: tuple[str, ...] = (), password: str | None = None
) -> Iterator[RedisServer]:
    """A started `RedisServer` in ``workdir``, stopped on exit (a few tries on port races)."""
    server_binary()
    for attempt in range(5):
        server = RedisServer(
            workdir=workdir / f"redis-{attempt}", extra_args=extra_args, password=password
        )
        try:
            server.start()
            break
        except RuntimeError:
            if attempt == 4:
                raise
    try:
        yield server
    finally:
        server.stop()


@dataclass
class RedisClusterNodes:
    """Primaries of a Redis Cluster (no replicas), all on loopback."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL of the first node; the client discovers the others."""
        return f"redis+cluster://{LOOPBACK}:{self.nodes[0].port}"

    def dbsizes(self) -> list[int]:
        """Keys held by each node."""
        sizes = []
        for node in self.nodes:
            client = node.client()
            try:
                sizes.append(int(client.dbsize()))
            finally:
                client.close()
        return sizes

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _cluster_ok(node: RedisServer) -> bool:
    client = node.client()
    try:
        info = client.execute_command("CLUSTER", "INFO")
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


def wait_cluster_ok(cluster: RedisClusterNodes, timeout_s: float = 30.0) -> None:
    """Wait until every node reports ``cluster_state:ok``."""
    deadline = time.monotonic() + timeout_s
    while not all(_cluster_ok(node) for node in cluster.nodes):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Redis cluster did not reach cluster_state:ok in {timeout_s} s")
        time.sleep(0.05)


@contextlib.contextmanager
def running_cluster(
    workdir: Path, num_nodes: int = 3, node_timeout_ms: int = 5000
) -> Iterator[RedisClusterNodes]:
    """A ``num_nodes``-primary cluster made by ``redis-cli --cluster create``, stopped on exit.
    A node restarted (`RedisServer.start`) keeps its identity and slots (its nodes.conf) but,
    without persistence, none of its data."""
    cli = server_binary("redis-cli")
    cluster = RedisClusterNodes(nodes=[])
    try:
        for k in range(num_nodes):
            node_dir = workdir / f"cluster-node-{k}"
            extra = (
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node_dir / "nodes.conf"),
                "--cluster-node-timeout",
                str(node_timeout_ms),
            )
            node = RedisServer(workdir=node_dir, extra_args=extra)
            node.start()
            cluster.nodes.append(node)
        addresses = [f"{LOOPBACK}:{node.port}" for node in cluster.nodes]
        created = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed:\n{created.stdout.decode()[-2000:]}"
                f"\n{created.stderr.decode()[-2000:]}"
            )
        wait_cluster_ok(cluster)
        yield cluster
    finally:
        cluster.stop()
