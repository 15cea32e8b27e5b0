"""Progress on long work, through tqdm: a live bar on a terminal, a line every 30 s in a log file."""

import sys

from tqdm import tqdm


def progress_bar(total: int, desc: str, initial: int = 0, unit: str = "it") -> tqdm:
    """A tqdm bar on stderr; redrawn at most every 30 s when stderr is not a terminal (CI logs, files)."""
    interactive = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=interactive,
                mininterval=0.1 if interactive else 30.0, ascii=not interactive)
