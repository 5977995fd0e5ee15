"""The core layer: versions, clock, errors, oplog, topology, failpoints, cursors, codec
options, an operation's context. It imports nothing else of the simulator."""
