"""`kvfork serve` processes for the tests: started on a free loopback port, read through
`/metrics`, checked at rest, and stopped with SIGTERM (a clean exit: status 0, no traceback in
the log, every sequence back)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import openai
import pytest


@dataclass
class Server:
    url: str
    process: subprocess.Popen[str]
    log: IO[str] = field(repr=False)
    stopped: str | None = field(default=None, repr=False)

    def client(self, key: str = "none", timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=timeout)

    def async_client(self, key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def post(
        self, path: str, body: bytes, key: str | None = None, timeout: float = 120
    ) -> tuple[int, dict[str, Any]]:
        """Status and JSON body of a POST (any status)."""
        status, _, data = self.post_raw(path, body, key, timeout)
        return status, json.loads(data)

    def post_raw(
        self, path: str, body: bytes, key: str | None = None, timeout: float = 120
    ) -> tuple[int, dict[str, str], bytes]:
        """Status, headers (lower-case names) and raw body of a POST (any status)."""
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, _lower(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, _lower(exc.headers), exc.read()

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def metric(self, name: str) -> float:
        text = self.metrics_text()
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

    def metrics(self) -> dict[str, float]:
        """Every unlabelled sample of `/metrics`."""
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(r"^(kvfork_\w+) (\S+)$", self.metrics_text(), re.MULTILINE)
        }

    def sequences(self) -> dict[str, float]:
        """The account of the server's sequences (the `kvfork_sequences_*` gauges)."""
        m = self.metrics()
        return {
            "requests": m["kvfork_sequences_requests"],
            "cache": m["kvfork_sequences_cache"],
            "held": m["kvfork_sequences_max"] - m["kvfork_sequences_free"],
            "admitted": m["kvfork_sequences_admitted"],
            "queue": m["kvfork_queue_length"],
        }

    def assert_at_rest(self, within: float = 10.0) -> None:
        """With no request in flight: no sequence held by a request, every held sequence an
        entry of the prefix cache, admission all free, an empty queue (polled: a request's
        clean-up may still be on its way when its client has its answer)."""
        deadline = time.monotonic() + within
        while True:
            s = self.sequences()
            if s["requests"] == s["admitted"] == s["queue"] == 0 and s["held"] == s["cache"]:
                return
            assert time.monotonic() < deadline, f"not at rest: {s}"
            time.sleep(0.05)

    def rss_kib(self) -> int:
        """The server process's resident set."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        assert match
        return int(match.group(1))

    def stop(self) -> str:
        """SIGTERM, then the log; the server must exit by itself with status 0, with no
        traceback in its log (checked once: later calls return the same log)."""
        if self.stopped is not None:
            return self.stopped
        self.process.terminate()
        try:
            code: int | None = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = None
        self.stopped = text = Path(self.log.name).read_text()
        self.log.close()
        assert code is not None, f"the server did not stop within 30 s of SIGTERM\n{text}"
        assert code == 0, f"exit status {code}\n{text[-3000:]}"
        assert "Traceback" not in text, text  # no request may reach an unexpected failure
        assert "ASGI callable" not in text, text  # every response ended properly
        return text


def assert_used_servers_at_rest(request: pytest.FixtureRequest, *names: str) -> None:
    """After a test: each of the server fixtures `names` it used is at rest — its sequences
    all free or prefix-cache entries, its admission free, its queue empty."""
    for name in names:
        if name in request.fixturenames:
            server: Server = request.getfixturevalue(name)
            server.assert_at_rest()


def bench_serve_module() -> ModuleType:
    """`benchmarks/bench_serve.py` as a module (named in `sys.modules` while it loads: its
    dataclasses look their module up)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = bench
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules["bench_serve"]
    return bench


def logprob_margin(logprobs: Iterable[float]) -> float:
    """A reply token's margin from the log-probabilities of its position's best candidates
    (`top_logprobs`, two or more asked for): the best minus the second best, which is the
    logits' margin, for the suite's margin rule. 0 when fewer than two were listed (two
    tokens of one text share a key): no margin can be told, as at a near-tie."""
    best = sorted(logprobs, reverse=True)
    return best[0] - best[1] if len(best) > 1 else 0.0


def _lower(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def servers() -> Iterator[Callable[..., Server]]:
    """A fixture body: `start(*args)` starts `kvfork serve *args`; all stop at the end."""
    started: list[Server] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Server:
        """`env`: variables set for the server beside this process's."""
        port = free_port()
        cmd = [sys.executable, "-m", "kvfork", "serve", *args, "--port", str(port)]
        # The log goes to a file (a pipe nobody reads could fill and stall the server).
        log = tempfile.NamedTemporaryFile("w+", prefix="kvfork-serve-", suffix=".log")  # noqa: SIM115
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
        )
        server = Server(f"http://127.0.0.1:{port}", process, log)
        started.append(server)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, Path(log.name).read_text()
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2):
                    return server
            except urllib.error.HTTPError:
                return server  # it answers (busy or degraded)
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the server did not start")

    yield start
    failures = []
    for server in started:
        try:
            server.stop()
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, failures
