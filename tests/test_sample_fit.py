"""``--sample-every``: rank 0 loads the whole pipeline (fp32) beside its training state, so `pulse train`
refuses, before launch, a run whose rank 0 cannot hold both (``pulse.cli.sample_fit``).

Planning path only (``--plan-only``): no process is launched. The tiny pipeline's parts are counted from
their safetensors headers; hardware files are written with a memory just too small for the sample.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pipeline_helpers import image_folder, pipeline_fixture
from pulse.cli.main import main
from pulse.cli.sample_fit import sample_refusal, sample_weight_bytes
from pulse.hardware import CONFIG_DIR, load_cluster
from pulse.plan import load_plan
from pulse.zoo.loading import load_model

pipeline = pytest.fixture(scope="session")(pipeline_fixture)
MiB = 2**20
# a text encoder of 3.2M parameters: the sampling pipeline (17 MB in fp32) outweighs what a stage of the
# tiny UNet trains with, so a device can fit the training and not the sample
HEAVY_TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)


@pytest.fixture(scope="module")
def heavy(tmp_path_factory) -> Path:
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from pipeline_helpers import tiny_pipeline

    folder = tmp_path_factory.mktemp("heavy") / "pipeline"
    tiny_pipeline(folder, text=HEAVY_TEXT)
    return folder


def hardware_file(folder: Path, memory_bytes: int, shared_cores: bool) -> Path:
    """cpu-local's figures with another memory; without ``shared_cores`` each rank has a device of its own."""
    data = yaml.safe_load((CONFIG_DIR / "hardware" / "cpu-local.yaml").read_text())
    data.update(name="small", memory_bytes=int(memory_bytes))
    if not shared_cores:
        data.pop("shared_cores")
    path = folder / f"small-{memory_bytes}-{shared_cores}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def train(pipeline: Path, out: Path, cluster: str, *extra: str) -> list[str]:
    return ["train", "--pipeline", str(pipeline), "--pp", "2", "--schedule", "gpipe", "--microbatch-size", "1",
            "--cluster", cluster, "--plan-only", "--out-dir", str(out), *extra]


def peaks_of(run: Path) -> list[int]:
    plan, _ = load_plan(run / "plan.yaml", load_model)
    return [int(p) for p in plan.predicted["peak_memory_bytes_per_device"]]


def test_the_pipeline_is_counted_as_sampling_loads_it(pipeline: Path) -> None:
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    pipe = diffusers.DiffusionPipeline.from_pretrained(pipeline, local_files_only=True)
    params = sum(p.numel() for m in pipe.components.values() if hasattr(m, "parameters") for p in m.parameters())
    assert sample_weight_bytes(pipeline) == 4 * params  # every part in fp32


@pytest.mark.parametrize("shared_cores", [False, True], ids=["device", "cpu-host"])
def test_sampling_that_cannot_fit_is_refused_before_launch(heavy: Path, tmp_path: Path, capsys,
                                                           shared_cores: bool) -> None:
    pipeline = heavy
    sample = ["--sample-every", "1", "--sample-prompt", "a cat"]
    roomy = hardware_file(tmp_path, 2**40, shared_cores)
    assert main(train(pipeline, tmp_path / "roomy", str(roomy), *sample)) == 0
    peaks, weights = peaks_of(tmp_path / "roomy"), sample_weight_bytes(pipeline)
    # just too small: the training fits (one device, or the host's ranks together), the sample beside it not
    need = (peaks[0] if not shared_cores else sum(peaks)) + weights
    assert max(peaks) < need - 1 and weights > MiB
    small = str(hardware_file(tmp_path, need - 1, shared_cores))
    capsys.readouterr()
    assert main(train(pipeline, tmp_path / "refused", small, *sample)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pulse train: error: --sample-every 1: sampling loads the "), err
    assert "drop --sample-every, or sample after training (`pulse export`" in err[0]
    assert ("a small device has" if not shared_cores else "the small host has") in err[0]
    assert not (tmp_path / "refused").exists()  # nothing written, nothing launched
    assert main(train(pipeline, tmp_path / "forced", small, *sample, "--force")) == 0
    assert "warning (--force): --sample-every 1" in capsys.readouterr().err
    assert peaks_of(tmp_path / "forced") == peaks  # the same plan: only the sample did not fit
    assert main(train(pipeline, tmp_path / "unsampled", small)) == 0  # without samples it fits


def test_a_memory_cgroup_limit_bounds_a_cpu_host(pipeline: Path, tmp_path: Path) -> None:
    assert main(train(pipeline, tmp_path / "run", "cpu-local", "--images", str(image_folder(tmp_path / "i", 1)))) == 0
    plan, _ = load_plan(tmp_path / "run" / "plan.yaml", load_model)
    hardware, weights = load_cluster("cpu-local").hardware, sample_weight_bytes(pipeline)
    need = sum(peaks_of(tmp_path / "run")) + weights
    assert sample_refusal(plan, hardware, weights, 5) is None  # 24 GiB
    said = sample_refusal(plan, hardware, weights, 5, limit=need - 1)
    assert "memory cgroup allows" in said and said.startswith("--sample-every 5: ")
    assert sample_refusal(plan, hardware, weights, 5, limit=need) is None
    unpriced = replace(plan, predicted={k: v for k, v in plan.predicted.items()
                                        if k != "peak_memory_bytes_per_device"})
    assert sample_refusal(unpriced, hardware, weights, 5, limit=1) is None  # not simulated: not judged
