"""Progress on long work: a one-line bar on a terminal, a log line every 10% elsewhere."""

import sys
import time


class ProgressBar:
    """Callable as `progress(stage, done, total)`; one bar per stage."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self._stage, self._started, self._last_decile = None, 0.0, -1

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self._stage:
            self._stage, self._started, self._last_decile = stage, time.monotonic(), -1
        elapsed = time.monotonic() - self._started
        eta = elapsed / done * (total - done) if done else 0.0
        if self.tty:
            filled = int(30 * done / max(total, 1))
            self.stream.write(f"\r{stage}: [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} "
                              f"{elapsed:.0f}s elapsed, ~{eta:.0f}s left ")
            if done >= total:
                self.stream.write("\n")
        else:
            decile = 10 * done // max(total, 1)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.stream.write(f"{stage}: {done}/{total} ({elapsed:.0f}s elapsed, ~{eta:.0f}s left)\n")
        self.stream.flush()
