"""The peer benchmark's report as a person reads it: markdown tables of PULSE against
torch.distributed.pipelining per (P, link), every run with its prediction, how TP's rows were
priced, the probe; and the line printed as each group finishes. Pure formatting of the report
dict ``peer_pipelining`` writes (no torch)."""
from __future__ import annotations


def markdown(report: dict) -> str:
    """The report as tables: PULSE against TP's fastest per (P, link), every run, the probe."""
    lines = [f"# torch.distributed.pipelining beside PULSE (measured, {report['host']['cores']} cores)", "",
             f"{_model_line(report)}; median step after {report['warmup']} warm-up steps of "
             f"{report['steps']}; load average {report['host']['load_before']} before, "
             f"{report['host']['load_after']} after. Command: `{report['command']}`", "",
             *_setup_lines(report),
             "| P | link (B/s) | PULSE (`--schedule auto`) s/step | predicted (error) | MB/step | TP fastest | s/step "
             "| MB/step | PULSE speed-up | on best steps |", "|" + " --- |" * 10]
    for g in report["groups"]:
        p, fast = g["pulse"], next((t for t in g["tp"] if t["schedule"] == g["tp_fastest"]), None)
        pulse = (f"{p['median_s']:.3f} ({p['schedule']}; runs {', '.join(f'{x:.3f}' for x in p['run_medians_s'])}) | "
                 f"{_predicted(p)} | {p['bytes_per_step'] / 1e6:.2f}") if p else "- | - | -"
        tp = (f"{fast['schedule']} | {fast['median_s']:.3f} | {fast['bytes_per_step'] / 1e6:.2f}" if fast
              else "- | - | -")
        ratio = f"{g['speedup']:.2f}x" if g["speedup"] else "-"
        best = f"{g['speedup_best']:.2f}x" if g.get("speedup_best") else "-"
        lines.append(f"| {g['pp']} | {_rate(g['bandwidth'])} | {pulse} | {tp} | {ratio} | {best} |")
    lines += ["", "Every run (predicted: the plan's step in log.json, and measured over predicted; TP's step "
              "time over PULSE auto's: how much faster PULSE is; each TP rank's peak resident memory, its process's "
              "high-water mark over the schedules run so far, in the order listed):", "",
              "| P | link (B/s) | run | s/step (median) | best step | predicted (error) | MB/step | TP / PULSE "
              "| peak RSS per rank (GiB) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for g in report["groups"]:
        lines += [_run_row(g, r) for r in _runs(g)]
    lines += _pricing_lines(report)
    if report.get("probe"):
        source = f" (from the --probe run at commit {report['probe_commit']})" if report.get("probe_commit") else ""
        lines += ["", f"TP without each workaround (one step, free link){source}:", "",
                  "| P | left out | schedule | result |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['pp']} | {r['without']} | {r['schedule']} ({r['cuts']} cuts {r['stage_cuts']}) | "
                  f"{r['error'] or 'runs'} |" for r in report["probe"]]
    return "\n".join(lines) + "\n"


def _model_line(report: dict) -> str:
    """What was trained; a report from before ``--model`` is the small UNet at its config's size."""
    config, resolution = report["model"], report.get("resolution") or 8 * report["model"]["sample_size"]
    parameters = next((c["parameters"] for c in report["calibration"].values() if c.get("parameters")), None)
    size = f", {parameters:,} parameters" if parameters else ""
    return (f"Model ({report.get('model_name', 'small')}): diffusers UNet2DConditionModel "
            f"{config['block_out_channels']}{size}, random weights, {resolution} px ({resolution // 8}x"
            f"{resolution // 8} latents), {report['context_len']} text tokens of width "
            f"{config['cross_attention_dim']}, fp32, microbatch {report['microbatch_size']}, "
            f"M = {report.get('microbatches') or '2P'}")


def _setup_lines(report: dict) -> list[str]:
    """Where PULSE's costs came from and how TP's ranks hold the model (reports from ``--model`` on)."""
    if "tp_ranks_hold" not in report:
        return []
    costs = "; ".join(f"P = {pp}: {c['pulse_costs']}" for pp, c in report["calibration"].items()
                      if c.get("pulse_costs"))
    return [f"PULSE's costs: {costs or '-'}. TP's ranks: {report['tp_ranks_hold']}.", ""]


def _pricing_lines(report: dict) -> list[str]:
    """How TP's rows were priced, and where the simulated bytes differ from the wire's."""
    priced = {pp: c["tp_pricing"] for pp, c in report["calibration"].items() if c.get("tp_pricing")}
    if not priced:
        return []
    lines = ["", "TP's predictions: PULSE's simulator on TP's placement, cut and schedule (`peer_pricing`: "
             "1f1b/gpipe sequential, interleaved_1f1b PULSE's interleaved_1f1b, interleaved_zb and zbv PULSE's "
             "zero_bubble_v on the interleaved / V placement; skips relayed), priced as `pulse train --plan` "
             "prices a plan, optimizer step included; costs: "
             + "; ".join(f"P = {pp}: {why}" for pp, why in priced.items()) + "."]
    off = [f"P = {g['pp']} {g['link']} TP {t['schedule']}: simulated {t['predicted_bytes_per_step'] / 1e6:.2f} MB, "
           f"wire {t['bytes_per_step'] / 1e6:.2f} MB"
           for g in report["groups"] for t in g["tp"]
           if t.get("predicted_bytes_per_step") and t.get("bytes_per_step")
           and abs(t["predicted_bytes_per_step"] / t["bytes_per_step"] - 1) > 0.01]
    lines.append("Simulated pipeline bytes per step equal the wire's (within 1%) on every priced TP row."
                 if not off else "Simulated bytes off the wire's by more than 1%: " + "; ".join(off) + ".")
    ordered = [f"P = {g['pp']} {g['link']} TP {t['schedule']}: {_predicted(dict(t, predicted_s=t['predicted_tp_order_s']))}"
               for g in report["groups"] for t in g["tp"] if t.get("predicted_tp_order_s")]
    if ordered:
        lines.append("The same rows priced on torch's own action order (`peer_tp_order`: the schedule's "
                     "`pipeline_order`, computed without processes) in place of PULSE's generator: "
                     + "; ".join(ordered) + ".")
    unpriced = [f"P = {g['pp']} {g['link']} TP {t['schedule']}: {t['predicted_error']}"
                for g in report["groups"] for t in g["tp"] if t.get("predicted_error")]
    return lines + (["Not priced: " + "; ".join(unpriced) + "."] if unpriced else [])


def _predicted(run: dict) -> str:
    predicted = run.get("predicted_s")
    if not predicted:
        return "-"
    return f"{predicted:.3f} ({run['median_s'] / predicted - 1:+.0%})"


def _rate(bandwidth: float | None) -> str:
    return "free" if bandwidth is None else f"{bandwidth:.2g}"


def _runs(g: dict) -> list[tuple[str, dict]]:
    pulses = ([g["pulse"]] if g["pulse"] else []) + g.get("pulse_other", [])
    return ([(f"PULSE --schedule {p['asked']} ({p['schedule']})", p) for p in pulses]
            + [(f"TP {t['schedule']}", t) for t in g["tp"]])


def _run_row(g: dict, named: tuple[str, dict]) -> str:
    name, r = named
    head = f"| {g['pp']} | {_rate(g['bandwidth'])} | {name} | "
    if r.get("error"):
        return head + f"fails: {r['error'][:80]} | - | - | - | - | - |"
    ratio = f"{r['median_s'] / g['pulse']['median_s']:.2f}x" if g["pulse"] and name.startswith("TP") else ""
    best = f"{r['best_s']:.3f}" if r.get("best_s") else "-"
    rss = ", ".join(f"{b / 2**30:.2f}" for b in r.get("peak_rss_bytes") or []) or "-"
    return head + (f"{r['median_s']:.3f} | {best} | {_predicted(r)} | {r['bytes_per_step'] / 1e6:.2f} | {ratio} "
                   f"| {rss} |")



def summary_line(row: dict) -> str:
    """One (P, link) group in a line, printed as the run goes."""
    p = row["pulse"]
    tps = ", ".join(f"{t['schedule']} {t['median_s']:.3f}s (predicted {_predicted(t)})" if t["error"] is None
                    else f"{t['schedule']} fails" for t in row["tp"])
    head = f"P={row['pp']} {row['link']}: "
    head += (f"PULSE {p['schedule']} {p['median_s']:.3f}s (predicted {_predicted(p)}) "
             f"{p['bytes_per_step'] / 1e6:.2f}MB | ") if p else ""
    return head + f"TP {tps}" + (f" | speed-up {row['speedup']:.2f}x" if row["speedup"] else "")
