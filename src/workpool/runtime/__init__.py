"""Long-running services of a worker process: dispatcher, executor, completer, maintenance."""
