"""The order in which each peer sends this rank its messages, read off the plan.

NCCL and HCCL match point-to-point messages by order, not by tag: the i-th message one rank
sends another is the i-th receive that other rank posted. A V's receiver often wants its
messages in another order than its peer sends them (the peer sends mb1's activation before
mb0's gradient, the receiver runs mb0's backward first). The plan holds every rank's list,
so a receiver knows its peers' send order before the step starts: it posts its receives in
that order (taking a message it does not need yet into its own buffer) and never needs a
header to learn what arrived::

    peer 1 sends:   SF(h, mb1)  SB(h, mb0)          rank 0 wants: RB(mb0) first
    rank 0 posts:   recv #0 (h, mb1)  recv #1 (h, mb0)   waits on #1; #0 is kept for its RF

A wire message is one ``traffic`` transfer's tensors, ``MAX_TENSORS_PER_MESSAGE`` at a time
(``pulse.traffic.wire_messages``), named by its first tensor's tag.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from pulse.errors import PlanError
from pulse.runtime.wiring import MessageTag, Wiring
from pulse.schedule.ir import Action, Schedule
from pulse.traffic import MAX_TENSORS_PER_MESSAGE


@dataclass(frozen=True)
class WireMessage:
    """One message on the wire: its tags (one per tensor) and the devices it joins."""

    src_device: int
    dst_device: int
    tags: tuple[MessageTag, ...]

    @property
    def key(self) -> int:
        return self.tags[0].as_int()


def encoder_tags(num_transfers: int, encoder: int, microbatch: int, feeds: Sequence[str] = ("",)) -> list[MessageTag]:
    """The tags of an encoder's output sent to a reader (``EncodeRunner``), one per model input it makes
    (``Encoder.feeds``): after every transfer's."""
    return [MessageTag("F", num_transfers + encoder, microbatch, slot, name) for slot, name in enumerate(feeds)]


def split_tags(tags: list[MessageTag]) -> list[tuple[MessageTag, ...]]:
    """A transfer's tags as its wire messages."""
    return [tuple(tags[i:i + MAX_TENSORS_PER_MESSAGE]) for i in range(0, len(tags), MAX_TENSORS_PER_MESSAGE)]


def sent_messages(wiring: Wiring, schedule: Schedule, device: int,
                  encoder_feeds: Sequence[Sequence[str]] = ()) -> list[WireMessage]:
    """Every message ``device`` sends in one step, in the order its list sends them. ``encoder_feeds``:
    per encoder, the inputs its output holds (``Encoder.feeds``; an encoder not listed sends one tensor)."""
    actions = schedule.actions.get(device, ())
    transfer_at = wiring.match_transfers(actions)
    out: list[WireMessage] = []
    for pos, a in enumerate(actions):
        for dst, tags in _sends_of(wiring, a, transfer_at.get(pos), encoder_feeds):
            out += [WireMessage(device, dst, part) for part in split_tags(tags)]
    return out


def _sends_of(wiring: Wiring, a: Action, transfer: int | None,
              encoder_feeds: Sequence[Sequence[str]]) -> list[tuple[int, list[MessageTag]]]:
    if a.kind == "SF":
        return [(wiring.transfers[transfer].dst_device, wiring.tags("F", transfer, a.microbatch))]
    if a.kind == "SB":
        return [(wiring.transfers[transfer].src_device, wiring.tags("B", transfer, a.microbatch))]
    if a.kind == "SE":  # a.peer: the reader chunk
        feeds = encoder_feeds[a.encoder] if a.encoder < len(encoder_feeds) else ("",)
        return [(wiring.device_of(a.peer), encoder_tags(len(wiring.transfers), a.encoder, a.microbatch, feeds))]
    return []


def inbound_order(wiring: Wiring, schedule: Schedule, device: int,
                  encoder_feeds: Sequence[Sequence[str]] = ()) -> dict[int, list[tuple[int, ...]]]:
    """Source device -> the messages it sends ``device`` in one step, in send order, each as its
    tensors' keys (a communicator that sends a message per tensor takes them one by one)."""
    order: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for src in sorted(schedule.actions):
        if src == device:
            continue
        for m in sent_messages(wiring, schedule, src, encoder_feeds):
            if m.dst_device == device:
                order[src].append(tuple(t.as_int() for t in m.tags))
    return dict(order)


class InboundCursor:
    """Which receives a rank posts, and in what order, when messages match by order.

    The communicator asks ``to_post(peer, key)`` before it posts or waits for message ``key``:
    the answer is every not yet posted message of ``peer`` up to and including it, in the peer's
    send order (empty when it is posted already, or was received this step). The order repeats
    every step: posting goes on from where the last step's stopped.
    """

    def __init__(self) -> None:
        self.order: dict[int, list[int]] = {}  # peer -> its messages' keys to this rank, in send order
        self._next: dict[int, int] = {}  # peer -> index of the next message to post
        self._taken: dict[int, set[int]] = {}  # peer -> keys received this step
        self.posted: set[tuple[int, int]] = set()  # (peer, key) posted and not yet received

    def expect(self, order: dict[int, list[int]]) -> None:
        """Each peer's messages to this rank in one step (by global rank), in the peer's send order."""
        self.order = {peer: list(keys) for peer, keys in order.items()}
        self._next = {peer: 0 for peer in order}
        self._taken = {peer: set() for peer in order}
        self.posted = set()

    def to_post(self, peer: int, key: int) -> list[int]:
        out = self.peek(peer, key)
        for k in out:
            self._next[peer] = self._next[peer] % len(self.order[peer]) + 1
            self.posted.add((peer, k))
        return out

    def peek(self, peer: int, key: int) -> list[int]:
        """What ``to_post`` would answer, without posting anything."""
        if (peer, key) in self.posted or key in self._taken.get(peer, ()):
            return []
        order = self.order.get(peer, [])
        if key not in order:
            raise PlanError(f"message {key} from rank {peer} is not in rank {peer}'s send order as the plan gives "
                            "it (the communicator was not told the plan's message order: expect_inbound)")
        out, i = [], self._next[peer]
        while True:
            out.append(order[i % len(order)])
            if out[-1] == key:
                return out
            i += 1

    def received(self, peer: int, key: int) -> None:
        self.posted.discard((peer, key))
        self._taken[peer].add(key)
        if len(self._taken[peer]) == len(self.order[peer]):  # the step's last: the order begins again
            self._taken[peer] = set()


# MessageTag.as_int() without its microbatch: the messages of one transfer, direction and slot,
# which carry tensors of the same shapes and dtypes every microbatch.
CLASS_SPAN = 1024 * 64 * 2


class OrderedMessages:
    """A rank's order-matched messages: the cursor over its peers' send orders, and which message
    classes a header has described already, per peer and per shapes key. A class's first message
    under a shapes key carries a header (shapes and dtypes), its later ones only their bytes: both
    sides count the same way.

    The shapes key is what a step's shapes depend on besides the plan: the step's aspect-ratio
    bucket (``pulse.train.bucket_sampler``; None without buckets), which every rank computes from
    the data order alone (``use_shapes``), so a receive is sized for its step without a message."""

    def __init__(self) -> None:
        self.cursor = InboundCursor()
        self.shapes: Hashable = None
        self._sent: dict[tuple[int, int, Hashable], Any] = {}
        self._received: dict[tuple[int, int, Hashable], Any] = {}

    def expect(self, order: dict[int, list[int]]) -> None:
        """A new plan's order (by peer, message keys in send order): what was learnt of the last goes."""
        self.__init__()
        self.cursor.expect(order)

    def use_shapes(self, key: Hashable) -> None:
        """The coming step's shapes key (its bucket): messages are described and sized under it."""
        self.shapes = key

    def needs_header(self, peer: int, key: int, layout: Any) -> bool:
        """Sending ``key`` to ``peer`` with ``layout``: True for its class's first message (per shapes)."""
        known = self._sent.setdefault((peer, key % CLASS_SPAN, self.shapes), layout)
        if known is layout:
            return True
        if known != layout:
            raise PlanError(f"message {key} to rank {peer} carries {layout}, but its earlier messages carried "
                            f"{known}: a message's shapes and dtypes must not change from one microbatch to the "
                            "next (nor within one bucket)")
        return False

    def known_layout(self, peer: int, key: int) -> Any:
        """The layout of ``peer``'s message ``key`` if a header of its class came already, else None."""
        return self._received.get((peer, key % CLASS_SPAN, self.shapes))

    def learn(self, peer: int, key: int, layout: Any) -> None:
        self._received[(peer, key % CLASS_SPAN, self.shapes)] = layout
