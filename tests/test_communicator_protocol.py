"""Every communicator implements the whole ``Communicator`` protocol, and the executor asks it
directly: no getattr/hasattr on its comm, no call to a method the protocol does not list."""
from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pulse.runtime.protocols import Communicator
from pulse.train.loop import StepCommunicator

ROOT = Path(__file__).resolve().parent.parent

# Every class in the repository that sends and receives as a communicator: module, class, what it
# needs ("torch", "mindspore") and whether the training loop runs it (then StepCommunicator too).
COMMUNICATORS = {
    "FakeCommunicator": ("pulse.testing.fake_comm", None, False),
    "RendezvousCommunicator": ("pulse.testing.fake_rendezvous", None, False),
    "TorchCommunicator": ("pulse_torch.comm", "torch", True),
    "ThrottledCommunicator": ("pulse_torch.emulation.throttle", "torch", False),
    "MindSporeCommunicator": ("pulse_mindspore.comm", "mindspore", True),
    "Recording": ("mindspore_worker_check", None, False),
    "ThreadComm": ("test_runtime_threads", None, False),
    "CommunicatorWrapper": ("pulse.runtime.protocols", None, False),
}
# Classes with send and recv that are not handed to an executor, and why.
NOT_COMMUNICATORS = {
    "Communicator": "the protocol itself",
    "RendezvousStreams": "the fake network's streams under RendezvousCommunicator",
    "Member": "a profiling test's rank: only the calls pulse.profiling makes",
}


def members(protocol: type) -> set[str]:
    """The names a protocol lists (methods and annotated attributes), its bases' included."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass.__module__ in ("typing", "builtins"):
            continue
        names |= {n for n in vars(klass) if not n.startswith("_")}
        names |= {n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_")}
    return names


def instance_attributes(cls: type) -> set[str]:
    """Names a class (or a base) assigns as ``self.name = ...`` in its methods."""
    names: set[str] = set()
    for klass in cls.__mro__[:-1]:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                        names.add(leaf.attr)
    return names


def load(name: str) -> type:
    module, needs, _ = COMMUNICATORS[name]
    if needs:
        pytest.importorskip(needs)
    return getattr(importlib.import_module(module), name)


def _classes_that_send_and_receive() -> set[str]:
    found = set()
    for folder in ("pulse", "backends", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                    if {"send", "recv"} <= methods:
                        found.add(node.name)
    return found


def test_every_class_that_sends_and_receives_is_checked_here():
    unknown = _classes_that_send_and_receive() - set(COMMUNICATORS) - set(NOT_COMMUNICATORS)
    assert not unknown, f"add {sorted(unknown)} to COMMUNICATORS (or NOT_COMMUNICATORS, saying why)"


@pytest.mark.parametrize("name", sorted(COMMUNICATORS))
def test_communicator_implements_every_member_of_the_protocol(name: str):
    cls = load(name)
    wanted = members(StepCommunicator if COMMUNICATORS[name][2] else Communicator)
    have = {n for n in wanted if hasattr(cls, n)} | instance_attributes(cls)
    assert wanted - have == set(), f"{name} lacks {sorted(wanted - have)}"


def test_the_protocol_lists_what_the_executor_relies_on():
    assert {"send_group", "recv_group", "post_recv", "expect_inbound", "recv_lookahead", "rank",
            "all_reduce_async"} <= members(Communicator)
    assert {"wait_sends", "sum_values"} <= members(StepCommunicator) - members(Communicator)


def _comm_uses(path: Path, names: tuple[str, ...]) -> tuple[set[str], list[str]]:
    """(attributes read off ``names`` / ``self.<name>``, getattr/hasattr calls on them) in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))

    def is_comm(node: Any) -> bool:
        return (isinstance(node, ast.Name) and node.id in names) or \
            (isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)
             and node.value.id == "self")

    attrs, probes = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_comm(node.value):
            attrs.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and node.args and is_comm(node.args[0]):
            probes.append(f"{path.name}:{node.lineno}")
    return attrs, probes


def test_the_executor_calls_its_communicator_directly():
    runtime = ROOT / "pulse" / "runtime"
    listed = members(Communicator)
    for path in (runtime / "executor.py", runtime / "grad_sync.py"):
        attrs, probes = _comm_uses(path, ("comm",))
        assert probes == [], f"getattr/hasattr on the communicator: {probes}"
        assert attrs <= listed, f"{path.name} calls {sorted(attrs - listed)}, which Communicator does not list"


def test_the_training_loop_calls_only_what_step_communicator_lists():
    attrs, probes = _comm_uses(ROOT / "pulse" / "train" / "loop.py", ("comm",))
    assert probes == [] and attrs <= members(StepCommunicator), sorted(attrs - members(StepCommunicator))
