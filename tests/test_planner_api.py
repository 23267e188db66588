"""The planner as a library (``pulse.planner``): the plan `pulse train` writes, made from Python without
argparse; the backends' traits as data (``pulse.backend_traits``); one meaning for ``--precision``."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from untimed_ilp import untimed_ilp

import pulse_mindspore.traits as mindspore_traits
import pulse_torch.traits as torch_traits
from pulse.backend_traits import BackendTraits, load_traits
from pulse.cli.common import PRECISION_HELP
from pulse.cli.main import build_parser, main
from pulse.costs import AnalyticProfiler
from pulse.errors import PulseError
from pulse.hardware import load_cluster
from pulse.plan import Plan, load_plan
from pulse.planner import PlanRequest, make_plan, price_plan
from pulse.train.run_config import RunConfig
from pulse.zoo.loading import load_model

FRAMEWORKS = {"torch", "torch_npu", "mindspore"}
TRAITS_FILES = (Path(torch_traits.__file__), Path(mindspore_traits.__file__))


def tiny_unet(microbatch_size: int = 2, act_bytes: int = 4):
    """What `pulse train --model tiny-unet` loads by default: fp32 activations, cpu-local, analytic costs."""
    spec = load_model("tiny-unet", {}).with_act_bytes(act_bytes)
    cluster = load_cluster("cpu-local")
    return spec, AnalyticProfiler(cluster.hardware).profile(spec, microbatch_size), cluster


def cli_plan(tmp_path: Path, *flags: str) -> str:
    out = tmp_path / "cli"
    assert main(["train", "--model", "tiny-unet", "--plan-only", "--out-dir", str(out), *flags]) == 0
    return (out / "plan.yaml").read_text()


def saved(plan: Plan, spec, path: Path) -> str:
    plan.save(path, spec)
    return path.read_text()


@pytest.mark.parametrize("flags, request_fields", [
    (("--pp", "2", "--schedule", "greedy_v_1f1b"), dict(pp=2, schedule="greedy_v_1f1b")),
    (("--pp", "2", "--schedule", "zero_bubble_v", "--num-microbatches", "6", "--recompute", "0,3", "--dp", "2"),
     dict(pp=2, schedule="zero_bubble_v", num_microbatches=6, recompute="0,3", dp=2)),
    (("--pp", "2", "--partitioner", "sequential", "--schedule", "gpipe", "--emulate-bandwidth", "1e8"),
     dict(pp=2, partitioner="sequential", schedule="gpipe", emulate_bandwidth=1e8)),
])
def test_make_plan_from_python_is_the_plan_pulse_train_writes(tmp_path: Path, capsys, flags, request_fields) -> None:
    text = cli_plan(tmp_path, *flags)
    spec, costs, cluster = tiny_unet()
    # what its ranks hold as PyTorch trains fp32 at this dp (`pulse train` prices a run so)
    memory = BackendTraits().memory(dp=request_fields.get("dp", 1), cpu_host=True)
    request = PlanRequest(model="tiny-unet", cluster="cpu-local", microbatch_size=2, memory=memory, **request_fields)
    plan = make_plan(spec, costs, cluster, request)
    assert saved(plan, spec, tmp_path / "py.yaml") == text
    assert "step_seconds" in plan.predicted and plan.predicted["cost_source"] == costs.source


def test_the_auto_schedule_from_python_is_the_cli_one(tmp_path: Path, capsys, monkeypatch) -> None:
    """Two ILP solves compared: untimed (``untimed_ilp``), each ends at a proof, never at the clock."""
    untimed_ilp(monkeypatch)
    text = cli_plan(tmp_path, "--pp", "2", "--time-limit", "20")
    spec, costs, cluster = tiny_unet()
    heard: list[str] = []
    request = PlanRequest("tiny-unet", "cpu-local", pp=2, microbatch_size=2, time_limit=20.0,
                          memory=BackendTraits().memory(cpu_host=True))  # held as `pulse train` prices it
    plan = make_plan(spec, costs, cluster, request, progress=heard.append)
    assert saved(plan, spec, tmp_path / "py.yaml") == text
    assert heard and "  ilp: " in capsys.readouterr().out  # the CLI prints what Python hears
    solves = [line for line in heard if "microbatches" in line]
    assert solves and all("optimal" in line for line in solves), heard


def test_mindspore_traits_plan_every_chunk_recomputing_with_its_backward_in_b(tmp_path: Path) -> None:
    spec, costs, cluster = tiny_unet()
    traits = mindspore_traits.traits(ascend=False)
    notes: list[str] = []
    request = PlanRequest("tiny-unet", "cpu-local", pp=2, microbatch_size=2, schedule="zero_bubble_v",
                          recompute="0", traits=traits)
    plan = make_plan(spec, costs, cluster, request, note=notes.append)
    assert plan.recompute == tuple(range(len(plan.placement.chunks)))
    assert notes == ["the MindSpore backend recomputes every chunk's forward in its backward; the plan is "
                     "priced and written with recompute on all chunks"]
    # priced as PyTorch traits would price the converted table and cluster with every chunk recomputing
    ms_costs, ms_cluster = traits.runs(costs, cluster)
    assert ms_costs.whole_backward_in_b and ms_costs.bwd_input == costs.bwd and set(ms_costs.bwd_weight) == {0.0}
    assert ms_cluster.deferred_buckets and ms_cluster.tensor_messages
    same = make_plan(spec, ms_costs, ms_cluster, PlanRequest("tiny-unet", "cpu-local", pp=2, microbatch_size=2,
                                                             schedule="zero_bubble_v", recompute="all"))
    assert same == plan and same.predicted == plan.predicted
    torch_plan = make_plan(spec, costs, cluster, PlanRequest("tiny-unet", "cpu-local", pp=2, microbatch_size=2,
                                                             schedule="zero_bubble_v", recompute="all"))
    assert torch_plan.predicted["step_seconds"] != plan.predicted["step_seconds"]  # B does the whole backward
    # a given plan is priced the same way (`pulse train --plan FILE`)
    assert price_plan(spec, costs, cluster, replace_recompute(plan, ()), traits).predicted == plan.predicted


def replace_recompute(plan: Plan, chunks: tuple[int, ...]) -> Plan:
    from dataclasses import replace

    return replace(plan, recompute=chunks, predicted={})


def test_pulse_train_backend_mindspore_writes_the_python_plan(tmp_path: Path, capsys) -> None:
    pytest.importorskip("mindspore")
    if not (Path(sys.executable).parent / "msrun").exists():
        pytest.skip("no msrun next to this interpreter")
    text = cli_plan(tmp_path, "--backend", "mindspore", "--pp", "2", "--dp", "2", "--schedule", "zero_bubble_v")
    assert "pulse train: note: the MindSpore backend recomputes every chunk" in capsys.readouterr().err
    spec, costs, cluster = tiny_unet()
    traits = load_traits("mindspore")
    request = PlanRequest("tiny-unet", "cpu-local", pp=2, dp=2, microbatch_size=2, schedule="zero_bubble_v",
                          traits=traits, memory=traits.memory(dp=2, cpu_host=True))
    assert saved(make_plan(spec, costs, cluster, request), spec, tmp_path / "py.yaml") == text


def test_a_bad_request_is_one_line() -> None:
    with pytest.raises(PulseError, match=r"^--num-microbatches must be >= 1, got -1$"):
        PlanRequest("tiny-unet", "cpu-local", pp=2, num_microbatches=-1)
    with pytest.raises(PulseError, match=r"^--dp must be >= 1, got 0$"):
        PlanRequest("tiny-unet", "cpu-local", pp=2, dp=0)
    assert PlanRequest("tiny-unet", "cpu-local", pp=3).microbatches == 6


def test_unsupported_settings_are_data_and_refused_in_one_line() -> None:
    traits = mindspore_traits.traits(ascend=False)
    assert {u.setting for u in traits.unsupported} >= {"images", "lora_rank", "deterministic"}
    with pytest.raises(PulseError, match=r"^--deterministic is not supported with --backend mindspore \(it sets "
                                         r"PyTorch's deterministic kernels; .*\); use --backend torch for it$"):
        mindspore_traits.check_options(RunConfig(deterministic=True))
    torch_traits.check_options(RunConfig(deterministic=True))
    # PyTorch declares the defaults but for the words its allocators fail with
    assert load_traits("torch") == torch_traits.TRAITS == BackendTraits(out_of_memory_markers=torch_traits.OUT_OF_MEMORY)
    assert torch_traits.TRAITS.communicator() == {}  # the cluster file's word stands


@pytest.mark.parametrize("path", TRAITS_FILES, ids=lambda p: p.parent.name)
def test_the_traits_modules_import_no_framework(path: Path) -> None:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    roots = {m.split(".")[0] for m in modules}
    assert not roots & FRAMEWORKS
    assert not any(m == "pulse.cli" or m.startswith("pulse.cli.") for m in modules)
    name = f"{path.parent.name}.traits"
    code = (f"import sys, {name}\n{name}.traits()\n"
            f"print(sorted(set(m.split('.')[0] for m in sys.modules) & set({sorted(FRAMEWORKS)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_precision_has_one_meaning_and_each_commands_default() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    defaults = {}
    for name in ("plan", "simulate", "tune", "train", "profile"):
        (action,) = [a for a in sub.choices[name]._actions if a.dest == "precision"]
        assert action.help.startswith(PRECISION_HELP), name
        defaults[name] = action.default
    assert defaults == {"plan": "fp16", "simulate": "fp16", "tune": "fp16", "train": "fp32", "profile": "fp32"}


def test_the_readme_planning_example_runs(tmp_path: Path, monkeypatch) -> None:
    """The README's "Planning from Python" block, run as written (in a scratch folder)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Planning from Python", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["plan"].placement.kind in ("v", "wave")
    assert namespace["plan"].predicted["step_seconds"] > 0
    assert load_plan(tmp_path / "plan.yaml")[0].placement == namespace["plan"].placement
