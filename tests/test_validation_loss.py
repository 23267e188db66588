"""--validation-split: the held-out samples and their loss through the pipeline's forward-only program.

::

    split          deterministic (seeded), disjoint, the same however often asked (every rank, a resume);
                   a fraction or a count; training never draws a held-out sample
    forward only   F and its messages in each rank's program order; a pp 2 V's loss on held-out batches ==
                   the single-device training executor's loss on the same batches (numpy, float64), under
                   the mailbox network and under NCCL's rendezvous rules; no weight or gradient moved;
                   training around it steps exactly as without it
    end to end     `pulse train` (torch) pp 2 and pp 1 log the same val/loss at the same steps (log.json, the
                   step line, TensorBoard's val/loss)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pulse.errors import PlanError, PulseError
from pulse.placement import from_cuts
from pulse.runtime.executor import StageExecutor
from pulse.runtime.forward_only import ForwardOnlyExecutor, forward_only
from pulse.schedule.generators import gpipe, greedy_v_1f1b
from pulse.schedule.lower import lower
from pulse.testing.fake_comm import run_all_ranks
from pulse.testing.fake_rendezvous import RendezvousRules
from pulse.testing.local import LocalRun, local_run
from pulse.testing.numpy_backend import NumpyBackend
from pulse.testing.toy import mse_loss, toy_batches, toy_placement, toy_unet_spec
from pulse.train.validation import (HeldOutOrder, SampleSubset, held_out_count, split_indices, split_source,
                                    validation_due)

SPEC = toy_unet_spec(depth=3)
M, B = 4, 2


# -- the split ----------------------------------------------------------------------------------------------
def test_the_split_is_seeded_disjoint_and_the_same_every_time() -> None:
    train, held = split_indices(100, 0.1, seed=3)
    again_train, again_held = split_indices(100, 0.1, seed=3)
    assert np.array_equal(held, again_held) and np.array_equal(train, again_train)
    assert len(held) == 10 and len(train) == 90 and not set(held) & set(train)
    assert sorted([*held, *train]) == list(range(100))
    assert not np.array_equal(held, split_indices(100, 0.1, seed=4)[1])  # another seed, other samples
    assert held_out_count(100, 7) == 7 and held_out_count(10, 0.01) == 1  # a count; at least one sample
    with pytest.raises(PulseError, match="leaving none to train on"):
        held_out_count(8, 8)


class Source:
    """A stand-in source whose latents are their own sample indices."""

    name, num_samples, sample_shape, condition_names = "numbers", 20, (1,), ("context",)

    def latents(self, index):
        return np.asarray(index, dtype=np.float32).reshape(-1, 1)

    def shape_of(self, index):  # as a latent cache's: the samples' shape, here their first index
        return (int(np.asarray(index)[0]),)

    def conditions(self, index):
        return {"context": np.asarray(index).reshape(-1, 1) * 10}

    def has_empty_prompt(self):
        return False


def test_training_never_reads_a_held_out_sample_and_validation_reads_each() -> None:
    train, held = split_source(Source(), 5, seed=0)
    _, held_indices = split_indices(20, 5, 0)
    seen = {int(v) for i in range(train.num_samples) for v in train.latents(np.array([i])).ravel()}
    assert seen == set(range(20)) - set(held_indices.tolist()) and train.num_samples == 15
    assert held.conditions(np.arange(5))["context"].ravel().tolist() == (held_indices * 10).tolist()
    assert held.sample_shape == (1,) and held.condition_names == ("context",) and "held out" in held.name
    assert held.shape_of(np.array([2, 3])) == (held_indices[2],)  # index-taking methods see the source's indices
    order = HeldOutOrder(5, microbatch_size=2, num_microbatches=2, dp=1)  # 4 a pass: 2 passes, the last wraps
    drawn = [order.indices(p, 0, m) for p in range(order.passes) for m in range(2)]
    assert order.passes == 2 and np.concatenate(drawn).tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert [validation_due(d, 10, 4) for d in (3, 4, 8, 9, 10)] == [False, True, True, False, True]

    class Bucketed(Source):
        buckets = np.zeros(20, dtype=np.int64)
    with pytest.raises(PulseError, match="aspect-ratio buckets"):
        SampleSubset(Bucketed(), np.arange(3), "training")


def test_the_split_flags_reach_the_run_configuration() -> None:
    from pulse.args.run_args import rank_entry_parser, run_config_of
    from pulse.train.run_config import RunConfig

    parse = rank_entry_parser("x", "torchrun").parse_args
    config = run_config_of(parse(["--plan", "p", "--validation-split", "0.1", "--validation-every", "5"]))
    assert (config.validation_split, config.validation_every) == (0.1, 5)
    assert run_config_of(parse(["--plan", "p", "--validation-split", "12"])).validation_split == 12
    for bad in ("1.5", "0", "-3"):
        with pytest.raises(SystemExit):
            parse(["--plan", "p", "--validation-split", bad])
    with pytest.raises(PulseError, match="a whole number of samples"):
        RunConfig(validation_split=2.5)


# -- the forward-only program, in one process ----------------------------------------------------------------------
def build(pp: int, rendezvous: RendezvousRules | None = None) -> LocalRun:
    if pp == 1:
        placement = from_cuts("sequential", [0, SPEC.num_layers], [0], 1, "relay", "single")
        program = lower(gpipe(placement, M), SPEC, placement)
    else:
        placement = toy_placement(SPEC, "v", pp)
        program = lower(greedy_v_1f1b(placement, M), SPEC, placement)
    return local_run(SPEC, placement, program, NumpyBackend(lr=0.5), toy_batches(SPEC, B), mse_loss,
                     rendezvous=rendezvous)


def weights(run: LocalRun) -> dict[str, np.ndarray]:
    return {n: p.copy() for ex in run.executors for c in ex.chunks.values()
            for n, p in ex.backend.parameters(c).items()}


def gradients(run: LocalRun) -> dict[str, np.ndarray]:
    return {n: g.copy() for ex in run.executors for n, g in ex.gradients().items()}


def validate(run: LocalRun, batches) -> float:
    """Every rank's forward-only pass, interleaved in one process; the last chunk's rank has the loss."""
    passes = [ForwardOnlyExecutor(ex, batches) for ex in run.executors]
    for ex in passes:
        ex.begin_pass()
    stats = run_all_ranks(passes, zero_grad=False)
    for ex in passes:
        ex.end_pass()
    (loss,) = [s.loss for s in stats.values() if s.loss is not None]
    return loss


def reference_loss(run: LocalRun, batches) -> float:
    """The single-device model's loss on ``batches`` by its training executor (forward and backward)."""
    ex = run.executors[0]
    trainer = StageExecutor(device=0, spec=SPEC, placement=ex.wiring.placement, schedule=ex.schedule,
                            backend=ex.backend, comm=ex.comm, batches=batches, loss_fn=mse_loss, wiring=ex.wiring,
                            chunks=ex.chunks)
    return run_all_ranks([trainer])[0].loss


@pytest.mark.parametrize("rules", [None, RendezvousRules()], ids=["mailbox", "rendezvous"])
def test_a_pp2_validation_loss_is_the_single_device_loss_and_moves_no_weight(rules) -> None:
    pipelined, single = build(2, rules), build(1)
    for run in (pipelined, single):  # trained one step first: the weights are not the initial ones
        run.step(optimize=True)
    held_out = toy_batches(SPEC, B, seed=7)
    before, grads = weights(pipelined), gradients(pipelined)
    got = validate(pipelined, held_out)
    assert weights(pipelined).keys() == before.keys()
    assert all(np.array_equal(weights(pipelined)[n], w) for n, w in before.items())
    assert all(np.array_equal(gradients(pipelined)[n], g) for n, g in grads.items())
    want = reference_loss(single, held_out)
    assert got == pytest.approx(want, rel=1e-9) and got != pytest.approx(reference_loss(single, toy_batches(SPEC, B)))
    assert validate(pipelined, held_out) == got  # fixed batches: the same number every time


@pytest.mark.parametrize("rules", [None, RendezvousRules()], ids=["mailbox", "rendezvous"])
def test_training_around_a_validation_steps_as_without_it(rules) -> None:
    plain, validated = build(2, rules), build(2, rules)
    for run in (plain, validated):
        run.step(optimize=True)
    validate(validated, toy_batches(SPEC, B, seed=7))
    losses = [run.step(optimize=True) and run.loss() for run in (plain, validated)]
    assert losses[0] == losses[1]
    assert all(np.array_equal(w, weights(validated)[n]) for n, w in weights(plain).items())


def test_the_forward_only_list_keeps_each_ranks_order_and_refuses_encodes() -> None:
    placement = toy_placement(SPEC, "v", 2)
    program = lower(greedy_v_1f1b(placement, M), SPEC, placement)
    forward = forward_only(program)
    for device, row in program.actions.items():
        assert forward.actions[device] == tuple(a for a in row if a.kind in ("F", "SF", "RF"))
        assert sum(a.kind == "F" for a in forward.actions[device]) == M * len(placement.chunks_of(device))

    class WithEncodes:
        name, num_microbatches, actions, has_encodes = "e", M, {}, True
    with pytest.raises(PlanError, match="frozen encoders"):
        forward_only(WithEncodes())


@pytest.mark.parametrize("backend_name", ["torch", "mindspore"])
def test_each_backend_validates_a_pp2_v_as_its_single_device_model(backend_name: str) -> None:
    """The backends' own chunks (float32): the forward-only pass (torch: under no_grad) equals the single-device
    training executor's loss on the same batches, and leaves the weights as they were."""
    from test_backends_runtime import CLUSTER, harness, spec_of

    from pulse.costs import AnalyticProfiler
    from pulse.partition import partition
    from pulse.placement import Chunk, Placement

    h = harness(backend_name)
    spec = spec_of("tiny-uvit")
    placement = partition("pulse", spec, AnalyticProfiler(CLUSTER.hardware).profile(spec, 1), 2, folds=1)
    whole = Placement("sequential", 1, (Chunk(0, spec.num_layers, 0),), "relay", "single")
    runs = [local_run(spec, p, lower(greedy_v_1f1b(p, 2), spec, p), h.make_backend(), h.batches(spec), h.loss_fn)
            for p in (placement, whole)]
    held_out = h.batches(spec)
    pipelined = runs[0]
    before = {n: h.to_numpy(p).copy() for ex in pipelined.executors for c in ex.chunks.values()
              for n, p in ex.backend.parameters(c).items()}
    got = validate(pipelined, held_out)
    ex = runs[1].executors[0]
    want = run_all_ranks([StageExecutor(device=0, spec=spec, placement=whole, schedule=ex.schedule, backend=ex.backend,
                                        comm=ex.comm, batches=held_out, loss_fn=h.loss_fn, wiring=ex.wiring,
                                        chunks=ex.chunks)])[0].loss
    assert got == pytest.approx(want, rel=h.tolerance)
    after = {n: h.to_numpy(p) for ex in pipelined.executors for c in ex.chunks.values()
             for n, p in ex.backend.parameters(c).items()}
    assert all(np.array_equal(after[n], w) for n, w in before.items())


# -- end to end: `pulse train` with the torch backend ---------------------------------------------------------
def train(out: Path, pp: int) -> dict:
    pytest.importorskip("torch")
    pytest.importorskip("tensorboard")
    cmd = [sys.executable, "-m", "pulse.cli.main", "train", "--model", "tiny-unet", "--pp", str(pp), "--dp", "1",
           "--steps", "3", "--microbatch-size", "1", "--num-microbatches", "2", "--validation-split", "3",
           "--validation-every", "2", "--report-to", "tensorboard", "--out-dir", str(out), "--timeout", "120"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"log": json.loads((out / "log.json").read_text()), "stdout": done.stdout}


def test_pulse_train_logs_the_same_validation_loss_at_pp2_as_at_pp1(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {pp: train(tmp_path / f"pp{pp}", pp) for pp in (1, 2)}
    for pp, run in runs.items():
        vals = [s.get("val_loss") for s in run["log"]["steps"]]
        assert vals[0] is None and vals[1] is not None and vals[2] is not None, (pp, vals)  # steps 2 and 3 (last)
        assert f"val/loss {vals[2]:.4f}" in run["stdout"]
        events = EventAccumulator(str(tmp_path / f"pp{pp}" / "tensorboard"))
        events.Reload()
        assert [(s.step, s.value) for s in events.Scalars("val/loss")] == \
            [(1, pytest.approx(vals[1], rel=1e-6)), (2, pytest.approx(vals[2], rel=1e-6))]
    # pipelined training equals single-device training (float32): so does the loss on the held-out samples
    one, two = ([s["val_loss"] for s in run["log"]["steps"][1:]] for run in runs.values())
    assert two == pytest.approx(one, rel=1e-5)
    assert one[0] != one[1]  # the weights moved between the two validations; the batches did not
