"""A restart command for attach-mode tests: asks a simulated engine for a new process
(``POST /sim/fault {"mode": "restart"}``: a new start time, counters from zero, the fault
cleared) and appends the shard to a marker file, so the test can prove the command ran.

    python restart_sim.py URL MARKER SHARD
"""

from __future__ import annotations

import json
import sys
import urllib.request


def main() -> None:
    url, marker, shard = sys.argv[1], sys.argv[2], sys.argv[3]
    req = urllib.request.Request(url + "/sim/fault", data=json.dumps({"mode": "restart"}).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()
    with open(marker, "a") as f:
        f.write(shard + "\n")


if __name__ == "__main__":
    main()
