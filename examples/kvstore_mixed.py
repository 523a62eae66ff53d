"""MixedSync through the KVStore: the FSA loop of kvstore_fsa.py on ``dist_async``, with DCASGD
at the global servers. Datacenters push and pull without waiting for each other.

    mpirun -n 9 python examples/kvstore_mixed.py --steps 200
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv[1:1] = ["--kv", "dist_async", "--dcasgd", "--lr", "0.3"]
    runpy.run_path(str(Path(__file__).with_name("kvstore_fsa.py")), run_name="__main__")
