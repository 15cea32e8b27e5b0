"""The table bench/gpu.py prints: its head (command, device, shape, the peaks the MFU is read against) and, per
variant, one row per stage of a rollout (means over the timed rollouts) and one for the whole rollout."""

import statistics

GiB = 2**30
STAGES = ("rollout", "convert", "critic-train", "score", "actor-train")
COLUMNS = ("stage", "compute s", "wall s", "TFLOP", "MFU stated", "MFU matmul", "peak GiB", "plan GiB",
           "peak / plan")


def mean_of(variant: dict, stage: str, key: str) -> float | None:
    """The mean over the timed rollouts of one stage's figure (None where none was measured)."""
    values = [rollout[stage] if key is None else rollout[stage][key]
              for rollout in variant.get("rollouts", {}).values()
              if stage in rollout and (key is None or rollout[stage][key] is not None)]
    return statistics.mean(values) if values else None


def stage_rows(result: dict, variant: dict, sleeps: bool) -> list[dict]:
    """Each stage's figures and the rollout's, as the table's rows (None: not measured, or not planned)."""
    plan = variant.get("plan") or {}
    flops = plan.get("flops", {})
    planned = {stage["stage"]: stage["peak"] for stage in plan.get("stages", [])} if sleeps else {}
    rows = []
    for stage in STAGES:
        peak = max((r[stage]["peak_bytes"] or 0 for r in variant.get("rollouts", {}).values() if stage in r),
                   default=None)
        rows.append({"stage": stage, "compute": mean_of(variant, stage, "compute_s"),
                     "wall": mean_of(variant, stage, "wall_s"), "flops": flops.get(stage),
                     "peak": peak or None, "plan": planned.get(stage)})
    wall = mean_of(variant, "rollout_wall_s", None)
    stage_wall = sum(row["wall"] or 0 for row in rows)
    rows.append({"stage": "between stages", "wall": wall - stage_wall if wall is not None else None})
    peaks = [row["peak"] for row in rows if row.get("peak")]
    rows.append({"stage": "whole rollout", "compute": sum(row.get("compute") or 0 for row in rows) or None,
                 "wall": wall,
                 "flops": sum(flops.values()) or None, "peak": max(peaks) if peaks else None,
                 "plan": max(planned.values()) if planned else plan.get("resident") or None})
    for row in rows:  # a stage's MFU over its compute time; the rollout's over its wall time, copies included
        seconds = row.get("wall") if row["stage"] == "whole rollout" else row.get("compute")
        achieved = row["flops"] / seconds if row.get("flops") and seconds else None
        row["mfu_stated"] = achieved / result["peak_flops_stated"] if achieved and result["peak_flops_stated"] else None
        row["mfu_matmul"] = achieved / result["matmul_flops"] if achieved else None
    return rows


def _cell(value, kind: str) -> str:
    if value is None:
        return "n/a"
    # MFU to 3 significant figures: a tiny CPU check's 0.006% must not print as a 0.0% that reads as nothing done
    formats = {"s": "{:.3f}", "tflop": "{:.4g}", "mfu": "{:.3g}%", "gib": "{:.4g}", "ratio": "{:.3f}"}
    scale = {"tflop": 1e12, "gib": GiB, "mfu": 1e-2}.get(kind, 1)
    return formats[kind].format(value / scale)


def table(result: dict) -> str:
    """The head, then per variant its rows (or its error)."""
    stated = result["peak_flops_stated"]
    lines = [f"command: {result['command']}",
             f"device: {result['device']}, torch {result['torch']}, shape {result['shape']}, attention "
             f"{result.get('attention', 'n/a')}",
             "peaks for the MFU: stated " + (f"{stated / 1e12:.4g} TFLOP/s" if stated else
                                             "none (give --peak-tflops)")
             + f"; a bf16 matrix product here: {result['matmul_flops'] / 1e12:.4g} TFLOP/s",
             "a stage's MFU is over its compute time; the whole rollout's over its wall time (sleep and wake copies "
             "included); memory is n/a without CUDA; plan GiB is `dmd2 plan`'s prediction for the same run"]
    for name, variant in result["variants"].items():
        lines += ["", f"variant {name}" + (f": {variant['error']}" if "error" in variant else "")]
        if "rollouts" not in variant:
            continue
        lines += ["| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
        for row in stage_rows(result, variant, sleeps=name != "no-sleep"):
            ratio = row["peak"] / row["plan"] if row.get("peak") and row.get("plan") else None
            cells = [_cell(row.get("compute"), "s"), _cell(row.get("wall"), "s"), _cell(row.get("flops"), "tflop"),
                     _cell(row.get("mfu_stated"), "mfu"), _cell(row.get("mfu_matmul"), "mfu"),
                     _cell(row.get("peak"), "gib"), _cell(row.get("plan"), "gib"), _cell(ratio, "ratio")]
            lines.append(f"| {row['stage']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
