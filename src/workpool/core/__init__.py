"""The pure domain of workpool: work states, retry policy, results, statuses and errors (no I/O)."""
