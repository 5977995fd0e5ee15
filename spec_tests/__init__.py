"""MongoDB unified-test-format runner for the change-stream spec tests.

``python -m spec_tests`` and ``pytest spec_tests`` run the same matrix:
every spec test file, against every emulated server version (and topology)
its ``runOnRequirements`` admit.
"""
