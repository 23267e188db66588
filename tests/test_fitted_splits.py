"""Finer layers only where a cut falls: split options that name blocks, ``pulse.partition.fitted_splits``
and the tuner's refit of each strategy's best (``pulse.tune.fitted``)."""
from __future__ import annotations

import pytest

from pulse.args.model_args import option_pairs, parse_options
from pulse.cli.common import load_model
from pulse.cli.main import main
from pulse.costs import AnalyticProfiler
from pulse.errors import SpecError
from pulse.hardware import load_cluster
from pulse.partition.fitted_splits import blocks_cut, fit_splits
from pulse.placement import Chunk, Placement
from pulse.plan import load_plan
from pulse.tune.evaluate import evaluate
from pulse.tune.fitted import refit
from pulse.tune.measured import MeasuredProfiler
from pulse.tune.space import Candidate
from pulse.tune.tuner import TuneRequest, default_budget
from pulse.zoo import get_spec
from pulse.zoo.unet_blocks import block_of

FINER = {"split_resnets": True, "split_transformers": True}


def _whole_names(spec) -> list[str]:
    """Each layer by the block it is (part of): the same list for any split of one model."""
    return list(dict.fromkeys(block_of(layer) or layer.name for layer in spec.layers))


def test_split_options_name_blocks_and_split_those_alone():
    whole = get_spec("sd2-unet")
    some = get_spec("sd2-unet", split_resnets="up1_res0,down2_res1", split_transformers=["mid_attn"])
    assert some.num_layers == whole.num_layers + 3
    assert some.total_params == whole.total_params and some.total_flops == whole.total_flops
    split = {layer.name for layer in some.layers} - {layer.name for layer in whole.layers}
    assert split == {"up1_res0_in", "up1_res0_out", "down2_res1_in", "down2_res1_out",
                     "mid_attn_self0", "mid_attn_cross0"}
    assert _whole_names(some) == [layer.name for layer in whole.layers]
    assert [(e.src, e.dst) for e in some.skips] == [
        (e.src.replace("down2_res1", "down2_res1_out"), e.dst.replace("up1_res0", "up1_res0_in"))
        for e in whole.skips]
    assert get_spec("sd2-unet", split_resnets=["up1_res0", "down2_res1"], split_transformers="mid_attn") == some


@pytest.mark.parametrize("options, message", [
    ({"split_resnets": "up9_res0"}, "has no block 'up9_res0'"),
    ({"split_transformers": ["up1_res0"]}, "split_transformers: the model has no block 'up1_res0'"),
    ({"split_resnets": 3}, "must be true, false or block names"),
    ({"split_resnets": []}, "must be true, false or block names"),
])
def test_a_split_option_naming_no_block_is_refused(options, message):
    with pytest.raises(SpecError, match=message):
        get_spec("sd2-unet", **options)


def test_a_bad_split_option_on_the_command_line_is_one_line_exit_2(capsys):
    assert main(["plan", "--model", "tiny-unet", "--pp", "2", "--model-option", "split_resnets=up1_res9"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no block 'up1_res9'" in err and "up1_res0" in err


def test_option_pairs_round_trip_a_plans_options():
    options = {"split_resnets": ["up1_res0", "up2_res1"], "split_transformers": False, "resolution": 256}
    pairs = option_pairs(options)
    assert pairs == ["split_resnets=up1_res0,up2_res1", "split_transformers=false", "resolution=256"]
    assert get_spec("sd2-unet", **parse_options(pairs)) == get_spec("sd2-unet", **options)


def _placement(spec, bounds: list[int], devices: list[int]) -> Placement:
    chunks = [Chunk(a, b, d) for a, b, d in zip(bounds, bounds[1:], devices)]
    return Placement("interleaved", max(devices) + 1, tuple(chunks), "direct", "sequential")


def test_fit_splits_keeps_the_cuts_and_splits_only_the_blocks_they_enter():
    finer = get_spec("sd2-unet", **FINER)
    names = [layer.name for layer in finer.layers]
    # cuts: inside up1_res0, at the start of down1_res0 (a block boundary), inside up3_attn0
    bounds = [0, names.index("down1_res0_in"), names.index("up1_res0_out"), names.index("up3_attn0_cross0"),
              finer.num_layers]
    placement = _placement(finer, bounds, [0, 1, 0, 1])
    assert blocks_cut(finer, placement) == {"split_resnets": ("up1_res0",), "split_transformers": ("up3_attn0",)}
    fitted = fit_splits(finer, placement, lambda split: get_spec("sd2-unet", **split))
    assert fitted.spec == get_spec("sd2-unet", split_resnets=["up1_res0"], split_transformers=["up3_attn0"])
    assert fitted.spec.num_layers == get_spec("sd2-unet").num_layers + 2
    assert [c.device for c in fitted.placement.chunks] == [0, 1, 0, 1]
    for old, new in zip(placement.chunks, fitted.placement.chunks):  # the same work in each chunk
        assert sum(l.params for l in finer.layers[old.start:old.end]) == \
            sum(l.params for l in fitted.spec.layers[new.start:new.end])
        assert sum(l.flops for l in finer.layers[old.start:old.end]) == \
            sum(l.flops for l in fitted.spec.layers[new.start:new.end])
        assert finer.layers[old.start].name == fitted.spec.layers[new.start].name or \
            block_of(finer.layers[old.start]) == fitted.spec.layers[new.start].name


def test_cuts_on_block_boundaries_fit_the_model_unsplit():
    finer = get_spec("sd2-unet", **FINER)
    names = [layer.name for layer in finer.layers]
    placement = _placement(finer, [0, names.index("mid_res0_in"), finer.num_layers], [0, 1])
    fitted = fit_splits(finer, placement, lambda split: get_spec("sd2-unet", **split))
    assert fitted.options == {"split_resnets": False, "split_transformers": False}
    assert fitted.spec == get_spec("sd2-unet")
    assert fitted.spec.layers[fitted.placement.chunks[1].start].name == "mid_res0"


@pytest.fixture(scope="module")
def sd2_small_batch():
    """SD v2 on finer layers on one 910A node at batch 32: the interleaved shape the headline's PULSE picks."""
    spec, cluster = get_spec("sd2-unet", **FINER), load_cluster("ascend-910a-1x8")
    request = TuneRequest(spec, cluster, 32, default_budget(cluster))
    cand = Candidate("pulse", 8, 1, 2, 16, 0, "sequential", "zero_bubble_v", virtual=2, skip_transport="direct")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 2)
    return request, cand, evaluate(spec, costs, cluster, cand, request.memory_budget)


def test_refit_prices_the_best_again_with_fewer_layers_and_keeps_it_when_faster(sd2_small_batch):
    request, cand, finer_eval = sd2_small_batch
    again = refit(finer_eval, request, AnalyticProfiler(request.cluster.hardware),
                  lambda split: get_spec("sd2-unet", **split))
    assert again.fitted is not None and again.fitted.spec.num_layers < request.spec.num_layers
    # each block left whole saves a launch per pass: faster, never slower
    assert again.iteration_time < finer_eval.iteration_time
    assert again.candidate == cand and len(again.placement.chunks) == len(finer_eval.placement.chunks)
    # an independent pricing of the fitted model with the mapped cuts gives the same step
    spec = get_spec("sd2-unet", **again.fitted.options)
    costs = AnalyticProfiler(request.cluster.hardware).profile(spec, 2)
    direct = evaluate(spec, costs, request.cluster, cand, request.memory_budget, placement=again.placement)
    assert direct.iteration_time == pytest.approx(again.iteration_time, rel=1e-12)


def test_refit_leaves_a_measured_table_alone(sd2_small_batch):
    """A measured table prices the layers it was measured on: nothing to fit the model to."""
    request, _, finer_eval = sd2_small_batch
    table = AnalyticProfiler(request.cluster.hardware).profile(request.spec, 2)
    assert refit(finer_eval, request, MeasuredProfiler(table), lambda s: get_spec("sd2-unet", **s)) is finer_eval


def test_tune_writes_the_winner_on_its_fitted_layers(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    args = ["tune", "--model", "sd2-unet", "--model-option", "split_resnets=true", "--model-option",
            "split_transformers=true", "--cluster", "ascend-910a-1x8", "--global-batch", "32", "--max-pp", "8",
            "--microbatch-sizes", "2", "--folds", "1", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "finer layers kept only where the winner's cuts fall" in text
    assert "priced on finer layers only where their cuts fall (layers): pulse " in text
    plan, spec = load_plan(out, load_model)
    finer = get_spec("sd2-unet", **FINER)
    assert spec.num_layers < finer.num_layers and plan.placement.num_layers == spec.num_layers
    assert any(plan.model_options[o] for o in ("split_resnets", "split_transformers"))
    # the plan trains what the tuner priced: its cuts fall inside exactly the blocks it keeps split
    assert {o: tuple(v) if v else False for o, v in plan.model_options.items()} == \
        blocks_cut(spec, plan.placement)


def test_tune_json_names_the_fitted_layers_the_plan_holds(tmp_path, capsys):
    import json

    out = tmp_path / "plan.yaml"
    args = ["tune", "--model", "sd2-unet", "--model-option", "split_resnets=true", "--model-option",
            "split_transformers=true", "--cluster", "ascend-910a-1x8", "--global-batch", "32", "--max-pp", "8",
            "--microbatch-sizes", "2", "--folds", "1", "--format", "json", "--out", str(out)]
    assert main(args) == 0
    winner = json.loads(capsys.readouterr().out)["winner"]
    plan, spec = load_plan(out, load_model)
    assert winner["fitted_layers"] == {"num_layers": spec.num_layers, **plan.model_options}
    assert "fitted_layers" not in plan.predicted


def test_plan_names_the_split_blocks_its_cuts_use(tmp_path, capsys):
    """`pulse plan` with every block split says which few its cuts enter, as the flags that keep only those."""
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "sd2-unet", "--model-option", "split_resnets=true", "--pp", "2",
                 "--out", str(out)]) == 0
    [note] = [line for line in capsys.readouterr().out.splitlines() if "split blocks" in line]
    plan, spec = load_plan(out, load_model)
    cut = blocks_cut(spec, plan.placement)["split_resnets"]
    assert f"inside {len(cut)} of the 22 split blocks" in note
    assert f"--model-option split_resnets={','.join(cut) if cut else 'false'} " in note
    assert main(["plan", "--model", "sd2-unet", "--model-option", f"split_resnets={','.join(cut) or 'false'}",
                 "--pp", "2"]) == 0
    assert "split blocks" not in capsys.readouterr().out  # named blocks: nothing more to say
