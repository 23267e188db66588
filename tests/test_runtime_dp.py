"""Data parallel: replicas of a pipeline all-reduce and average their gradients."""
from __future__ import annotations

import numpy as np
import pytest

from pulse.placement import from_cuts
from pulse.testing.local import local_run
from pulse.testing.numpy_backend import NumpyBackend
from pulse.testing.toy import mse_loss, toy_batches, toy_placement, toy_unet_spec
from pulse.schedule.generators import gpipe, greedy_v_1f1b, one_f_one_b
from pulse.schedule.lower import lower

M, B = 4, 2
SPEC = toy_unet_spec(depth=3)


def single_device_grads(seed: int) -> dict[str, np.ndarray]:
    single = from_cuts("sequential", [0, SPEC.num_layers], [0], 1, "relay", "single")
    run = local_run(SPEC, single, lower(gpipe(single, M), SPEC, single), NumpyBackend(),
                    toy_batches(SPEC, B, seed=seed), mse_loss)
    run.step()
    return run.gradients()


@pytest.mark.parametrize("overlap", [False, True], ids=["after-step", "bucket-per-chunk"])
@pytest.mark.parametrize("dp", [2, 3])
@pytest.mark.parametrize("kind", ["v", "sequential"])
def test_replicas_hold_the_average_gradient(kind: str, dp: int, overlap: bool) -> None:
    placement = toy_placement(SPEC, kind, 2)
    generator = greedy_v_1f1b if kind == "v" else one_f_one_b
    schedule = lower(generator(placement, M), SPEC, placement)
    run = local_run(SPEC, placement, schedule, NumpyBackend(), [toy_batches(SPEC, B, seed=r) for r in range(dp)],
                    mse_loss, dp=dp, overlap_dp=overlap)
    run.step()
    refs = [single_device_grads(r) for r in range(dp)]
    expected = {k: sum(ref[k] for ref in refs) / dp for k in refs[0]}
    for r in range(dp):
        grads = run.gradients(replica=r)
        assert max(float(np.max(np.abs(grads[k] - expected[k]))) for k in expected) < 1e-12
    for ex in run.executors:  # each rank all-reduced exactly its own parameters' gradients once
        own = sum(g.nbytes for g in ex.gradients().values())
        assert ex.comm.allreduce_bytes == own
    pipeline_bytes = {(s, d): run.network.bytes_between(s, d) for s in range(2 * dp) for d in range(2 * dp)}
    assert all(v == 0 for (s, d), v in pipeline_bytes.items() if s // 2 != d // 2), "replicas exchanged p2p data"
