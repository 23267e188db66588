"""Every flag of every `pulse` command, with hostile values: no traceback, no hang, no runaway memory.

One child process runs every case in-process (``pulse.cli.main.main(argv)``) under a 4 GiB
address-space cap (``RLIMIT_AS``) and a per-case timer; the launchers are stubbed there (the
launch paths are tested with real processes in ``test_train_reliability.py``). A case passes
when it exits 0, or exits 2 saying why in exactly one line; never a traceback, a crash, a
MemoryError or a hang.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEMORY_CAP = 4 << 30
CASE_SECONDS = 20.0

# Small, fast bases: the hostile flag is appended, so it overrides the base's value (argparse: last wins).
BASES = {
    "plan": ["--model", "tiny-unet", "--pp", "2", "--hardware", "cpu-local"],
    "simulate": ["--model", "tiny-unet", "--pp", "2", "--hardware", "cpu-local", "--schedule", "gpipe"],
    "tune": ["--model", "tiny-unet", "--cluster", "v100-pcie-1x8", "--global-batch", "8", "--microbatch-sizes",
             "2", "--folds", "1", "--max-pp", "2"],
    "train": ["--model", "tiny-unet", "--pp", "2", "--schedule", "gpipe", "--plan-only"],
    "profile": ["--model", "tiny-unet", "--pp", "2", "--repeats", "1"],
}


def hostile_values(tmp: Path) -> list[str]:
    folder, file = tmp / "a-folder", tmp / "a-file.yaml"
    folder.mkdir(exist_ok=True)
    file.write_text("not: [a plan\n")
    return ["nan", "inf", "-inf", "-1", "0", "1e309", str(2**70), "", "x" * 4096, str(folder), str(file),
            str(tmp / "missing" / "nothing.yaml"), "../../escaped", "1,,2", *special_files(tmp)]


def special_files(tmp: Path) -> list[str]:
    """A named pipe (opening it to read blocks), a link to a file, and a character device where this
    user may make one: outputs must leave them as they are, inputs must not hang on them."""
    fifo, link, node = tmp / "a-fifo.yaml", tmp / "a-link.yaml", tmp / "a-node.yaml"
    if not fifo.exists():
        os.mkfifo(fifo)
        link.symlink_to(tmp / "a-file.yaml")
        try:
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except OSError:
            pass
    return [str(p) for p in (fifo, link, node) if os.path.lexists(p)]


def cases(tmp: Path) -> list[list[str]]:
    """(command, base..., flag[, value]) for every option of every command."""
    sys.path.insert(0, str(ROOT))
    from pulse.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    out = []
    for name, sub in commands.items():
        for action in sub._actions:
            flag = next((s for s in action.option_strings if s.startswith("--")), None)
            if flag is None or flag == "--help":
                continue
            base = [name, *BASES.get(name, [])]
            if action.nargs == 0:  # store_true: the flag alone
                out.append([*base, flag])
                continue
            out += [[*base, flag, value] for value in hostile_values(tmp)]
    return out


def child(case_file: str, result_file: str) -> None:
    """Run every case in this process, capped; write one JSON result per case."""
    import contextlib
    import io
    import resource
    import signal
    import traceback

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    class Hang(Exception):
        pass

    def on_alarm(*_):
        raise Hang()

    signal.signal(signal.SIGALRM, on_alarm)
    import pulse.cli.launchers as launchers
    import pulse.cli.train_cmd as train_cmd
    from pulse.cli.main import main

    train_cmd.launch = launchers.launch = lambda *a, **k: 0  # never start torchrun or msrun here
    results = []
    for argv in json.loads(Path(case_file).read_text()):
        out, err = io.StringIO(), io.StringIO()
        signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
            crash = None
        except BaseException as exc:  # noqa: BLE001 - anything escaping main() is the finding
            code, crash = None, f"{type(exc).__name__}: {traceback.format_exc()[-1500:]}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        results.append({"argv": argv, "code": code, "err": err.getvalue()[-3000:], "crash": crash})
    Path(result_file).write_text(json.dumps(results))


def problems(result: dict) -> str | None:
    err = result["err"]
    if result["crash"]:
        return result["crash"]
    if "Traceback" in err:
        return "traceback on stderr"
    if result["code"] not in (0, 2):
        return f"exit code {result['code']}"
    if result["code"] == 2 and len(err.strip().splitlines()) != 1:
        return f"exit 2 with {len(err.strip().splitlines())} stderr lines"
    return None


def test_every_flag_with_hostile_values(tmp_path: Path) -> None:
    all_cases = cases(tmp_path)
    case_file, result_file = tmp_path / "cases.json", tmp_path / "results.json"
    case_file.write_text(json.dumps(all_cases))
    work = tmp_path / "a" / "b" / "cwd"  # flags naming ../../x (their own choice of place) stay in tmp_path
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, __file__, str(case_file), str(result_file)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(result_file.read_text())
    assert len(results) == len(all_cases) > 300
    bad = [(r["argv"][0], *(a[:80] for a in r["argv"][len(BASES.get(r["argv"][0], [])) + 1:]),
            (problems(r) or "")[-600:]) for r in results if problems(r)]
    refused = sum(r["code"] == 2 for r in results)
    print(f"{len(results)} cases, {refused} refused in one line, {len(results) - refused} accepted")
    assert not bad, "\n".join(map(str, bad[:20]))
    assert stat.S_ISFIFO(os.lstat(tmp_path / "a-fifo.yaml").st_mode)  # never replaced by an output
    assert (tmp_path / "a-link.yaml").is_symlink()  # refused as an output, not replaced by a file
    if os.path.lexists(tmp_path / "a-node.yaml"):
        assert stat.S_ISCHR(os.lstat(tmp_path / "a-node.yaml").st_mode)


@pytest.mark.parametrize("attr,value", [("out_bytes", 10**30), ("flops", 1e25), ("params", 10**15),
                                        ("saved_bytes", 2**50)])
def test_absurd_layer_sizes_are_refused(attr: str, value: float, tmp_path: Path, capsys) -> None:
    from pulse.cli.common import load_model
    from pulse.cli.main import main
    from pulse.spec_io import save_spec

    spec = load_model("tiny-unet")
    layers = list(spec.layers)
    layers[3] = replace(layers[3], **{attr: value})
    save_spec(replace(spec, layers=tuple(layers)), tmp_path / "spec.yaml")
    model = ["--model", str(tmp_path / "spec.yaml"), "--pp", "2", "--hardware", "cpu-local"]
    for command in (["plan"], ["simulate", "--schedule", "gpipe"],
                    ["train", "--plan-only", "--schedule", "gpipe", "--out-dir", str(tmp_path / "run")]):
        assert main([*command, *model]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"layer '{layers[3].name}' has {attr}" in err[0], err


def test_cost_table_of_another_model_is_refused(tmp_path: Path, capsys) -> None:
    from pulse.cli.common import load_model
    from pulse.cli.main import main
    from pulse.costs import AnalyticProfiler
    from pulse.hardware import load_cluster
    from pulse.spec_io import save_spec

    spec = load_model("tiny-unet")
    AnalyticProfiler(load_cluster("cpu-local").hardware).profile(spec, 1).save(tmp_path / "costs.yaml")
    save_spec(replace(spec, name="my-unet"), tmp_path / "mine.yaml")  # same layer names, another model
    base = ["plan", "--pp", "2", "--hardware", "cpu-local", "--costs", str(tmp_path / "costs.yaml")]
    assert main([*base, "--model", "tiny-unet"]) == 0
    capsys.readouterr()
    assert main([*base, "--model", str(tmp_path / "mine.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "profiled for model 'tiny-unet', not 'my-unet'" in err[0]


def test_no_parser_expands_abbreviations(capsys) -> None:
    from pulse.cli.main import build_parser, main

    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    assert parser.allow_abbrev is False and all(sub.allow_abbrev is False for sub in subs.values())
    entries = ["pulse_torch.train", "pulse_torch.profiler", "pulse_torch.profile_job"]
    pytest.importorskip("torch")
    import importlib
    import importlib.util

    if importlib.util.find_spec("mindspore") is not None:
        entries.append("pulse_mindspore.profile_job")
    for name in entries:
        module = importlib.import_module(name)
        assert module.build_parser().allow_abbrev is False, name
    assert main(["train", "--plan-o"]) == 2  # not read as --plan-only
    assert "unrecognized arguments: --plan-o" in capsys.readouterr().err


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
