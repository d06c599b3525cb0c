"""The generation engine's counters, updated by its thread and read by any other (a server's /metrics), and their
Prometheus text exposition (format 0.0.4: `# HELP`, `# TYPE`, one `name{labels} value` line per sample)."""

from __future__ import annotations

import os
import threading
from bisect import bisect_left

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds, time to first token


class EngineMetrics:
    """Counters of requests, tokens and steps; time-to-first-token histogram. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = 0  # accepted into the queue
        self.rejected = 0  # refused: the queue was full or the engine closing
        self.finished: dict[str, int] = {}  # by finish reason
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.decode_steps = 0  # steps of the whole batch (one forward each)
        self.row_steps = 0  # steps of active rows
        self.step_tokens = 0  # tokens those row steps emitted (accepted tokens; 1 per row step when plain)
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0

    def add(self, **counts) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def finish(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_counts[bisect_left(TTFT_BUCKETS, seconds)] += 1
            self.ttft_sum += seconds

    def prometheus_text(self, queue_depth: int, rows_busy: int, rows: int) -> str:
        with self._lock:
            lines = []

            def metric(name, kind, help_text, samples):
                lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
                lines.extend(f"{name}{labels} {value}" for labels, value in samples)

            metric("medusa_requests_total", "counter", "Requests accepted into the queue.", [("", self.requests)])
            metric("medusa_requests_rejected_total", "counter", "Requests refused (queue full or shutting down).",
                   [("", self.rejected)])
            metric("medusa_requests_finished_total", "counter", "Requests finished, by reason.",
                   [(f'{{reason="{r}"}}', n) for r, n in sorted(self.finished.items())])
            metric("medusa_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", self.prompt_tokens)])
            metric("medusa_generation_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
            metric("medusa_decode_steps_total", "counter", "Decode steps of the whole batch.",
                   [("", self.decode_steps)])
            metric("medusa_row_steps_total", "counter", "Decode steps of active rows.", [("", self.row_steps)])
            metric("medusa_accepted_tokens_per_step", "gauge", "Tokens emitted per active row step (1 when plain).",
                   [("", round(self.step_tokens / max(self.row_steps, 1), 4))])
            metric("medusa_queue_depth", "gauge", "Requests waiting for a row.", [("", queue_depth)])
            metric("medusa_rows_busy", "gauge", "Rows serving a request.", [("", rows_busy)])
            metric("medusa_rows", "gauge", "Rows of the decode batch.", [("", rows)])
            cumulative, samples = 0, []
            for bound, count in zip(TTFT_BUCKETS + (float("inf"),), self.ttft_counts):
                cumulative += count
                samples.append((f'_bucket{{le="{"+Inf" if bound == float("inf") else bound}"}}', cumulative))
            samples += [("_sum", round(self.ttft_sum, 6)), ("_count", cumulative)]
            metric("medusa_time_to_first_token_seconds", "histogram", "From submission to the first token.", samples)
            resident = resident_bytes()
            if resident is not None:
                metric("process_resident_memory_bytes", "gauge", "Resident memory of the server process.",
                       [("", resident)])
            return "\n".join(lines) + "\n"


def resident_bytes() -> int | None:
    """This process's resident memory (Linux's /proc/self/statm), None where that file does not exist."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
