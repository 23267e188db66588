"""The program engine runs the lowered lists the runtime runs: message calls cost the rank,
links serialize per rank, and the step adds buckets, clipping, the optimizer and the report."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from test_schedule_helpers import cluster, sequential, unet, uniform_costs, wave

from pulse.links import LinkCost
from pulse.placement import from_cuts
from pulse.runtime.wiring import Wiring
from pulse.schedule.generators import gpipe, greedy_v_1f1b, one_f_one_b, zero_bubble_v
from pulse.schedule.passes import add_send_recv
from pulse.sim import simulate
from pulse.sim.program import Wire
from pulse.sim.step import NORM_BYTES, REPORT_BYTES, StepTerms, step_time


def _Link(bandwidth: float, latency: float, overhead: float) -> LinkCost:
    return LinkCost(bandwidth, latency, overhead, overhead)


@dataclass(frozen=True)
class MeasuredCluster:
    """A cluster as ``pulse profile`` describes it: per-pair link terms, all-reduce by size."""

    base: object
    link: LinkCost
    allreduce_per_byte: float = 0.0

    def __getattr__(self, name):
        return getattr(self.base, name)

    def link_cost(self, a: int, b: int) -> LinkCost:
        return self.link

    def allreduce_seconds(self, nbytes: float, ranks: int) -> float:
        return 0.5 + nbytes * self.allreduce_per_byte


@pytest.mark.parametrize("case", ["seq-relay", "v-direct", "seq-shared"])
def test_message_matching_equals_the_runtime_wiring(case: str) -> None:
    spec = unet(8, shared=case == "seq-shared")
    placement = wave(4) if case == "v-direct" else sequential(8)
    program = add_send_recv(greedy_v_1f1b(placement, 3) if case == "v-direct" else one_f_one_b(placement, 3),
                            spec, placement)
    wire, wiring = Wire.of(spec, placement), Wiring(spec, placement)
    assert wire.tensors == tuple(len(wiring.payload(i)) for i in range(len(wiring.transfers)))
    assert wire.messages == tuple(1 for _ in wiring.transfers)  # a transfer's tensors travel together
    for d, row in program.actions.items():
        assert {p: k[1] for p, k in wire.message_keys(row).items()} == wiring.match_transfers(row)


def test_message_calls_cost_the_rank_and_latency_follows_the_link() -> None:
    # two 1-layer stages, F = 1 s, B = 2 s; one 100-byte tensor per message at 100 B/s
    spec, placement = unet(2, out_bytes=100, skip_bytes=0), sequential(2)
    assert Wire.of(spec, placement).messages == (1,)
    net = MeasuredCluster(cluster(), _Link(100.0, 0.25, 0.1))
    r = simulate(spec, placement, gpipe(placement, 1), uniform_costs(spec), net)
    # dev0 F [0,1], SF [1,1.1], link [1.1,2.1], arrival 2.35; dev1 RF [2.35,2.45], F1 [2.45,3.45]
    assert r.span("F", 1, 0).start == pytest.approx(2.45)
    # dev1 B1 [3.45,5.45], SB [5.45,5.55], link [5.55,6.55], arrival 6.8; dev0 RB [6.8,6.9], B0 [6.9,8.9]
    assert r.span("B", 0, 0).start == pytest.approx(6.9)
    assert r.makespan == pytest.approx(8.9)
    assert r.comm_busy == pytest.approx((0.2, 0.2))
    assert r.sends_done == pytest.approx((2.35, 6.8))


def test_a_compute_action_after_a_message_action_starts_cold() -> None:
    """The case above with cold starts F 0.3 s, B 0.5 s: every compute action right after a message
    action (or first in its list) takes that more; one right after another compute action does not."""
    spec, placement = unet(2, out_bytes=100, skip_bytes=0), sequential(2)
    net = MeasuredCluster(cluster(), _Link(100.0, 0.25, 0.1))
    costs = replace(uniform_costs(spec), cold_start=(("F", 0.3), ("B", 0.5)))
    r = simulate(spec, placement, gpipe(placement, 1), costs, net)
    # dev0 F0 first: [0, 1.3], SF [1.3, 1.4], link [1.4, 2.4], arrival 2.65; dev1 RF [2.65, 2.75]
    assert r.span("F", 0, 0).end == pytest.approx(1.3)
    # F1 after its receive: cold [2.75, 4.05]; B1 right after F1: warm [4.05, 6.05]
    assert r.span("F", 1, 0).start == pytest.approx(2.75) and r.span("F", 1, 0).end == pytest.approx(4.05)
    assert r.span("B", 1, 0).end == pytest.approx(6.05)
    # SB [6.05, 6.15], link [6.15, 7.15], arrival 7.4; RB [7.4, 7.5]; B0 after its receive: cold [7.5, 10.0]
    assert r.span("B", 0, 0).start == pytest.approx(7.5)
    assert r.makespan == pytest.approx(10.0)


def test_a_split_backward_starts_cold_as_its_input_half() -> None:
    """Under a split backward (ZB-V) the B action is the input half: the whole backward's cold
    start does not apply to it, the input half's does."""
    spec, placement = unet(4, out_bytes=100, skip_bytes=0), wave(2)
    net = MeasuredCluster(cluster(), _Link(100.0, 0.25, 0.1))
    base = uniform_costs(spec)
    schedule = zero_bubble_v(placement, 4)

    def makespan(**cold: float) -> float:
        return simulate(spec, placement, schedule, replace(base, cold_start=tuple(cold.items())), net).makespan

    plain = makespan()
    assert makespan(B=9.0) == pytest.approx(plain)
    assert makespan(Bi=0.5) > plain and makespan(W=0.5) >= plain


def test_one_outbound_link_per_rank() -> None:
    # zero compute: dev0 sends five 1 s messages back to back; they queue on its one link
    spec, placement, m = unet(2, out_bytes=100, skip_bytes=0), sequential(2), 5
    r = simulate(spec, placement, gpipe(placement, m), uniform_costs(spec, f=0.0, b=0.0),
                 MeasuredCluster(cluster(), _Link(100.0, 0.0, 0.0)))
    assert sorted(msg.end for msg in r.messages if msg.direction == "F") == pytest.approx([1, 2, 3, 4, 5])


def test_a_sender_is_not_held_by_another_senders_receiver() -> None:
    # a V over 4 devices, no compute, slow links: devices 1 and 2 receive from two senders each
    spec, placement = unet(8, out_bytes=100, skip_bytes=0), wave(4)
    r = simulate(spec, placement, greedy_v_1f1b(placement, 4), uniform_costs(spec, f=0.0, b=0.0),
                 MeasuredCluster(cluster(), _Link(100.0, 0.0, 0.0)))
    out: dict[int, list] = {}
    into: dict[int, list] = {}
    for m in r.messages:
        hold = m.nbytes / 100.0
        assert m.end - hold >= m.start - 1e-12  # the inbound stretch starts once the message is sent
        out.setdefault(m.src_device, []).append((m.start, m.start + hold))
        into.setdefault(m.dst_device, []).append((m.end - hold, m.end))
    for stretches in [*out.values(), *into.values()]:  # one message at a time on every link
        stretches.sort()
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(stretches, stretches[1:]))
    # a message that waited for its receiver's link did not hold its sender's: the sender's
    # next message started before it got the receiver's link
    waited = [m for m in r.messages if m.end - m.nbytes / 100.0 > m.start + 1e-9]
    assert any(n.src_device == m.src_device and m.start < n.start < m.end - m.nbytes / 100.0
               for m in waited for n in r.messages)


def test_a_receive_posted_before_its_send_exists_is_a_deadlock_not_a_hang() -> None:
    from pulse.errors import PlanError
    from pulse.schedule.ir import Action, Schedule

    spec, placement = unet(2, out_bytes=100, skip_bytes=0), sequential(2)
    good = gpipe(placement, 2)
    rows = dict(good.actions)
    rows[1] = (Action(1, 1, 1, "F"), Action(1, 1, 0, "F"), *rows[1][2:])  # dev1 takes mb1 first: fine
    simulate(spec, placement, Schedule("swap", 2, rows), uniform_costs(spec), cluster())
    rows[0] = (Action(0, 0, 0, "F"), Action(0, 0, 0, "B"), Action(0, 0, 1, "F"), Action(0, 0, 1, "B"))
    with pytest.raises(PlanError, match="deadlocks"):  # B0 of mb0 waits for dev1, which waits for mb1's F
        simulate(spec, placement, Schedule("bad", 2, rows), uniform_costs(spec), cluster())


def test_step_adds_buckets_clipping_optimizer_and_report() -> None:
    spec, placement = unet(4, params=1000), wave(2)  # V: chunks 0, 3 on dev 0; 1, 2 on dev 1
    costs = replace(uniform_costs(spec), optimizer=(0.25, 0.5, 0.5, 0.25))
    net = MeasuredCluster(cluster(), _Link(1e30, 0.0, 0.0), allreduce_per_byte=1e-3)
    schedule = zero_bubble_v(placement, 4)
    r = simulate(spec, placement, schedule, costs, net)
    terms = StepTerms(dp=2, grad_bytes=4)
    step = step_time(spec, placement, costs, net, r, terms)
    bucket = 0.5 + 1000 * 4 * 1e-3  # one layer of 1000 parameters per chunk, fp32 gradients
    for b in step.buckets:
        final = max(s.end for s in r.compute if s.chunk == b.chunk and s.kind == "W")
        assert b.start >= final - 1e-12 and b.end - b.start == pytest.approx(bucket)
    for d in (0, 1):  # a rank's buckets run one after another
        mine = sorted((b for b in step.buckets if b.device == d), key=lambda b: b.start)
        assert mine[1].start >= mine[0].end - 1e-12
    done = max(max(b.end for b in step.buckets), r.makespan)
    sync = (0.5 + NORM_BYTES * 1e-3) + (0.5 + REPORT_BYTES * 1e-3)
    opt = 1.0  # device 0 holds chunks 0 and 3 (0.25 + 0.25), device 1 chunks 1 and 2 (0.5 + 0.5): the slowest
    assert step.total == pytest.approx(done + sync + opt)
    assert StepTerms().dp == 1 and step_time(spec, placement, costs, net, r).buckets == ()


def test_deferred_buckets_start_when_the_ranks_list_and_sends_are_done() -> None:
    """A communicator without an asynchronous all-reduce (MindSpore's) sums each bucket in its
    all-reduce after the actions, once the rank's sends have landed: same order, later start."""
    spec, placement = unet(4, params=1000), wave(2)
    costs = uniform_costs(spec)
    schedule = zero_bubble_v(placement, 4)
    overlapped = MeasuredCluster(cluster(), _Link(1e30, 0.0, 0.0), allreduce_per_byte=1e-3)
    deferred = MeasuredCluster(replace(cluster(), deferred_buckets=True), _Link(1e30, 0.0, 0.0),
                               allreduce_per_byte=1e-3)
    terms = StepTerms(dp=2, grad_bytes=4)
    r = simulate(spec, placement, schedule, costs, deferred)
    early = step_time(spec, placement, costs, overlapped, r, terms)
    late = step_time(spec, placement, costs, deferred, r, terms)
    bucket = 0.5 + 1000 * 4 * 1e-3
    for d in (0, 1):
        mine = sorted((b for b in late.buckets if b.device == d), key=lambda b: b.start)
        done = max(r.rank_end[d], r.sends_done[d])
        assert mine[0].start == pytest.approx(done) and mine[1].start == pytest.approx(mine[0].end)
        assert [b.chunk for b in mine] == [b.chunk for b in sorted((b for b in early.buckets if b.device == d),
                                                                   key=lambda b: b.start)]
        assert mine[1].end == pytest.approx(done + 2 * bucket)
    assert late.total > early.total and late.total == pytest.approx(
        max(b.end for b in late.buckets) + late.sync + late.optimizer)


@dataclass(frozen=True)
class SharedHost(MeasuredCluster):
    shared_cores: int = 1


def test_ranks_sharing_cores_advance_at_cores_over_busy_ranks() -> None:
    # two stages on ONE core: while both compute, each runs at half speed
    spec, placement = unet(2, out_bytes=0, skip_bytes=0), sequential(2)
    costs = uniform_costs(spec)  # F 1 s, B 2 s
    free = simulate(spec, placement, gpipe(placement, 2), costs, MeasuredCluster(cluster(), _Link(1e30, 0, 0)))
    one = simulate(spec, placement, gpipe(placement, 2), costs, SharedHost(cluster(), _Link(1e30, 0, 0)))
    assert free.makespan == pytest.approx(3 * 1 + 3 * 2)  # (M + P - 1) forward and backward slots
    assert one.span("F", 0, 1).start == pytest.approx(1) and one.span("F", 0, 1).end == pytest.approx(3)
    assert one.span("F", 1, 0).start == pytest.approx(1) and one.span("F", 1, 0).end == pytest.approx(3)
    assert one.makespan >= 2 * 2 * (1 + 2) - 1e-9  # one core does all 12 s of work, one second per second


@dataclass(frozen=True)
class TwoCoreHost(MeasuredCluster):
    shared_cores: int = 2
    pinned_cores: bool = True


@pytest.mark.parametrize("pinned", [True, False])
def test_pinned_ranks_share_their_own_core_even_while_another_idles(pinned: bool) -> None:
    """4 ranks on 2 cores, pinned round-robin (ranks 0 and 2 on core 0, 1 and 3 on core 1), GPipe
    over 3 microbatches, F 1 s: at t = 2 ranks 0, 1 and 2 compute. Pinned, 0 and 2 split core 0
    (F ends at 4) while 1 has core 1 alone (ends at 3); unpinned, three ranks share two cores (3.5)."""
    spec, placement = unet(4, out_bytes=0, skip_bytes=0), sequential(4)
    host = TwoCoreHost(cluster(4), _Link(1e30, 0, 0), pinned_cores=pinned)
    r = simulate(spec, placement, gpipe(placement, 3), uniform_costs(spec), host)
    assert r.span("F", 0, 2).start == pytest.approx(2) and r.span("F", 2, 0).start == pytest.approx(2)
    assert r.span("F", 1, 1).end == pytest.approx(3 if pinned else 3.5)
    assert r.span("F", 0, 2).end == pytest.approx(4 if pinned else 3.5)
    assert r.span("F", 2, 0).end == pytest.approx(4 if pinned else 3.5)


@pytest.mark.parametrize("pinned", [True, False])
def test_data_parallel_replicas_share_the_hosts_cores_with_the_simulated_pipeline(pinned: bool) -> None:
    """Two stages, two replicas: four ranks on two cores (torchrun's numbering, rank = replica x P + stage).
    Pinned round-robin, both replicas' stage 0 share core 0 and both stage 1s core 1: every job of the
    simulated replica has its twin beside it on its core and runs at half speed, so the step doubles.
    Unpinned, the four share both cores: a stage computing alone (with its twin) keeps a core each, both
    stages at once (four ranks) run at half speed: GPipe's slots (F alone, F both, F alone, B alone, B both,
    B alone) take 1 + 2 + 1 + 2 + 4 + 2 = 12 s. Without the twins the pipeline had a core per stage: 9 s,
    as fast as one replica alone (benchmarks/validate_dp.py: tiny-unet pp 2 x dp 2 measured 359 ms against
    156 predicted)."""
    spec, placement = unet(2, out_bytes=0, skip_bytes=0), sequential(2)
    host = TwoCoreHost(cluster(4), _Link(1e30, 0, 0), pinned_cores=pinned)
    costs = uniform_costs(spec)  # F 1 s, B 2 s
    alone = simulate(spec, placement, gpipe(placement, 2), costs, host)
    shared = simulate(spec, placement, gpipe(placement, 2), costs, host, replicas=2)
    assert alone.makespan == pytest.approx(9)  # (M + P - 1) slots of F and of B
    assert shared.span("F", 0, 0).end == pytest.approx(2 if pinned else 1)
    assert shared.makespan == pytest.approx(18 if pinned else 12)
    # a core per rank: the replicas take nothing from each other
    roomy = TwoCoreHost(cluster(4), _Link(1e30, 0, 0), shared_cores=4, pinned_cores=pinned)
    assert simulate(spec, placement, gpipe(placement, 2), costs, roomy, replicas=2).makespan == pytest.approx(9)


def test_ranks_sharing_a_core_lose_what_switching_between_them_costs() -> None:
    """Two stages on one core that keeps 0.8 of itself while both run (``core_sharing``, measured by
    ``pulse profile``): F(0,1) and F(1,0) run together at 0.4 each, so 1 s of work takes 2.5 s."""
    spec, placement = unet(2, out_bytes=0, skip_bytes=0), sequential(2)
    base = cluster(2)
    lossy = replace(base, hardware=replace(base.hardware, shared_cores=1, core_sharing=0.8))
    r = simulate(spec, placement, gpipe(placement, 2), uniform_costs(spec), MeasuredCluster(lossy, _Link(1e30, 0, 0)))
    assert r.span("F", 0, 0).end == pytest.approx(1)  # alone: the whole core
    assert r.span("F", 0, 1).end == pytest.approx(3.5) and r.span("F", 1, 0).end == pytest.approx(3.5)


def test_core_groups_follow_the_runtime_pinning() -> None:
    from pulse.cores import core_groups, cores_of

    assert sorted(core_groups(4, 2)) == [(1, (0, 2)), (1, (1, 3))]
    assert sorted(core_groups(2, 4)) == [(2, (0,)), (2, (1,))]
    assert core_groups(4, 2, pinned=False) == [(2, (0, 1, 2, 3))]
    for ranks, cores in ((3, 2), (2, 2), (3, 8)):  # every rank in one group, on the cores the runtime gives it
        groups = core_groups(ranks, cores)
        assert sorted(r for _, rs in groups for r in rs) == list(range(ranks))
        for n, rs in groups:
            assert all(len(cores_of(r, ranks, list(range(cores)))) == n for r in rs)


def test_a_communicator_sending_a_message_per_tensor_pays_every_message() -> None:
    """MindSpore's communicator sends each tensor of a transfer on its own (Cluster.tensor_messages):
    a cut crossed by the main path and two skips costs three messages each way, PyTorch's one."""
    spec = unet(6)
    placement = from_cuts("sequential", [0, 3, 6], [0, 1], 2, "relay", "test")  # the cut: main, 0->5, 1->4
    assert Wire.of(spec, placement).tensors == (3,) and Wire.of(spec, placement).messages == (1,)
    assert Wire.of(spec, placement, tensor_messages=True).messages == (3,)
    link = LinkCost(1e30, 0.0, 0.25, 0.1)  # no wire time: the calls (receive 0.25 s, send 0.1 s)
    grouped = simulate(spec, placement, gpipe(placement, 1), uniform_costs(spec), MeasuredCluster(cluster(), link))
    each = simulate(spec, placement, gpipe(placement, 1), uniform_costs(spec),
                    MeasuredCluster(replace(cluster(), tensor_messages=True), link))
    assert grouped.comm_busy == pytest.approx((0.35, 0.35))  # a send (0.1) and a receive (0.25) per rank
    assert each.comm_busy == pytest.approx((3 * 0.35, 3 * 0.35))
    assert each.makespan == pytest.approx(grouped.makespan + 2 * 2 * 0.35)  # both hops are on the critical path


def test_a_transfer_over_the_message_capacity_takes_more_messages() -> None:
    from pulse.traffic import MAX_TENSORS_PER_MESSAGE, wire_messages

    assert [wire_messages(n) for n in (1, MAX_TENSORS_PER_MESSAGE, MAX_TENSORS_PER_MESSAGE + 1)] == [1, 1, 2]
