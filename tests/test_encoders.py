"""Frozen encoders in the plan: E actions placed before the pipeline or in its bubbles, validated,
lowered with their messages, priced by the simulator, chosen by the tuner, saved in plans.

The hand-computed case: two one-layer chunks on two devices (F = 1 s, B = 2 s, an
ideal network), GPipe over 2 microbatches, one encoder of 3 s::

    cached   dev0 F0 F1 .  .  .  B0 B0 B1 B1          makespan 9
             dev1 .  F0 F1 B0 B0 B1 B1
    before   dev0 E0 E0 E0 E1 E1 E1 + the cached run  makespan 9 + 2 x 3 = 15
    bubbles  dev0 F0 F1 E2 E2 E2 B0 B0 B1 B1          prefetches (E of M + m: the next step's m) fill
             dev1 .  F0 F1 B0 B0 B1 B1 E3 E3 E3        dev 0's wait for the backward, and overrun dev 1's
                                                      drain by 1 s: 10 (this step's gaps only: 12)
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_schedule_helpers import cluster, sequential, unet, uniform_costs

from pulse.costs import CostTable, with_encoder_costs
from pulse.encoders import Encoder, EncoderSet, reader_chunks
from pulse.errors import PlanError, PulseError
from pulse.plan import Plan, plan_from_dict
from pulse.schedule.encode import EncodeContext, add_encodes
from pulse.schedule.generators import gpipe, make_schedule
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.lower import lower
from pulse.schedule.validate import validate
from pulse.synth.encodes import place_encodes_with_ilp
from pulse.sim.engine import simulate
from pulse.traffic import encode_bytes
from pulse.tune.tuner import TuneRequest, tune
from pulse.views.trace import trace_events

ENCODER = Encoder("vae", params=1000, flops=1.0, out_bytes=16, feeds="latent")


def _setup():
    spec = unet(2)
    placement = sequential(2)
    costs = replace(uniform_costs(spec), encoder_fwd=(("vae", 3.0),))
    return spec, placement, costs, cluster(2)


def _placed(mode: str):
    spec, placement, costs, net = _setup()
    encoders = EncoderSet((ENCODER,), mode)
    schedule = add_encodes(gpipe(placement, 2), EncodeContext(spec, placement, costs, net, encoders))
    return schedule, simulate(spec, placement, schedule, costs, net, encoders=encoders if mode != "cached" else None)


def test_before_adds_the_encoders_serial_time_on_the_first_device():
    cached, cached_run = _placed("cached")
    before, before_run = _placed("before")
    assert not cached.has_encodes and cached_run.makespan == pytest.approx(9.0)
    assert [a.text for a in before.actions[0][:2]] == ["0E0", "0E1"]
    assert before_run.makespan == pytest.approx(9.0 + 2 * 3.0)


def test_bubbles_prefetches_into_the_gaps_of_the_step_before():
    """GPipe, 2 devices, 2 microbatches, F 1 s, B 2 s, encode 3 s: device 0 idles 2..5 waiting for the
    backward, device 1 0..1 and 7..9. mb 0's encode cannot run in its own step (nothing precedes
    F(0,0)); mb 1's would overrun device 1's fill gap by 2 s. As prefetches (E of M + m, for the
    next step) one fills device 0's 3 s gap exactly, the other overruns device 1's drain by 1 s."""
    schedule, run = _placed("bubbles")
    assert [a.text for a in schedule.actions[0]] == ["0F0", "0F1", "0E2", "0B0", "0B1"]
    assert [a.text for a in schedule.actions[1]][-1] == "0E3"
    assert run.span("E", 0, 2).start == pytest.approx(2.0) and run.span("E", 0, 3).end == pytest.approx(10.0)
    assert run.makespan == pytest.approx(10.0)  # cached 9, before 15, this step's bubbles only 12
    assert run.makespan <= _placed("before")[1].makespan


def test_memory_counts_encoder_weights_where_encodes_run():
    _, before = _placed("before")
    _, bubbles = _placed("bubbles")
    _, cached = _placed("cached")
    assert [m.encoder_weights for m in before.memory] == [2000, 0]
    assert [m.encoder_weights for m in bubbles.memory] == [2000, 2000]
    assert before.peak_memory[0] >= cached.peak_memory[0] + 2000


def test_lowering_sends_the_output_and_traffic_counts_its_bytes():
    spec, placement, _, _ = _setup()
    schedule, run = _placed("bubbles")
    program = lower(schedule, spec, placement, EncoderSet((ENCODER,), "bubbles"))
    dev0, dev1 = [[a.text for a in program.actions[d]] for d in (0, 1)]
    assert dev1[-2:] == ["0E3", "0SE3:0"]
    assert dev0[-1] == "0RE3:0"  # a prefetch: the next step reads it, the row's end receives it
    assert encode_bytes(spec, placement, EncoderSet((ENCODER,)), {(0, 0): 0, (0, 1): 1}) == 16
    encode_msgs = [m for m in run.messages if m.direction == "E"]
    assert [(m.src_device, m.dst_device, m.nbytes) for m in encode_msgs] == [(1, 0, 16)]
    assert run.link_bytes[(1, 0)] == 2 * 100 + 16  # two gradients back, one encoder output
    with pytest.raises(PlanError, match="no encoders"):
        lower(schedule, spec, placement)


def test_validate_refuses_an_encode_after_its_first_forward():
    placement = sequential(2)
    rows = {d: list(r) for d, r in gpipe(placement, 2).actions.items()}
    rows[0].insert(0, Action(0, None, 0, "E", encoder=0))
    rows[0].insert(2, Action(0, None, 1, "E", encoder=0))  # after 0F0 but before 0F1: fine
    validate(Schedule("ok", 2, rows), placement, 2)
    late = {d: list(r) for d, r in gpipe(placement, 2).actions.items()}
    encode = [Action(0, None, m, "E", encoder=0) for m in (0, 1)]
    late[0] = [encode[0], late[0][0], late[0][1], encode[1]] + late[0][2:]
    with pytest.raises(PlanError, match="0E1 comes after 0F1"):
        validate(Schedule("late", 2, late), placement, 2)
    missing = {d: list(r) for d, r in gpipe(placement, 2).actions.items()}
    missing[0].insert(0, Action(0, None, 0, "E", encoder=0))
    with pytest.raises(PlanError, match="lacks 0E1"):
        validate(Schedule("missing", 2, missing), placement, 2)


def test_action_text_round_trips():
    for text in ("1E3", "1SE3:4", "4RE3:1"):
        assert Action.parse(text, 0).text == text
    assert Action.parse("1E3", 0).is_encode and not Action.parse("1E3", 0).is_compute


def test_encode_actions_name_their_encoder_never_as_a_chunk():
    """``chunk`` counts chunks only, ``peer`` the other chunk only, ``encoder`` encoders only."""
    fields = lambda a: (a.chunk, a.peer, a.encoder)  # noqa: E731
    assert fields(Action.parse("1E3", 0)) == (None, None, 1)
    assert fields(Action.parse("1SE3:4", 0)) == (None, 4, 1)
    assert fields(Action.parse("4RE3:1", 0)) == (4, None, 1)
    assert fields(Action.parse("3SF0:4", 0)) == (3, 4, None)
    assert Action.parse("1E3", 0).task == ("E", 1, 3) and Action.of_task(0, ("E", 1, 3)) == Action.parse("1E3", 0)
    assert sorted(Action.parse(t, 0) for t in ("1F0", "0E1", "1E0", "0RE0:1")) == \
        [Action.parse(t, 0) for t in ("0RE0:1", "0E1", "1E0", "1F0")]  # the text's numbers, as before
    for bad in ("4RE3", "1E3:4", "1SE3"):
        with pytest.raises(PlanError):
            Action.parse(bad, 0)
    with pytest.raises(PlanError, match="E and SE run an encoder"):
        Action(0, 1, 3, "E", encoder=1)


def test_plan_round_trip_and_old_plans_unchanged():
    schedule, _ = _placed("bubbles")
    placement = sequential(2)
    encoders = EncoderSet((ENCODER,), "bubbles")
    plan = Plan("m", "c", 2, 1, 1, 2, "test", placement, schedule, encoders=encoders)
    loaded = plan_from_dict(plan.to_dict())
    assert loaded.encoders == encoders and loaded.schedule.to_dict() == schedule.to_dict()
    old = Plan("m", "c", 2, 1, 1, 2, "test", placement, gpipe(placement, 2))
    assert "encoders" not in old.to_dict() and plan_from_dict(old.to_dict()).encoders is None
    with pytest.raises(PlanError, match="encoders are missing"):
        plan_from_dict({k: v for k, v in plan.to_dict().items() if k != "encoders"})


def test_cost_table_carries_encoder_times():
    spec, _, costs, net = _setup()
    again = CostTable.from_dict(costs.to_dict())
    assert again.encoder_seconds("vae") == 3.0
    assert "encoder_fwd" not in uniform_costs(spec).to_dict()
    kept = with_encoder_costs(costs, EncoderSet((ENCODER, replace(ENCODER, name="text"))), net.hardware)
    assert kept.encoder_seconds("vae") == 3.0 and kept.encoder_seconds("text") > 0  # measured kept, rest analytic
    with pytest.raises(PulseError, match="no time for encoder"):
        uniform_costs(spec).encoder_seconds("vae")


def test_trace_names_encodes():
    schedule, run = _placed("bubbles")
    names = {e.get("name") for e in trace_events(run)}
    assert {"encode vae mb0 (next step)", "encode vae mb1 (next step)"} <= names
    assert "encode vae mb0" in {e.get("name") for e in trace_events(_placed("before")[1])}
    # the runtime runs them (tests/test_encode_runtime.py), and refuses a rank that cannot encode


def test_tuner_picks_bubbles_when_faster():
    # heavy parameters on a slow network: data parallelism loses, a two-device pipeline wins
    spec, net = unet(2, params=10**6), cluster(2, bandwidth=1e4)

    class Fixed:
        def profile(self, spec, mbs):
            return replace(uniform_costs(spec, mbs=mbs), encoder_fwd=(("vae", 3.0),))

    request = TuneRequest(spec, net, global_batch=2, memory_budget=10**9, microbatch_sizes=(1,), folds=(1,),
                          encoders=EncoderSet((ENCODER,)), encoder_modes=("before", "bubbles"))
    result = tune(request, profiler=Fixed())
    assert set(result.best_by_encoders) == {"before", "bubbles"}
    assert result.winner.candidate.encoders == "bubbles"
    assert result.best_by_encoders["bubbles"].iteration_time < result.best_by_encoders["before"].iteration_time
    assert result.winner.encoders.mode == "bubbles" and result.winner.schedule.has_encodes


def test_encoder_outputs_are_priced_at_the_precision_the_ranks_send():
    """fp32 training sends the VAE latent as float32: the traffic and the simulator's output hold
    must count 4 bytes per element, not the fp16 figure the encoder is stated at."""
    import numpy as np
    from pulse.zoo import get_spec
    from pulse.zoo.encoders import zoo_encoders

    sd2 = get_spec("sd2-unet")
    vae = zoo_encoders(sd2).encoders[1]
    fp32 = sd2.with_act_bytes(4)
    assert vae.out_bytes_at(fp32.act_bytes) == np.zeros((4, 64, 64), np.float32).nbytes
    spec, placement, _, _ = _setup()
    assert encode_bytes(spec.with_act_bytes(4), placement, EncoderSet((ENCODER,)), {(0, 0): 0, (0, 1): 1}) == \
        2 * encode_bytes(spec, placement, EncoderSet((ENCODER,)), {(0, 0): 0, (0, 1): 1})


def test_zoo_encoders_match_the_published_models():
    from pulse.zoo import get_spec
    from pulse.zoo.encoders import zoo_encoders

    sd2 = get_spec("sd2-unet")
    text, vae = zoo_encoders(sd2).encoders
    assert vae.params == 34_163_664  # diffusers AutoencoderKL encoder + quant_conv of SD 2
    assert round(text.params / 1e6) == 340  # SD 2's 23-block CLIPTextModel (OpenCLIP ViT-H/14 text, 354M, 24 blocks)
    assert text.out_bytes == next(s.bytes for s in sd2.shared_inputs if s.name == "context")
    assert vae.out_bytes == 4 * 64 * 64 * 2
    dit = get_spec("hunyuan-dit")
    assert [e.name for e in zoo_encoders(dit).encoders] == ["clip", "mt5", "vae"]
    assert zoo_encoders(get_spec("tiny-unet")) is None
    from pulse.partition.symmetric import plan_symmetric

    placement = plan_symmetric(sd2, uniform_costs(sd2), 4, folds=1, strict=False).placement
    assert reader_chunks(sd2, placement, vae) == (0,)
    assert len(reader_chunks(sd2, placement, text)) == 4  # every device has cross-attention: one copy each


def test_encoders_outnumbering_the_chunks_are_priced():
    """An encoder's number is not a chunk's: three encoders over a two-chunk pipeline (a memory-sweep
    crash the tuner met at pp 1 with CLIP + mT5 + VAE)."""
    spec, placement, costs, net = _setup()
    three = tuple(replace(ENCODER, name=f"e{i}") for i in range(3))
    costs = replace(costs, encoder_fwd=tuple((e.name, 1.0) for e in three))
    encoders = EncoderSet(three, "before")
    schedule = add_encodes(gpipe(placement, 2), EncodeContext(spec, placement, costs, net, encoders))
    run = simulate(spec, placement, schedule, costs, net, encoders=encoders)
    assert run.makespan == pytest.approx(9.0 + 2 * 3 * 1.0)
    assert run.peak_inflight[0] >= 1


def test_the_ilp_sequences_encodes_with_the_compute_and_beats_the_pass_where_it_can():
    """1F1B over 3 devices and 4 microbatches, encoders of 3 s and 0.5 s: the pass fills gaps of a
    fixed compute order, the ILP (``pulse.synth.encodes``) may also move the compute around the encodes.
    Kept only when the simulator prices it faster; never slower than the pass."""
    spec, placement, net = unet(3), sequential(3), cluster(3)
    second = Encoder("text", params=1000, flops=1.0, out_bytes=16, feeds="latent")
    encoders = EncoderSet((ENCODER, second), "bubbles")
    for f_text, expect_gain in ((0.5, True), (3.0, None)):
        costs = replace(uniform_costs(spec), encoder_fwd=(("vae", 3.0), ("text", f_text)))
        base = make_schedule("1f1b", placement, 4, costs)
        greedy, ilp = (place_encodes_with_ilp(spec, placement, base, costs, net, encoders, None, ilp_seconds=s)
                       for s in (0.0, 5.0))
        validate(ilp, placement, 4)
        times = [simulate(spec, placement, s, costs, net, encoders=encoders).makespan for s in (greedy, ilp)]
        assert times[1] <= times[0]
        if expect_gain:
            assert times[1] < times[0] - 1.0  # 20 s -> 18 s
            assert [a for a in ilp.all_actions() if a.is_encode] != [a for a in greedy.all_actions() if a.is_encode]


SDXL_CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, max_position_embeddings=77, projection_dim=768)  # text_encoder/config.json
SDXL_CLIP_BIGG = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                      num_attention_heads=20, max_position_embeddings=77, projection_dim=1280)  # text_encoder_2/


def test_sdxl_encoders_are_sdxls_own_and_one_text_task_makes_three_inputs():
    """sdxl-unet (and a diffusers UNet with addition_embed_type text_time) gets SDXL's encoders, not SD 2's:
    CLIP ViT-L/14 text + OpenCLIP ViT-bigG/14 text (with its projection) as one task whose output is the
    whole context, the pooled text_embeds and the time ids, read by cross-attention and time_embed."""
    import json
    import tempfile
    from pathlib import Path

    from pulse.zoo import get_spec
    from pulse.zoo.diffusers_config import PREFIX
    from pulse.zoo.encoders import zoo_encoders
    from pulse.zoo.loading import load_model
    from sdxl_helpers import SDXL_INPUTS, SDXL_UNET

    sdxl = get_spec("sdxl-unet")
    text, vae = zoo_encoders(sdxl).encoders
    assert text.feeds == SDXL_INPUTS and set(text.readers) == {"transformer2d", "transformer2d_part", "time_embed"}
    inputs = {s.name: s.bytes for s in sdxl.shared_inputs}
    assert text.out_bytes == sum(inputs[n] for n in SDXL_INPUTS) == (77 * (768 + 1280) + 1280 + 6) * 2
    assert vae.feeds == ("latent",) and vae.out_bytes == 4 * 128 * 128 * 2 and vae.params == 34_163_664
    assert text.layers == 12 + 32
    from pulse.partition.symmetric import plan_symmetric

    placement = plan_symmetric(sdxl, uniform_costs(sdxl), 4, folds=1, strict=False).placement
    assert reader_chunks(sdxl, placement, text)[0] == 0  # time_embed, on the first chunk, reads the pooled text
    config = {"_class_name": "UNet2DConditionModel", **SDXL_UNET}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "unet").mkdir()
        (Path(tmp) / "unet" / "config.json").write_text(json.dumps(config))
        diffusers_sdxl = load_model(PREFIX + str(Path(tmp) / "unet"))
    assert zoo_encoders(diffusers_sdxl).encoders[0] == text  # the VAE's figures follow the UNet's resolution


def test_sdxl_text_task_counts_the_transformers_models():
    """The text task's parameters are CLIPTextModel's plus CLIPTextModelWithProjection's, built from
    stabilityai/stable-diffusion-xl-base-1.0's two text encoder configs on the meta device."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from pulse.zoo import get_spec
    from pulse.zoo.encoders import zoo_encoders

    with torch.device("meta"):
        models = (transformers.CLIPTextModel(transformers.CLIPTextConfig(**SDXL_CLIP_L)),
                  transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**SDXL_CLIP_BIGG)))
    counts = [sum(p.numel() for p in m.parameters()) for m in models]
    assert counts == [123_060_480, 694_659_840]
    assert zoo_encoders(get_spec("sdxl-unet")).encoders[0].params == sum(counts)


def test_an_encoder_of_several_inputs_round_trips_and_one_input_stays_a_name():
    """Plans of one-input encoders keep their YAML (``feeds: latent``); several are a list, and each
    reader's message holds a tensor per input, in the order every communicator is told."""
    from pulse.runtime.message_order import inbound_order, sent_messages
    from pulse.runtime.wiring import Wiring

    assert ENCODER.feeds == ("latent",) and ENCODER.to_dict()["feeds"] == "latent"
    three = Encoder("text", params=10, flops=1.0, out_bytes=6, feeds=("context", "a", "b"), readers=("res",))
    assert three.to_dict()["feeds"] == ["context", "a", "b"]
    assert Encoder.from_dict(three.to_dict(), "e") == three and Encoder.from_dict(ENCODER.to_dict(), "e") == ENCODER
    with pytest.raises(PulseError, match="once each"):
        Encoder("text", params=10, flops=1.0, out_bytes=6, feeds=("a", "a"))
    with pytest.raises(PulseError, match="feeds"):
        Encoder.from_dict({**three.to_dict(), "feeds": ["a", 3]}, "e")
    spec, placement, _, _ = _setup()
    schedule, _ = _placed("bubbles")
    program = lower(schedule, spec, placement, EncoderSet((ENCODER,), "bubbles"))
    wiring = Wiring(spec, placement)
    one = [m for m in sent_messages(wiring, program, 1) if m.tags[0].transfer >= len(wiring.transfers)]
    assert [len(m.tags) for m in one] == [1]
    feeds = [three.feeds]
    (message,) = [m for m in sent_messages(wiring, program, 1, feeds) if m.tags[0].transfer >= len(wiring.transfers)]
    assert [(t.slot, t.name) for t in message.tags] == [(0, "context"), (1, "a"), (2, "b")]
    assert tuple(t.as_int() for t in message.tags) in inbound_order(wiring, program, 0, feeds)[1]
