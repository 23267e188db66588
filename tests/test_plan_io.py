import pytest

from pulse.errors import PlanError, PulseError
from pulse.placement import from_cuts
from pulse.plan import Plan, load_plan, plan_from_dict
from pulse.schedule.ir import Action, Schedule
from pulse.spec import Layer, ModelSpec

SPEC = ModelSpec("m4", [Layer(f"l{i}", "x", 1, 1.0, 1, 1) for i in range(4)])


def make_plan():
    placement = from_cuts("v", [0, 1, 2, 3, 4], [0, 1, 1, 0], 2, "direct", "pulse")
    schedule = Schedule("toy", 1, {
        0: [Action(0, 0, 0, "F"), Action(0, 3, 0, "F"), Action(0, 3, 0, "B"), Action(0, 0, 0, "B")],
        1: [Action(1, 1, 0, "F"), Action(1, 2, 0, "F"), Action(1, 2, 0, "B"), Action(1, 1, 0, "B")],
    })
    return Plan("m4", "cpu-local", 2, 1, 1, 1, "pulse", placement, schedule, predicted={"makespan": 1.5})


def loader(name, options):
    assert name == "m4"
    return SPEC


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_plan_round_trip(tmp_path, suffix):
    plan = make_plan()
    path = tmp_path / f"plan.{suffix}"
    plan.save(path, SPEC)
    loaded, spec = load_plan(path, loader)
    assert loaded == plan and spec is SPEC
    assert loaded.predicted == {"makespan": 1.5}
    assert loaded.world_size == 2 and loaded.global_batch == 1


def test_plan_for_another_model_is_refused(tmp_path):
    path = tmp_path / "plan.yaml"
    make_plan().save(path, SPEC)
    other = ModelSpec("m4", [Layer(f"k{i}", "x", 1, 1.0, 1, 1) for i in range(4)])
    with pytest.raises(PlanError, match="expects layer 'l0'.*re-plan"):
        load_plan(path, lambda n, o: other)
    shorter = ModelSpec("m4", [Layer(f"l{i}", "x", 1, 1.0, 1, 1) for i in range(5)])
    with pytest.raises(PlanError, match="covers 4 layers but the model has 5"):
        load_plan(path, lambda n, o: shorter)


def test_malformed_plans_say_what_is_wrong(tmp_path):
    data = make_plan().to_dict(SPEC)
    data["pp"] = 0
    with pytest.raises(PulseError, match="'pp' must be positive"):
        plan_from_dict(data)
    data = make_plan().to_dict(SPEC)
    data["placement"]["chunks"][1]["start"] = 2
    with pytest.raises(PlanError, match="chunk 1 starts at layer 2, expected 1 \\(gap\\)"):
        plan_from_dict(data)  # a placement is checked on its own, before any model is at hand
    data = make_plan().to_dict(SPEC)
    data["turbo"] = True
    with pytest.raises(PulseError, match="unknown key 'turbo'"):
        plan_from_dict(data)
