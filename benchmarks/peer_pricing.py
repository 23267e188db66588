"""torch.distributed.pipelining's runs of the peer benchmark priced by PULSE's own simulator: the same
model spec, cost table, cluster and emulated link as PULSE's run, TP's stage cut and TP's schedule
as PULSE's placement and baseline generator of the same shape, priced by the very call
``pulse train --plan`` prices a given plan with (``pulse.planner.price_plan``: the simulated pipeline,
then ``pulse.sim.step``'s exposed all-reduce, clipping and report syncs and the optimizer step; every
link at ``--emulate-bandwidth`` where the run emulated one).

    TP schedule        PULSE placement (chunk c on device ...)   PULSE generator
    gpipe              sequential: c                              gpipe
    1f1b               sequential: c                              1f1b
    interleaved_1f1b   interleaved: c % P  (rank r: r, r + P)     interleaved_1f1b
    interleaved_zb     interleaved: c % P                         zero_bubble_v (B/W split list schedule;
                                                                  PULSE has no interleaved-ZB generator)
    zbv                V: rank r holds r and 2P - 1 - r           zero_bubble_v

Skips: TP relays every pending skip (and temb) through each boundary it spans in its stage's
output tuple, which is PULSE's ``relay`` skip transport (``pulse.traffic.transfers``); two chunks on
one rank (ZBV's turn) pass locally on both sides.

TP cuts are over ``peer_stages.unet_units``, one unit per call of the model's own module; PULSE's
diffusers spec has one layer per such call in the same order (``unit_layer`` names each unit's
layer; ``layer_cuts`` checks them against the spec).

No torch import here: PULSE's planner and simulator are pure Python.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# TP's schedule -> (PULSE's placement kind, PULSE's baseline generator)
TP_SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("sequential", "gpipe"),
    "1f1b": ("sequential", "1f1b"),
    "interleaved_1f1b": ("interleaved", "interleaved_1f1b"),
    "interleaved_zb": ("interleaved", "zero_bubble_v"),
    "zbv": ("v", "zero_bubble_v"),
}


def stage_devices(schedule: str, pp: int) -> tuple[str, list[int]]:
    """PULSE's placement kind for TP's ``schedule`` on ``pp`` ranks and each stage's rank, as TP places
    them (``peer_tp``): one stage per rank; two, r and r + P; or a V, r and 2P - 1 - r."""
    if schedule not in TP_SCHEDULES:
        raise ValueError(f"unknown TP schedule '{schedule}'; known: {', '.join(TP_SCHEDULES)}")
    kind = TP_SCHEDULES[schedule][0]
    if kind == "sequential":
        return kind, list(range(pp))
    if kind == "interleaved":
        return kind, [c % pp for c in range(2 * pp)]
    return kind, list(range(pp)) + list(range(pp - 1, -1, -1))


def tp_placement(schedule: str, cuts: Sequence[int], pp: int):
    """The ``pulse.placement.Placement`` of TP's ``schedule`` with stage cuts ``cuts`` (over PULSE's spec
    layers), skips relayed as TP relays them."""
    from pulse.placement import from_cuts

    kind, devices = stage_devices(schedule, pp)
    if len(cuts) - 1 != len(devices):
        raise ValueError(f"TP {schedule} on {pp} ranks runs {len(devices)} stages; the cuts {list(cuts)} make "
                         f"{len(cuts) - 1}")
    return from_cuts(kind, list(cuts), devices, pp, "relay", f"tp-{schedule}")


def unit_layer(unit: str) -> str:
    """PULSE's diffusers-spec layer name of a ``peer_stages`` unit ("kind:module path", as the benchmark's
    calibration lists them)."""
    kind, path = unit.split(":", 1)
    parts = path.split(".")
    if path == "time_embedding":
        return "time_embed"
    if path in ("conv_in", "conv_out"):
        return path
    if parts[0] == "mid_block":
        return "mid_attn" if parts[1] == "attentions" else f"mid_res{parts[2]}"
    side = {"down_blocks": "down", "up_blocks": "up"}[parts[0]]
    block = f"{side}{parts[1]}"
    if parts[2] == "resnets":
        return f"{block}_res{parts[3]}"
    if parts[2] == "attentions":
        return f"{block}_attn{parts[3]}"
    return f"{block}_{'down' if side == 'down' else 'up'}"  # downsamplers / upsamplers


def unet_layer_names(units: Sequence[str]) -> list[str]:
    """``unit_layer`` of each unit."""
    return [unit_layer(u) for u in units]


def layer_cuts(units: Sequence[str] | None, cuts: Sequence[int], layers: Sequence[str]) -> list[int]:
    """TP's cuts over units as cuts over PULSE's spec layers: the same indices, once every unit is checked
    to be the spec's layer at its place (``units`` None: only the counts are checked)."""
    if units is not None:
        names = unet_layer_names(units)
        if names != list(layers):
            bad = next(i for i, (a, b) in enumerate(zip(names + [None] * len(layers), layers)) if a != b)
            raise ValueError(f"TP's units do not map one to one onto PULSE's layers: unit {bad} is "
                             f"{names[bad] if bad < len(names) else '-'}, the spec's layer {layers[bad]}")
    if cuts[0] != 0 or cuts[-1] != len(layers):
        raise ValueError(f"cuts {list(cuts)} do not span the spec's {len(layers)} layers")
    return list(cuts)


def train_arguments(model_args: Sequence[str], pp: int, microbatch_size: int, microbatches: int,
                    profile: tuple[str | Path, str | Path] | None, bandwidth: float | None,
                    schedule: str = "1f1b") -> argparse.Namespace:
    """``pulse train``'s own parsed flags for PULSE's run of this group (``peer_pipelining.pulse_run``'s
    command), ``--schedule`` the PULSE generator TP's schedule maps to."""
    from pulse.cli.train_cmd import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [*map(str, model_args), "--pp", str(pp), "--dp", "1", "--microbatch-size", str(microbatch_size),
            "--num-microbatches", str(microbatches), "--schedule", schedule]
    if profile is not None:
        argv += ["--costs", str(profile[0]), "--cluster", str(profile[1])]
    if bandwidth is not None:
        argv += ["--emulate-bandwidth", str(bandwidth)]
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Priced:
    """TP's run as PULSE's simulator prices it: ``predicted`` the ``Plan.predicted`` figures
    (``pulse.sim.figures``: step_seconds, pipeline_seconds, pipeline_bytes_per_step, ...)."""

    schedule: str
    generator: str
    placement: object
    predicted: dict

    @property
    def step_seconds(self) -> float:
        return self.predicted["step_seconds"]

    @property
    def pipeline_bytes(self) -> int:
        return self.predicted["pipeline_bytes_per_step"]


def price_tp(model_args: Sequence[str], pp: int, microbatch_size: int, microbatches: int, cuts: Sequence[int],
             schedule: str, bandwidth: float | None, profile: tuple[str | Path, str | Path] | None = None,
             units: Sequence[str] | None = None, order=None) -> Priced:
    """TP's ``schedule`` on ``pp`` ranks with stage ``cuts`` (over ``units``) on a link of ``bandwidth``
    bytes/s (None: free), priced as ``pulse train --plan`` prices a given plan: the model from
    ``model_args`` (``PeerModel.pulse_model_args``), costs and cluster from ``profile`` (None: PULSE's
    analytic costs on its default cluster, as an unprofiled ``pulse train``). ``order``: a
    ``pulse.schedule.ir.Schedule`` over this placement's chunks to price in place of PULSE's generator
    (``peer_tp_order.tp_schedule``: torch's own action order)."""
    from pulse.backend_traits import load_traits
    from pulse.cli.common import load_setup
    from pulse.cli.plan_cmd import plan_request
    from pulse.cli.train_cmd import on_cpus, run_memory_of
    from pulse.planner import choose_schedule, plan_of, price_plan

    kind, generator = TP_SCHEDULES.get(schedule, (None, None))
    if generator is None:
        raise ValueError(f"unknown TP schedule '{schedule}'; known: {', '.join(TP_SCHEDULES)}")
    args = train_arguments(model_args, pp, microbatch_size, microbatches, profile, bandwidth, generator)
    setup = load_setup(args)
    traits = load_traits(args.backend)
    placement = tp_placement(schedule, layer_cuts(units, cuts, [layer.name for layer in setup.spec.layers]), pp)
    placement.validate(setup.spec.num_layers)
    request = plan_request(args, setup, traits)
    costs, cluster = traits.runs(setup.costs, setup.cluster)  # as make_plan orders a baseline
    if order is None:
        schedule_ir = choose_schedule(setup.spec, placement, costs, cluster, request)
    else:
        from pulse.schedule.validate import validate

        validate(order, placement, request.microbatches)
        schedule_ir, generator = order, order.name
    plan = plan_of(request, placement, schedule_ir)
    priced = price_plan(setup.spec, setup.costs, setup.cluster, plan, traits, args.emulate_bandwidth,
                        memory=run_memory_of(args, traits, plan.dp, on_cpus(setup)))
    if "step_seconds" not in priced.predicted:
        raise ValueError(f"TP {schedule}: {priced.predicted.get('note', 'not simulated')}")
    return Priced(schedule, generator, placement, priced.predicted)
