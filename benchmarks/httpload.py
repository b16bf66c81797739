"""A small HTTP/1.1 load generator on asyncio: keep-alive connections, closed-loop clients, bursts.

Written against the raw socket (no HTTP library per request) so that the generator itself costs little CPU: on
these 2 cores it shares the machine with the server it measures. Handles Content-Length and chunked answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class Connection:
    """One keep-alive connection; ``post`` returns (status, milliseconds, headers)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def post(self, path: str, body: bytes, extra: bytes = b"") -> tuple[int, float, dict[str, str]]:
        """``extra``: more header lines, each ending in CRLF."""
        if self.writer is None:
            await self.open()
        assert self.reader is not None and self.writer is not None
        head = (
            (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n"
            ).encode()
            + extra
            + b"\r\n"
        )
        started = time.perf_counter()
        self.writer.write(head + body)
        status, headers = await self._head()
        await self._body(headers)
        ms = (time.perf_counter() - started) * 1000
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, ms, headers

    async def _head(self) -> tuple[int, dict[str, str]]:
        assert self.reader is not None
        line = await self.reader.readline()
        if not line:
            raise ConnectionError("the server closed the connection")
        status = int(line.split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        return status, headers

    async def _body(self, headers: dict[str, str]) -> bytes:
        assert self.reader is not None
        if "content-length" in headers:
            return await self.reader.readexactly(int(headers["content-length"]))
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while size := int((await self.reader.readline()).split(b";")[0], 16):
                parts.append(await self.reader.readexactly(size))
                await self.reader.readline()
            await self.reader.readline()
            return b"".join(parts)
        return await self.reader.read()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None


@dataclass
class Tally:
    latencies_ms: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    sent: int = 0
    replicas: dict[str, int] = field(default_factory=dict)  # x-fusionserve-replica header -> answers

    def summary(self, clients: int, seconds: float) -> dict[str, Any]:
        answered = sum(self.statuses.values())
        lat = self.latencies_ms
        pct = (lambda q: round(float(np.percentile(lat, q)), 2)) if lat else (lambda q: None)
        return {
            "clients": clients,
            "seconds": round(seconds, 2),
            "requests": answered,
            "lost": self.sent - answered,
            "errors": answered - self.statuses.get(200, 0),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "throughput_rps": round(self.statuses.get(200, 0) / seconds, 1),
            "p50_ms": pct(50),
            "p95_ms": pct(95),
            "p99_ms": pct(99),
            "replicas": dict(sorted(self.replicas.items())),
        }


async def _closed_loop(host: str, port: int, path: str, body: Callable[[int], Any], clients: int, seconds: float) -> dict:
    tally = Tally()
    stop_at = time.perf_counter() + seconds

    async def client(k: int) -> None:
        conn, i = Connection(host, port), k
        while time.perf_counter() < stop_at:
            tally.sent += 1
            try:
                made = body(i)  # the body, or (the body, more header lines)
                status, ms, headers = await conn.post(path, *(made if isinstance(made, tuple) else (made,)))
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
                status, ms, headers = -1, 0.0, {}
                await conn.close()
            tally.statuses[status] = tally.statuses.get(status, 0) + 1
            if status == 200:
                tally.latencies_ms.append(ms)
                replica = headers.get("x-fusionserve-replica", "-")
                tally.replicas[replica] = tally.replicas.get(replica, 0) + 1
            i += clients
        await conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    return tally.summary(clients, time.perf_counter() - started)


def closed_loop(port: int, path: str, body: Callable[[int], Any], clients: int, seconds: float, host: str = "127.0.0.1") -> dict:
    """``clients`` connections, each sending its next request as soon as the last one answered, for ``seconds``.
    ``body(i)``: request i's body, or (its body, more header lines ending in CRLF)."""
    return asyncio.run(_closed_loop(host, port, path, body, clients, seconds))


async def _burst(host: str, port: int, path: str, body: bytes, n: int) -> dict:
    async def one() -> tuple[int, float]:
        conn = Connection(host, port)
        started = time.perf_counter()
        try:
            await conn.open()
            status, _, _ = await conn.post(path, body)
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
            status = -1
        finally:
            await conn.close()
        return status, (time.perf_counter() - started) * 1000  # connect included: what the caller waits

    answers = await asyncio.gather(*(one() for _ in range(n)))
    refused = [ms for s, ms in answers if s == 503]
    return {
        "requests": n,
        "statuses": {str(s): sum(1 for a, _ in answers if a == s) for s in sorted({a for a, _ in answers})},
        "max_503_ms": round(max(refused), 1) if refused else None,
        "p50_503_ms": round(float(np.median(refused)), 1) if refused else None,
        "max_any_ms": round(max(ms for _, ms in answers), 1),  # against a bare app: the floor of client and machine
    }


def burst(port: int, path: str, payload: dict, n: int, host: str = "127.0.0.1") -> dict:
    """``n`` requests sent at once on fresh connections: past the queue limits, the excess must get 503 at once."""
    return asyncio.run(_burst(host, port, path, json.dumps(payload).encode(), n))
