"""A rank entry for tests/test_forked_ranks.py: writes what this rank sees at its start to ``<out>/rank<R>.json``;
rank 1 then exits with the code ``--exit-rank1`` gives, once rank 0's file is written."""
from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time

PRELOADED = "torch._dynamo" in sys.modules  # imported before this module ran: the launcher forked this rank

if __name__ == "__main__":
    import torch

    out, code = sys.argv[sys.argv.index("--out") + 1], int(sys.argv[sys.argv.index("--exit-rank1") + 1])
    rank = int(os.environ["RANK"])
    sockets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if int(name) > 2 and stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                sockets.append(int(name))
        except OSError:
            pass
    seen = {"argv": sys.argv[1:], "name": __name__, "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "preloaded": PRELOADED, "sockets": sockets,
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "in_modules": "rank_probe" in sys.modules}
    with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(seen, f)
    os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
    if rank == 1:  # torchrun stops rank 0 once rank 1 has failed: not before rank 0 has written its file
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "rank0.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
    sys.exit(code if rank == 1 else 0)
