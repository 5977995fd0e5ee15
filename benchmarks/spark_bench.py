"""Events per second into ``foreachBatch`` for both Spark paths, and where the time goes.

    .venv/bin/python benchmarks/spark_bench.py [--events 100000] [--batch-rows 20000]

Starts the simulator in its own process (so it does not share a GIL with the
client), inserts ``--events`` documents, then measures, each over the same
events:

1. the simulator alone: a raw ``aggregate`` + ``getMore`` loop (PyMongo);
2. the simulator + this library's client (``try_next`` loop);
3. the adapter's event → Arrow conversion alone (events already in memory);
4. ``foreach_batch`` fed from memory (conversion + Spark, no server);
5. ``foreach_batch`` end to end (server + client + conversion + Spark; the
   fetch runs on a background thread, overlapping the rest);
6. the ``changestream`` data source end to end (``Trigger.availableNow``,
   ``max_rows_per_batch`` = ``--batch-rows``): the driver reads each event
   once, ahead of Spark, and ships its BSON to the executors inside the
   partitions, where it becomes Arrow; 6b leaves out query start-up and the first batch (Python
   worker start), using Spark's own per-batch durations; 6c/6d are a second
   query in the same session (the first one paid the session's one-off
   start-up);
7. the data source without a row limit (batches bounded by ``prefetch_rows``,
   50,000 by default); 7b without the first batch;
8. the data source's driver side alone (``latestOffset`` + ``partitions``
   without Spark running the tasks): the rate one driver can feed executors;
9. Spark's own floor for the same rows: a streaming source whose partitions
   carry ready Arrow data (no server, no client, no conversion), same batches
   and ``func``; compare 9b with 6d. The script ends with the ratios 7b / 9b (the data
   source with default batches against Spark's floor, the target is 90%) and 6d / 9b.

``foreach_batch`` is measured with a no-op ``func`` (the rows are already in
the JVM: ``createDataFrame`` ships the Arrow data eagerly) and with
``df.count()``; the data source needs an action to read at all, so its
``func`` always counts. With ``MONGODB_URI`` set, that deployment is used
instead of the simulator. The last column is the simulator's own CPU time per
event during each measurement (how much of the two cores the server took).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
from pymongo import MongoClient

import changestream
from changestream.spark_adapter import foreach_batch, register, stream_opener
from changestream.spark_adapter._convert import EventConverter
from changestream.spark_adapter._readahead import unpack
from changestream.stores import MemoryTokenStore


def serve() -> tuple[str, subprocess.Popen[str] | None]:
    """``MONGODB_URI``, or a simulator in a child process (with its own GIL and core)."""
    if os.environ.get("MONGODB_URI"):
        return os.environ["MONGODB_URI"], None
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "changestream.testing",
            "serve",
            "--port",
            "0",
            "--event-cache-mb",
            "512",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    return process.stdout.readline().strip(), process


_SERVER_PID: list[int] = []  # the simulator's process, when this script started it


def server_cpu() -> float | None:
    """CPU seconds the simulator process has used so far (``None``: not ours to read)."""
    if not _SERVER_PID:
        return None
    with open(f"/proc/{_SERVER_PID[0]}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu() -> float:
    """CPU seconds used so far by this process and every process under it (the JVM, Spark's
    Python workers, the simulator), counting reaped children in their parent's total."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)
        times[pid] = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


Result = tuple[int, float, float | None, float | None]
"""``(events, seconds, simulator CPU seconds, CPU seconds of the whole process tree)``."""


def timed(run: Callable[[], int]) -> Result:
    """One run, measured (see :data:`Result`)."""
    cpu, tree, started = server_cpu(), tree_cpu(), time.perf_counter()
    events = run()
    seconds, after = time.perf_counter() - started, server_cpu()
    server = None if cpu is None or after is None else after - cpu
    return events, seconds, server, tree_cpu() - tree


class ReplayStream:
    """A stand-in for ``ChangeStream`` that replays events from memory (``foreach_batch`` only)."""

    def __init__(self, events: list[Any]) -> None:
        self._events: Iterator[Any] = iter(events)
        self.resume_token: Any = None
        self.alive = True
        self.position = changestream.Position(None, None)  # no server: no cluster time

    def try_next(self) -> Any:
        event = next(self._events, None)
        if event is not None:
            self.resume_token = event["_id"]
        return event

    def __enter__(self) -> ReplayStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.alive = False


def floor_source(directory: str, batches: int) -> type:
    """A Python data source that ships ``<directory>/<batch>_<part>.arrow`` (see 9 above).

    Defined in a function so that Spark pickles the classes by value.
    """
    from pathlib import Path

    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

    from changestream.spark_adapter import event_ddl

    class Part(InputPartition):  # type: ignore[misc]
        def __init__(self, data: bytes) -> None:
            self.data = data

    class Reader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
        def initialOffset(self) -> dict[str, int]:
            return {"batch": 0}

        def prepareForTriggerAvailableNow(self) -> None:
            pass

        def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:
            return {"batch": min(start["batch"] + 1, batches)}

        def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[Part]:
            return [
                Part(path.read_bytes())
                for batch in range(start["batch"], end["batch"])
                for path in sorted(Path(directory).glob(f"{batch}_*.arrow"))
            ]

        def read(self, partition: Part) -> Iterator[pa.RecordBatch]:
            return iter(pa.ipc.open_stream(pa.py_buffer(partition.data)))

    class Floor(DataSource):  # type: ignore[misc]
        @classmethod
        def name(cls) -> str:
            return "changestream_floor"

        def schema(self) -> str:
            return event_ddl()

        def streamReader(self, schema: Any) -> Reader:
            return Reader()

    return Floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--batch-rows", type=int, default=20_000, help="rows per micro-batch")
    parser.add_argument("--runs", type=int, default=1,
                        help="run rows 7 and 9 this many times, one after the other; the "
                             "ratio 7b / 9b is printed per run and its median")
    parser.add_argument("--quick", action="store_true",
                        help="only what rows 7 and 9 need (skips 1, 2b, 4, 5, 6 and 8)")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # Spark workers: this venv, loopback
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    total, rows = args.events, args.batch_rows
    uri, server = serve()
    if server is not None:
        _SERVER_PID.append(server.pid)
    results: list[tuple[str, int, float, float | None, float | None]] = []
    breakdown: list[str] = []  # Spark's phases of the batches after the first, per row
    try:
        client: MongoClient[dict[str, Any]] = MongoClient(uri)
        coll = client[f"bench_{os.getpid()}"]["events"]
        with changestream.watch(coll, batch_size=0) as stream:
            start = stream.resume_token
        document = {"qty": 1, "sku": "abc-123", "tags": ["a", "b"], "price": 9.99}

        def insert() -> int:
            for i in range(0, total, 1000):
                coll.insert_many([{"_id": j, **document} for j in range(i, min(i + 1000, total))])
            return total

        results.append(("insert (setup, for reference)", *timed(insert)))

        def raw_get_more() -> int:
            database = coll.database
            reply = database.command(
                {
                    "aggregate": coll.name,
                    "pipeline": [{"$changeStream": {"resumeAfter": start}}],
                    "cursor": {"batchSize": 10_000},
                }
            )
            cursor, seen = reply["cursor"], len(reply["cursor"]["firstBatch"])
            while seen < total:
                batch = database.command(
                    {"getMore": cursor["id"], "collection": coll.name, "batchSize": 10_000}
                )["cursor"]["nextBatch"]
                seen += len(batch)
            database.command({"killCursors": coll.name, "cursors": [cursor["id"]]})
            return seen

        if not args.quick:
            results.append(("1 simulator alone (raw getMore loop)", *timed(raw_get_more)))

        events: list[Any] = []

        def client_loop() -> int:
            with changestream.watch(
                coll, resume_after=start, batch_size=10_000, max_await_time_ms=100
            ) as stream:
                while len(events) < total:
                    event = stream.try_next()
                    if event is not None:
                        events.append(event)
            return len(events)

        results.append(("2 simulator + client (try_next loop)", *timed(client_loop)))

        def token_scan() -> int:
            seen = 0
            with changestream.watch(
                coll,
                [{"$project": {"_id": 1, "operationType": 1}}],
                resume_after=start,
                batch_size=10_000,
                max_await_time_ms=100,
            ) as stream:
                while seen < total:
                    seen += stream.try_next() is not None
            return seen

        if not args.quick:
            results.append(("2b token-only scan (the old driver side)", *timed(token_scan)))

        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        from pyspark.sql.pandas.types import to_arrow_schema
        from pyspark.sql.types import DataType

        from changestream.spark_adapter import event_ddl

        converter = EventConverter(to_arrow_schema(DataType.fromDDL(event_ddl()), timezone="UTC"))

        def convert() -> int:
            return sum(
                converter.convert(events[i : i + rows]).num_rows for i in range(0, total, rows)
            )

        convert()  # warm up
        results.append(("3 event -> Arrow conversion alone", *timed(convert)))

        counted: list[int] = []

        def count(df: Any, batch_id: int) -> None:
            counted.append(df.count())

        def helper(open_stream: Any, func: Any) -> int:
            return foreach_batch(
                spark, open_stream, func, MemoryTokenStore(), max_rows=rows, until_idle=True
            ).rows

        def noop(df: Any, batch_id: int) -> None:
            """The DataFrame already holds the rows: createDataFrame shipped them to the JVM."""

        def from_memory(token: Any) -> ReplayStream:
            return ReplayStream(events)

        helper(lambda token: ReplayStream(events[:rows]), count)  # warm up Spark
        opener = stream_opener(coll, start_after=start, batch_size=10_000, max_await_time_ms=100)
        openers = (("4 from memory", from_memory), ("5 end to end", opener))
        for name, open_stream in () if args.quick else openers:
            for label, func in (("no-op", noop), ("df.count()", count)):
                results.append(
                    (
                        f"{name}: foreach_batch, func {label}",
                        *timed(lambda o=open_stream, f=func: helper(o, f)),
                    )
                )

        def data_source(max_rows: int | None) -> int:
            counted.clear()
            progress.clear()
            with tempfile.TemporaryDirectory() as checkpoint:
                reader = (
                    spark.readStream.format("changestream")
                    .option("uri", uri)
                    .option("database", coll.database.name)
                    .option("collection", coll.name)
                    .option("startup_mode", "token")
                    .option("start_after", changestream.token_to_json(start))
                )
                if max_rows is not None:
                    reader = reader.option("max_rows_per_batch", str(max_rows))
                query = (
                    reader.load()
                    .writeStream.foreachBatch(count)
                    .option("checkpointLocation", checkpoint)
                    .trigger(availableNow=True)
                    .start()
                )
                if not query.awaitTermination(600):
                    query.stop()
                    raise RuntimeError("the availableNow query did not finish in 600 s")
                progress.extend(query.recentProgress)
            return sum(counted)

        def later_batches(name: str) -> None:
            """Spark's own durations of the batches after the first (no query start-up)."""
            later = [p for p in progress if p["batchId"] > 0 and p["numInputRows"]]
            phases: dict[str, float] = {}
            for p in later:
                for phase, ms in p["durationMs"].items():
                    phases[phase] = phases.get(phase, 0) + ms
            if later:
                breakdown.append(
                    f"{name.split()[0]}: ms per batch of "
                    f"{sum(p['numInputRows'] for p in later) / len(later):,.0f} rows: "
                    + ", ".join(f"{k} {v / len(later):.0f}" for k, v in phases.items())
                )
            results.append(
                (
                    name,
                    sum(p["numInputRows"] for p in later),
                    sum(p["durationMs"]["triggerExecution"] for p in later) / 1000,
                    None,
                    None,
                )
            )

        progress: list[Any] = []
        if not args.quick:
            results.append(
                ("6 data source end to end (availableNow)", *timed(lambda: data_source(rows)))
            )
            later_batches("6b data source, batches after the first")
            results.append(
                ("6c data source, 2nd query (warm session)", *timed(lambda: data_source(rows)))
            )
            later_batches("6d 2nd query, batches after the first")
        results.append(("7 data source, no max_rows_per_batch", *timed(lambda: data_source(None))))
        later_batches("7b no row limit, batches after the first")

        def driver_side() -> int:
            """The source's driver work alone: ``latestOffset`` + ``partitions``, no tasks."""
            from pyspark.sql.streaming.datasource import ReadMaxRows

            from changestream.spark_adapter._config import SourceConfig
            from changestream.spark_adapter._source import ChangeStreamReader

            config = SourceConfig.from_options(
                {
                    "uri": uri,
                    "database": coll.database.name,
                    "collection": coll.name,
                    "startup_mode": "token",
                    "start_after": changestream.token_to_json(start),
                }
            )
            reader = ChangeStreamReader(config, DataType.fromDDL(event_ddl()))
            offset, seen = reader.initialOffset(), 0
            try:
                while seen < total:
                    end = reader.latestOffset(offset, ReadMaxRows(rows))
                    seen += sum(
                        len(unpack(p.data)) for p in reader.partitions(offset, end) if p.data
                    )
                    offset = end
            finally:
                reader.stop()
            return seen

        if not args.quick:
            results.append(("8 data source, driver side alone", *timed(driver_side)))

        with tempfile.TemporaryDirectory() as packed:
            batches = 0
            for first in range(0, total, rows):
                sink = pa.BufferOutputStream()
                with pa.ipc.new_stream(sink, converter.schema) as writer:
                    writer.write_batch(converter.convert(events[first : first + rows]))
                with open(os.path.join(packed, f"{batches}_0.arrow"), "wb") as file:
                    file.write(sink.getvalue().to_pybytes())
                batches += 1
            spark.dataSource.register(floor_source(packed, batches))

            def floor() -> int:
                counted.clear()
                progress.clear()
                with tempfile.TemporaryDirectory() as checkpoint:
                    query = (
                        spark.readStream.format("changestream_floor")
                        .load()
                        .writeStream.foreachBatch(count)
                        .option("checkpointLocation", checkpoint)
                        .trigger(availableNow=True)
                        .start()
                    )
                    query.awaitTermination(600)
                    progress.extend(query.recentProgress)
                return sum(counted)

            results.append(("9 Spark floor: prepacked Arrow source", *timed(floor)))
            later_batches("9b Spark floor, batches after the first")
            for run in range(2, args.runs + 1):  # alternate, so load changes hit both alike
                results.append(
                    (f"7 data source, no max_rows_per_batch, run {run}",
                     *timed(lambda: data_source(None)))
                )
                later_batches(f"7b no row limit, batches after the first, run {run}")
                results.append((f"9 Spark floor, run {run}", *timed(floor)))
                later_batches(f"9b Spark floor, batches after the first, run {run}")
        spark.stop()
        client.drop_database(coll.database.name)
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    print(f"\n{total} insert events, {rows} rows per micro-batch, pyarrow {pa.__version__}")
    print(f"{'measurement':48} {'events':>9} {'seconds':>8} {'events/s':>10} {'server µs/ev':>13}"
          f" {'all µs/ev':>10} {'cores':>6}")
    for name, count_, seconds, cpu, tree in results:
        rate = f"{count_ / seconds:>10,.0f}" if seconds else f"{'-':>10}"
        per_event = f"{cpu / count_ * 1e6:>13.1f}" if cpu is not None and count_ else f"{'':>13}"
        whole = (f"{tree / count_ * 1e6:>10.1f} {tree / seconds:>6.2f}"
                 if tree is not None and count_ and seconds else "")
        print(f"{name:48} {count_:>9} {seconds:>8.2f} {rate} {per_event} {whole}")
    print("\n".join(breakdown))
    rates: dict[str, list[float]] = {}
    for name, n, sec, _, _ in results:
        if sec:
            rates.setdefault(name.split()[0], []).append(n / sec)
    for row, what in (("7b", "default batches"), ("6d", f"{rows:,}-row batches, warm")):
        if row in rates and "9b" in rates:
            pairs = zip(rates[row], rates["9b"], strict=False)  # 6d: one run, the first 9b
            ratios = [mine / floor_ for mine, floor_ in pairs]
            each = f" (runs: {', '.join(f'{r:.0%}' for r in ratios)})" if len(ratios) > 1 else ""
            print(f"data source ({row}, {what}) / Spark's floor (9b): "
                  f"{statistics.median(ratios):.0%}{each}")


if __name__ == "__main__":
    main()
