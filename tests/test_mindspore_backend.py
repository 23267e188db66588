"""The MindSpore backend alone on the fake network: fp16 mixed precision (``--precision fp16``).

Pipelined tiny-uvit (pp 2, pulse V, greedy V-1F1B, M = 2 microbatches of
one sample) against one device under the same casts and loss scale. The
behaviours both backends share are in ``tests/test_backends.py``. Skipped
without MindSpore.
"""
from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from backend_rigs import MBS, max_relative_error, rig  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.train.loop import ScaledLoss  # noqa: E402
from pulse.train.schedules import DynamicLossScale  # noqa: E402
from pulse_mindspore.backend import MindSporeBackend  # noqa: E402

M = 2


def test_fp16_mixed_precision_pipeline_equals_single_device_under_the_same_casts() -> None:
    """``--precision fp16`` on MindSpore: cells compute in float16 from float32 parameters (norms in float32).

    Pipelined (pp 2 V) against one device under the same casts and loss scale (2^10, unscaled here
    as the loop does): the same ops, but gradients that several chunks feed are summed in another
    order in float16: measured 1.1e-3 worst tensor (tolerance 5e-3); a wiring error would be O(1).
    The gradients reach the float32 parameters as float32, and the compute did change against
    float32 (1.0e-2).
    """
    r = rig("mindspore")
    spec = r.spec("tiny-uvit")
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, MBS)

    def step(pp: int, compute: ms.Type | None) -> tuple[dict[str, np.ndarray], float]:
        placement = partition("pulse" if pp > 1 else "sequential", spec, costs, pp)
        program = lower(make_schedule("greedy_v_1f1b" if pp > 1 else "gpipe", placement, M), spec, placement)
        backend, scaler = MindSporeBackend(compute_dtype=compute), DynamicLossScale(scale=2.0 ** 10)  # as fp16 trains
        run = local_run(spec, placement, program, backend, r.make_batches(spec), ScaledLoss(r.loss_fn, backend, scaler))
        run.step()
        return {k: v.asnumpy() / scaler.scale for k, v in run.gradients().items()}, run.loss()

    single, single_loss = step(1, ms.float16)
    pipelined, pipelined_loss = step(2, ms.float16)
    assert single.keys() == pipelined.keys() and {g.dtype for g in single.values()} == {np.dtype("float32")}
    assert max_relative_error(pipelined, single) < 5e-3
    assert pipelined_loss == pytest.approx(single_loss, rel=1e-6)
    fp32, _ = r.reference(spec, M)  # float32, the same batches (cached: test_backends computes it too)
    assert max_relative_error(single, fp32) > 1e-3  # the casts really changed the compute
