"""The table bench/gpu.py prints: its head (command, device, shape, recipe, FLOPs) and one column of
figures per parallel mode."""

import torch

GiB = 2**30

# (label, where in a mode's figures, kind): "s" seconds, "rate", "tflops", "mfu", "bytes", "text".
ROWS = [
    ("s / rollout, with sleep", ("sleep", "seconds_per_rollout"), "s"),
    ("s / rollout, no sleep", ("no_sleep", "seconds_per_rollout"), "s"),
    ("s / critic step", ("sleep", "seconds_per_critic_step"), "s"),
    ("s / actor step", ("sleep", "seconds_per_actor_step"), "s"),
    ("s / rollout stage (student calls)", ("sleep", "seconds_rollout_stage"), "s"),
    ("s / score (teacher)", ("sleep", "seconds_score"), "s"),
    ("s / rollout in wake + sleep", ("sleep", "seconds_wake_sleep"), "s"),
    ("samples / s, with sleep", ("sleep", "samples_per_second"), "rate"),
    ("samples / s, no sleep", ("no_sleep", "samples_per_second"), "rate"),
    ("TFLOP/s per device, with sleep", ("sleep", "tflops_per_device"), "tflops"),
    ("TFLOP/s per device, no sleep", ("no_sleep", "tflops_per_device"), "tflops"),
    ("MFU, with sleep", ("sleep", "mfu"), "mfu"),
    ("MFU, no sleep", ("no_sleep", "mfu"), "mfu"),
    ("GiB peak actor, with sleep", ("sleep", "group_peak", "actor"), "bytes"),
    ("GiB peak critic, with sleep", ("sleep", "group_peak", "critic"), "bytes"),
    ("GiB actor asleep", ("asleep", "actor"), "bytes"),
    ("GiB critic asleep", ("asleep", "critic"), "bytes"),
    ("GiB device peak, with sleep", ("sleep", "device_peak"), "bytes"),
    ("  at step", ("sleep", "device_peak_at"), "text"),
    ("GiB device peak if the idle group slept", ("device_peak_if_idle_asleep",), "bytes"),
    ("GiB peak actor, no sleep", ("no_sleep", "group_peak", "actor"), "bytes"),
    ("GiB peak critic, no sleep", ("no_sleep", "group_peak", "critic"), "bytes"),
    ("GiB device peak, no sleep", ("no_sleep", "device_peak"), "bytes"),
    ("  at step", ("no_sleep", "device_peak_at"), "text"),
    ("GiB device used (all processes), with sleep", ("sleep", "device_used"), "bytes"),
    ("GiB device used (all processes), no sleep", ("no_sleep", "device_used"), "bytes"),
]


def cell(figures: dict, where: tuple[str, ...], kind: str, on_gpu: bool) -> str:
    """One figure as printed: n/a where there is none (or it is memory on CPU), the error of a failed run."""
    value = figures
    for key in where:
        if "error" in value:
            return value["error"]
        value = value[key]
    if isinstance(value, list):
        value = max(value)  # per rank: the most loaded rank
    if value is None or (kind in ("bytes", "text") and not on_gpu):
        return "n/a"
    formats = {"s": "{:.3f}", "rate": "{:.2f}", "tflops": "{:.3g}", "mfu": "{:.1%}", "bytes": "{:.2f}", "text": "{}"}
    return formats[kind].format(value / GiB if kind == "bytes" else value)


def table(result: dict) -> str:
    """The head, the figures (one column per parallel mode), and each mode's steps with sleep."""
    modes, on_gpu = result["runs"], result["device"] != "cpu"
    flops, shape = result["flops"], result["shape"]
    per_rollout = flops["per_rollout_mean"]
    lines = [f"command: {result['command']}",
             f"device: {result['device']}, torch {torch.__version__}"
             + ("" if on_gpu else "; memory rows n/a: CPU ranks report no accelerator memory"),
             f"shape: {shape['name']}: MMDiT {shape['parameters'] / 1e6:.4g} M parameters, latents "
             f"{'x'.join(map(str, shape['sample_shape']))} ({shape['resolution']} px), text {shape['text'][0]} tokens "
             f"x {shape['text'][1]}, mixed precision {shape['precision']}",
             f"recipe: N = {shape['student_steps']} student steps, K = {shape['critic_steps']} critic steps x "
             f"B = {shape['batch']} samples per rank, world size {shape['world_size']}, {shape['samples']} samples per "
             f"rollout; {shape['rollouts']} timed rollouts each way after a warm-up",
             f"FLOPs per sample (FlopCounterMode): forward F {flops['forward'] / 1e9:.4g} GFLOP, forward + backward "
             f"{flops['forward_backward'] / 1e9:.4g} GFLOP ({flops['forward_backward'] / flops['forward']:.2f} F)",
             "FLOPs per rollout (all ranks, mean of the timed): " + ", ".join(
                 f"{stage} {value / 1e9:.4g}" for stage, value in per_rollout.items())
             + f" = {sum(per_rollout.values()) / 1e9:.4g} GFLOP",
             "peak dense bf16: " + (f"{result['peak_flops'] / 1e12:.0f} TFLOP/s" if result["peak_flops"]
                                     else "unknown for this device: MFU n/a"),
             "", "| figure | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    for label, where, kind in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(f, where, kind, on_gpu) for f in modes.values()) + " |")
    for mode, figures in modes.items():
        steps = figures["sleep"]["steps"]
        roles = list(next(iter(steps.values()))["peak"])
        lines += ["", f"{mode}, with sleep, step by step: mean s, and each group's peak GiB during the step",
                  "| step | s | " + " | ".join(roles) + " |", "|---|---:|" + "---:|" * len(roles)]
        lines += [f"| {name} | {step['seconds']:.3f} | "
                  + " | ".join(cell(step["peak"], (role,), "bytes", on_gpu) for role in roles) + " |"
                  for name, step in steps.items()]
    return "\n".join(lines)
