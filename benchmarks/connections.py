"""What connections cost the simulator: idle ones, many closing at once, lying headers, EMFILE.

    python -m benchmarks.connections idle [--connections 10000] [--rounds 2] [--liars 60]
    python -m benchmarks.connections emfile [--limit 1024] [--connections 1100]

The simulator (``python -m changestream.testing serve``) runs in a child
process; its resident memory and thread count are read from ``/proc``.

``idle``: open N connections (each answers one ping, so the server has
accepted it), then close them all at once and time a new client's ping from
the moment the last one was closed. Repeated ``--rounds`` times, so memory
after the second round shows whether it stays flat. Then ``--liars``
connections each send a 16-byte header announcing a 48 MB message and no body:
the memory they hold.

``emfile``: the server runs with ``RLIMIT_NOFILE`` set to ``--limit`` (soft and
hard, so it cannot raise it), N > limit clients connect, then all close; the
time until a new client's ping is answered shows that accepting resumed.

``--server-path DIR`` runs the server from another checkout (``PYTHONPATH``),
to compare with an older simulator.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bson

ROOT = Path(__file__).resolve().parents[1]
HEADER = struct.Struct("<iiii")
OP_MSG = 2013
PING = bson.encode({"ping": 1, "$db": "admin"})


def _ping_message(request_id: int) -> bytes:
    payload = b"\0\0\0\0\x00" + PING
    return HEADER.pack(16 + len(payload), request_id, 0, OP_MSG) + payload


def _read_reply(sock: socket.socket) -> None:
    header = _recv(sock, 16)
    _recv(sock, HEADER.unpack(header)[0] - 16)


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed by the server")
        buf += chunk
    return buf


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            out[key] = int(value.split()[0])
    return {"rss_mb": out.get("VmRSS", 0) // 1024, "threads": out.get("Threads", 0)}


def _start_server(server_path: Path, limit: int | None) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(server_path)}

    def limit_descriptors() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    proc = subprocess.Popen(
        [sys.executable, "-m", "changestream.testing", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=server_path,  # `-m` puts the working directory first on sys.path
        preexec_fn=limit_descriptors,
    )
    assert proc.stdout is not None
    uri = proc.stdout.readline().strip()
    if not uri:
        proc.kill()
        raise SystemExit(f"the server did not start: {proc.communicate()[1]}")
    return proc, uri.removeprefix("mongodb://").split("/")[0]


def _timed_ping(host: str, port: int, timeout: float) -> float | None:
    """Seconds for a new client to connect and get a ping answered; None on timeout."""
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_ping_message(1))
            _read_reply(sock)
    except OSError:
        return None
    return time.monotonic() - started


def _open(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` connections, each having had one ping answered (pipelined across them)."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection((host, port), timeout=120)
        socks.append(sock)
    for i, sock in enumerate(socks):
        sock.sendall(_ping_message(i + 1))
    for sock in socks:
        _read_reply(sock)
    return socks


def idle(args: argparse.Namespace) -> dict[str, Any]:
    proc, address = _start_server(args.server_path, None)
    host, port = address.rsplit(":", 1)
    results: dict[str, Any] = {"connections": args.connections, "rounds": []}
    try:
        _timed_ping(host, int(port), 30)
        results["baseline"] = _proc_status(proc.pid)
        for _ in range(args.rounds):
            row: dict[str, Any] = {}
            started = time.monotonic()
            socks = _open(host, int(port), args.connections)
            row["open_s"] = round(time.monotonic() - started, 2)
            row["open"] = _proc_status(proc.pid)
            row["ping_while_open_s"] = _timed_ping(host, int(port), 120)
            started = time.monotonic()
            for sock in socks:
                sock.close()
            closed = time.monotonic()
            ping = _timed_ping(host, int(port), 120)
            row["close_all_s"] = round(closed - started, 3)
            row["ping_after_close_s"] = None if ping is None else round(ping, 3)
            time.sleep(1)
            row["after_1s"] = _proc_status(proc.pid)
            time.sleep(4)
            row["after_5s"] = _proc_status(proc.pid)
            results["rounds"].append(row)
        if args.liars:
            before = _proc_status(proc.pid)
            liars = []
            for i in range(args.liars):
                sock = socket.create_connection((host, int(port)), timeout=30)
                sock.sendall(HEADER.pack(48_000_000, i, 0, OP_MSG))
                liars.append(sock)
            time.sleep(1)
            results["liars"] = {
                "n": args.liars,
                "before": before,
                "holding": _proc_status(proc.pid),
                "ping_s": _timed_ping(host, int(port), 30),
            }
            for sock in liars:
                sock.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    return results


def emfile(args: argparse.Namespace) -> dict[str, Any]:
    proc, address = _start_server(args.server_path, args.limit)
    host, port = address.rsplit(":", 1)
    results: dict[str, Any] = {"limit": args.limit, "connections": args.connections}
    socks: list[socket.socket] = []
    try:
        for _ in range(args.connections):
            socks.append(socket.create_connection((host, int(port)), timeout=30))
        time.sleep(2)
        results["ping_while_full_s"] = _timed_ping(host, int(port), 3)
        results["full"] = _proc_status(proc.pid)
        started = time.monotonic()
        for sock in socks:
            sock.close()
        socks.clear()
        ping = None
        while ping is None and time.monotonic() - started < 120:
            ping = _timed_ping(host, int(port), 5)
        results["accepting_again_after_s"] = (
            None if ping is None else round(time.monotonic() - started, 3)
        )
        results["server_alive"] = proc.poll() is None
    finally:
        for sock in socks:
            sock.close()
        proc.terminate()
        _out, err = proc.communicate(timeout=60)
    results["server_log"] = [line for line in err.splitlines() if line.strip()][:10]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.connections")
    parser.add_argument("--server-path", type=Path, default=ROOT)
    sub = parser.add_subparsers(dest="mode", required=True)
    p_idle = sub.add_parser("idle")
    p_idle.add_argument("--connections", type=int, default=10_000)
    p_idle.add_argument("--rounds", type=int, default=2)
    p_idle.add_argument("--liars", type=int, default=60)
    p_emfile = sub.add_parser("emfile")
    p_emfile.add_argument("--limit", type=int, default=1024)
    p_emfile.add_argument("--connections", type=int, default=1100)
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    result = idle(args) if args.mode == "idle" else emfile(args)
    for key, value in result.items():
        if key == "rounds":
            for i, row in enumerate(value, 1):
                print(f"round {i}: {row}")
        elif key == "server_log":
            for line in value:
                print(f"server: {line}")
        else:
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
