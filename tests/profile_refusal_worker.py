"""One rank of ``pulse_torch.profile_job`` with a refusal planted (``test_profile_refusals``).

``profile_refusal_worker.py refuse|stall JOB_ARGS...`` under torchrun:
  refuse  rank 1 refuses the model in one line (a PulseError), rank 0 profiles on
  stall   rank 0 never reaches the end of its turn; the others wait for it at the turn's barrier
Everything else is the real profile job: its process group, communicator and error path.
"""
from __future__ import annotations

import os
import sys
import threading

import pulse.profiling.job as job
from pulse.errors import PulseError
from pulse_torch import profile_job

RANK = int(os.environ["RANK"])


def refuse_on_rank_1(real_load_model):
    def load_model(*args, **kwargs):
        if RANK == 1:
            raise PulseError("rank 1 cannot hold this model (planted refusal)")
        return real_load_model(*args, **kwargs)
    return load_model


def stall_rank_0(args, spec, backend_of, loss, ranks, *rest):
    if RANK == 0:
        threading.Event().wait()  # measuring for ever: torchrun stops it when another rank leaves
    ranks.barrier()  # waiting its turn, as measure_layers_in_turns does
    return ranks.gather(None)


if __name__ == "__main__":
    mode, job_args = sys.argv[1], sys.argv[2:]
    if mode == "refuse":
        job.load_model = refuse_on_rank_1(job.load_model)
    else:
        job.measure_layers_in_turns = stall_rank_0
    profile_job.main(job_args)
