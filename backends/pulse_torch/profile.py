"""``python -m pulse_torch.profile``: the command-line entry of ``pulse_torch.profiler``."""
import sys

from pulse_torch.profiler import main

if __name__ == "__main__":
    sys.exit(main())
