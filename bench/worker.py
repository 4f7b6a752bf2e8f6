"""Worker process entry: `python bench/worker.py SYSTEM CONFIG_JSON`.

Builds the system's worker, prints READY, waits for GO on stdin, then runs until
SIGTERM. Started by common.start_workers from a trial process.
"""

from __future__ import annotations

import json
import sys

from systems import SYSTEMS


def main() -> None:
    name, cfg = sys.argv[1], json.loads(sys.argv[2])
    module = __import__(SYSTEMS[name][0], fromlist=["worker_main"])
    module.worker_main(cfg)


if __name__ == "__main__":
    main()
