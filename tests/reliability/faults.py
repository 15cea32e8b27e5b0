"""Faults injected for real into a running distill run: a rank's process SIGKILLed, stored bytes flipped on
disk, a filesystem that fills up. No part of the product is replaced or patched."""

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

RANK_TITLE = "ray::RankProcess"


def rank_pids(method: str = "") -> list[int]:
    """Pids of this process's rank processes running `method` now (Ray titles an actor's process
    `ray::<Class>.<method>`, and `ray::<Class>` while idle); without `method`, of every one. Only descendants of
    this process (its local Ray's ranks): another pytest beside it (tests/background.py) runs ranks of its own."""
    prefix = f"{RANK_TITLE}.{method}" if method else RANK_TITLE
    pids = []
    for process in psutil.Process().children(recursive=True):
        try:
            title = process.cmdline()[:1]
        except psutil.Error:  # ended meanwhile
            continue
        if title and title[0].startswith(prefix):
            pids.append(process.pid)
    return sorted(pids)


def when(condition, action, timeout_s: float = 600.0, poll_s: float = 0.005) -> threading.Thread:
    """Run `action()` from a background thread as soon as `condition()` holds; `thread.fired` says if it ran."""
    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                thread.result = action()
                thread.fired = True
                return
            time.sleep(poll_s)
    thread = threading.Thread(target=watch, daemon=True)
    thread.fired, thread.result = False, None
    thread.start()
    return thread


def kill_one(method: str) -> int | None:
    """SIGKILL the highest-numbered rank process running `method` (None if none is running it now)."""
    pids = rank_pids(method)
    if not pids:
        return None
    os.kill(pids[-1], signal.SIGKILL)
    return pids[-1]


def flip_byte(path: Path, offset_from_end: int = 16) -> None:
    """Flip one byte of a stored file in place, near its end (in the tensor data, not the header)."""
    with open(path, "r+b") as file:
        file.seek(-offset_from_end, os.SEEK_END)
        byte = file.read(1)
        file.seek(-offset_from_end, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0xFF]))


def non_finite_tensors(root: Path) -> list[str]:
    """Every stored safetensors tensor below `root` that holds a NaN or an infinity."""
    found = []
    for path in root.rglob("*"):
        if path.is_file() and path.suffix in (".safetensors", ".distcp"):
            for name, tensor in load_file(str(path)).items():
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    found.append(f"{path.relative_to(root)}:{name}")
    return found
