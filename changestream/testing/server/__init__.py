"""The server layer: the wire protocol (with compression), dispatch of a request to its
command, and the TCP listener of each member. Nothing below it imports it."""
