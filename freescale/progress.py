"""Progress bars for long commands: tqdm on stderr when stderr is a terminal, nothing otherwise.

A bar never goes to a log file, a pipe or CI's output: there each command's own one-line
progress messages say where it is. ``bar`` takes what ``tqdm`` takes; ``say`` prints a line
above a live bar (or plainly when there is none).
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def on_terminal(stream=None) -> bool:
    stream = stream if stream is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a file
        return False


def bar(iterable=None, *, total=None, desc: str | None = None, unit: str = "it", stream=None, **kwargs) -> tqdm:
    """A tqdm bar on ``stream`` (stderr), disabled when it is not a terminal."""
    stream = stream if stream is not None else sys.stderr
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=stream, disable=not on_terminal(stream),
                dynamic_ncols=True, leave=False, **kwargs)


def say(progress: tqdm | None, message: str, file=None) -> None:
    """Print ``message`` without breaking ``progress``'s bar."""
    file = file if file is not None else sys.stdout
    if progress is not None and not progress.disable:
        progress.write(message, file=file)  # clears the bar, writes, draws it again
    else:
        print(message, file=file, flush=True)
