"""Change-stream machinery of the simulator: resume tokens, KeyStrings, update descriptions."""
