"""Progress for jobs that show nothing while they run (a compilation, a model conversion, one long call).

`with heartbeat("compiling the decode loop"):` prints nothing if the block ends within `delay` seconds;
after that, the elapsed time on stderr: rewritten in place every second on a terminal, one line every
`every` seconds in a log file; and "... done in N s" at the end. Jobs with a natural unit of progress use
tqdm bars instead (generation, training, self-distillation).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator, TextIO


@contextlib.contextmanager
def heartbeat(label: str, delay: float = 3.0, every: float = 10.0, stream: TextIO | None = None,
              enabled: bool = True) -> Iterator[None]:
    if not enabled:
        yield
        return
    out = stream or sys.stderr
    tty = hasattr(out, "isatty") and out.isatty()
    stop = threading.Event()
    start = time.perf_counter()
    shown = []

    def beat():
        wait = delay
        while not stop.wait(wait):
            elapsed = time.perf_counter() - start
            if tty:
                out.write(f"\r{label}: {elapsed:.0f} s ")
            else:
                out.write(f"{label}: {elapsed:.0f} s so far\n")
            out.flush()
            shown.append(elapsed)
            wait = 1.0 if tty else every

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if shown:
            out.write(f"{chr(13) if tty else ''}{label}: done in {time.perf_counter() - start:.1f} s\n")
            out.flush()
