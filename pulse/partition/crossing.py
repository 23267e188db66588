"""V cuts that let a skip leave its device, proposed beside the skip-local ones and kept only
when the simulator prices them faster.

Skip locality is a wall in the chain DPs (``cuts.valid_cuts``): every skip stays inside one
encoder/decoder pair. On a fast link a skip that crosses costs little, and the wall can cost
balance. The diffusers UNet of the peer benchmark is the case in point: three attentions of
about 37 ms each are three quarters of its forward, two of them in the outermost decoder level
and the third in the outermost encoder level, tied to them by skips. Every skip-local V over two
devices puts at least two of them on one device (loads 302 / 237 ms); the V that sends two skips
directly balances 76 / 70 ms of forward, and is the placement torch.distributed.pipelining's ZBV
uses (with the skips relayed).

So the priced choice (``symmetric._priced_choice``, not strict) also proposes chains over every
nested cut (``all_cuts``): the balance proxy's best there. A skip whose ends land on two devices
is then sent directly, producer to consumer, once per microbatch (``traffic``), and the simulator
prices those messages on the cluster's links like every other. On a slow link the skip-local
chains win the pricing and nothing changes; the choice is the simulated step's, not a proxy's.
"""
from __future__ import annotations

from pulse.partition.chain import ChainProblem, build_problem
from pulse.partition.common import boundary_loads, prefix_times
from pulse.partition.cuts import CutSet, valid_cuts
from pulse.costs import CostTable
from pulse.spec import ModelSpec

MAX_MATRIX = 2 ** 24  # cells of the k-best DP's (C, C * k) arrays: beyond it fewer proposals


def all_cuts(spec: ModelSpec) -> CutSet:
    """Every cut a V chain can use, skip-local or not."""
    return valid_cuts(spec.num_layers, [])


def crossing_problem(spec: ModelSpec, costs: CostTable, cutset: CutSet) -> ChainProblem:
    """The chain matrices over ``cutset``: pair times are compute, as for skip-local cuts; a cut's
    bytes are its main path and shared inputs (a crossing skip's bytes depend on the whole chain,
    so the proxy leaves them to the simulator)."""
    loads = boundary_loads(spec, relay=False)
    return build_problem(cutset, prefix_times(costs), [load.main for load in loads],
                         [load.shared for load in loads])


def affordable_count(size: int, wanted: int) -> int:
    """How many best chains the k-best DP may keep over ``size`` cuts within ``MAX_MATRIX`` cells
    (at least one: the exact min-max chain)."""
    return max(1, min(wanted, MAX_MATRIX // max(1, size * size)))


def reindex(chain: list[int], source: CutSet, target: CutSet) -> list[int]:
    """``chain``'s cuts, indices into ``source``, as indices into ``target`` (a superset)."""
    position = {cut: i for i, cut in enumerate(target.cuts)}
    return [position[source.cuts[c]] for c in chain]
