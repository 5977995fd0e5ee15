"""The simulator judged by a client nobody in this project wrote: the official Node.js driver.

``fidelity.mjs`` runs its checks with the ``mongodb`` npm package against a simulated
3-member replica set, and against a simulated sharded cluster (2 shards, 2 mongoses), and prints ``ok``/``FAIL`` lines and ``N passed, N failed``. The failover
check needs the Python side (``ReplicaSet.step_down``), so the script pauses on ``READY`` and
continues on a line from stdin. Slow (npm install, Node start-up): run with ``-m slow``.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import IO, Any

import pytest
from pymongo import MongoClient

from changestream.testing import ReplicaSet, ShardedCluster

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "fidelity.mjs"
VERSIONS = ["6.0", "7.0", "8.0", "9.0"]
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$")
_install_lock = threading.Lock()


def _pinned_driver_version() -> str:
    return str(json.loads((HERE / "package.json").read_text())["dependencies"]["mongodb"])


def _installed_driver_version() -> str | None:
    manifest = HERE / "node_modules" / "mongodb" / "package.json"
    if not manifest.is_file():
        return None
    return str(json.loads(manifest.read_text())["version"])


@pytest.fixture(scope="session")
def node() -> str:
    """Path of ``node`` with the pinned driver installed in ``tests/node/node_modules``.

    ``npm ci`` runs only when the installed driver is missing or not the pinned version.
    """
    node_bin, npm_bin = shutil.which("node"), shutil.which("npm")
    if node_bin is None or npm_bin is None:
        pytest.skip(
            f"Node.js driver checks need node and npm on PATH (node={node_bin}, npm={npm_bin})"
        )
    with _install_lock:
        if _installed_driver_version() != _pinned_driver_version():
            done = subprocess.run(
                [npm_bin, "ci", "--no-audit", "--no-fund"],
                cwd=HERE,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            if done.returncode != 0:
                pytest.skip(f"npm ci failed (registry unreachable?):\n{done.stdout}\n{done.stderr}")
    return node_bin


def _verdict(output: str) -> tuple[int, int]:
    """(passed, failed) from the script's last line; fails the test if there is none."""
    lines = output.strip().splitlines()
    match = SUMMARY.match(lines[-1]) if lines else None
    assert match, f"fidelity.mjs printed no summary line:\n{output}"
    return int(match.group(1)), int(match.group(2))


def _run_checks(node: str, uri: str, what: str) -> str:
    """Run every check of fidelity.mjs against ``uri``; its output, after asserting no failure."""
    try:
        done = subprocess.run(
            [node, str(SCRIPT), uri],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"fidelity.mjs did not finish in 240 s; output so far:\n{partial}")
    output = done.stdout + done.stderr
    print(output)
    passed, failed = _verdict(done.stdout)
    assert failed == 0 and done.returncode == 0, f"Node driver vs {what}:\n{output}"
    assert passed >= 20, f"fewer checks ran than expected:\n{output}"
    return output


@pytest.mark.parametrize("version", VERSIONS)
def test_node_driver_checks(node: str, version: str) -> None:
    with ReplicaSet(version, members=3) as rs:
        _run_checks(node, rs.uri, f"simulated replica set {version}")


@pytest.mark.parametrize("version", VERSIONS)
def test_node_driver_checks_sharded(node: str, version: str) -> None:
    """The same checks through mongos (2 shards, 2 mongoses), plus the sharded ones.

    The script reads the topology from hello; it skips, with their reason, the replica-set-only
    checks and the simulated mongos's known gaps (listed in fidelity.mjs). A quick no-op
    interval keeps the idle shard from holding events back for long.
    """
    with ShardedCluster(version, shards=2, mongoses=2, noop_interval=0.2) as cluster:
        assert len(cluster.mongoses) == 2
        output = _run_checks(node, cluster.uri, f"simulated sharded cluster {version}")
    lines = output.splitlines()
    for name in ("sharded_topology", "sharded_merge_order", "sharded_resume_other_mongos"):
        assert f"ok {name}" in lines, f"{name} did not pass:\n{output}"


def _lines(stream: IO[str], sink: queue.Queue[str | None]) -> None:
    for line in stream:
        sink.put(line.rstrip("\n"))
    sink.put(None)


def _next_line(lines: queue.Queue[str | None], seen: list[str], timeout: float) -> str | None:
    """The script's next output line (None at its end); fails, showing ``seen``, on silence."""
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"fidelity.mjs --failover silent for {timeout} s:\n" + "\n".join(seen))
    if line is not None:
        seen.append(line)
    return line


@pytest.mark.parametrize("close_connections", [True, False], ids=["crash", "stepdown"])
@pytest.mark.parametrize("version", VERSIONS)
def test_node_driver_stream_survives_step_down(
    node: str, version: str, close_connections: bool
) -> None:
    """A stream open during a failover loses and repeats nothing.

    ``crash`` (connections closed, cursors gone) makes the driver resume on the new primary;
    ``stepdown`` (replSetStepDown) keeps the cursor, which goes on reading on the ex-primary.
    """
    with ReplicaSet(version, members=3) as rs:
        proc = subprocess.Popen(
            [node, str(SCRIPT), rs.uri, "--failover"],
            cwd=HERE,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
        seen: list[str] = []
        try:
            line = ""
            while not line.startswith("READY "):
                next_line = _next_line(lines, seen, 60)
                if next_line is None:
                    pytest.fail("fidelity.mjs ended before READY:\n" + "\n".join(seen))
                line = next_line
            namespace = line.split()[1]
            db_name, coll_name = namespace.split(".", 1)
            old_primary = rs.primary
            new_primary = rs.step_down(close_connections=close_connections)
            assert new_primary != old_primary
            client: MongoClient[dict[str, Any]] = MongoClient(
                rs.uri, serverSelectionTimeoutMS=10_000
            )
            with client:
                client[db_name][coll_name].insert_one({"_id": "from-python"})
            how = "crash" if close_connections else "stepdown"
            proc.stdin.write(f"go {how} {new_primary} from-python\n")
            proc.stdin.flush()
            while _next_line(lines, seen, 90) is not None:
                pass
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    output = "\n".join(seen)
    print(output)
    _, failed = _verdict(output)
    assert failed == 0 and proc.returncode == 0, f"failover with simulator {version}:\n{output}"
