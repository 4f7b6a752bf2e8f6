"""The chaos run of workpool: real worker processes, SIGKILLs, server faults, then proof.

See docs/reliability.md and ``python -m chaos.run --help``.
"""
