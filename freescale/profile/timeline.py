"""Per-rank step timelines: what each rank did and when, one JSON line per step.

A step record holds the step's wall-clock start and end (``time.time()`` plus this rank's
clock offset, so records of ranks on different hosts line up), the CPU time the rank's main
thread spent in the step (``cpu``), the CPU all the rank's threads spent in it
(``process_cpu``: the main thread's plus the loader's, gloo's and the transport's), the time
the main thread was ready to run but waited for a core (``cpu_wait``, Linux's run delay from
``/proc/thread-self/schedstat``; left out where the kernel does not report it), spans of the
phases the trainer can see, and the main thread's CPU in each kind of span (``span_cpu``: a
span's wall time beyond it is waiting inside that phase):

- ``data``: waiting for the loader (its CPU time is kept apart as ``data_cpu``, its wait for a
  core as ``data_cpu_wait``);
- ``forward``, ``backward``, ``optimizer``: the model's phases (backward runs from the end of
  forward to the optimizer step, so it includes gradient reduction);
- ``input_dist``: TorchRec's id all-to-all for the next batch (sparse-dist pipeline);
- ``injected_delay``: straggler injection, inside forward;
- ``id_wait``, ``flags_wait``, ``exclusive_wait``, ``collision_wait``: the waits of the
  pipelines over FreeScale's own tables (``freescale.embedding.pipeline``), which also note
  each step's ``collision_rows`` and ``read_rows`` (summed over the rank's owned rows) and the
  bytes of its exchanges with the other ranks (``exchange_bytes``: the trained batch's ids,
  rows and gradients; ``collision_bytes``: the collision rows' gradients and rows);
- ``vote``: under the replica layer, those pipelines' exchanges across the replica groups,
  the commit vote and the update after it (TorchRec's pipeline has them inside ``optimizer``).

On a GPU (``DeviceClock``) every span is also timed by events recorded on the stream the work
is issued to (the compute stream; the pipelines' side stream for ``exclusive_send``,
``collision_send`` and ``deferred_send``), and the record gets ``device_spans`` (the same
[kind, start, end] on the host clock's scale, anchored at the step's first event),
``device_step`` (first to last event) and ``device_compute``: the device time inside
``forward``, ``backward`` and ``optimizer`` less the waits nested in them (``WAIT_KINDS``).
The bubble decomposition then takes compute from the device, not from the host thread, whose
CPU time on a GPU is mostly launching kernels. A step's record is written once its last event
and the ends of its side-stream spans have completed (asked with ``query()``, never waited
for), and every record at the end.

Compute is measured, not inferred from spans: on CPU a rank's kernels run on its main thread
(``run.threads: 1``, what torchrun gives each rank by default) and a rank blocked in a gloo
collective sleeps, so the main thread's CPU time is its own compute and the rest of the step
is waiting: asleep in a collective, or, on a busy machine, ready to compute while other work
holds the cores (``cpu_wait``: a rank's compute then ends that much later on the wall clock).
``freescale.profile.bubbles`` turns the records into the bubble measures.

Every span is also a ``torch.profiler.record_function`` range named ``freescale.<kind>`` (and
the balancer's ``freescale.balance``, the replica layer's ``freescale.catch_up``, the pipelines'
``freescale.exclusive_send`` / ``collision_send`` / ``deferred_send``), so a ``torch.profiler``
trace (``profile.trace_steps`` writes one per rank, ``profile/trace_rank<r>.json``, which
Perfetto and HolisticTraceAnalysis open) shows FreeScale's phases beside the kernels.

Recording never blocks training: spans are a few ``time.time()`` calls, and each step is one
buffered line appended to ``<run>/profile/rank<r>.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch

PROFILE_DIR = "profile"
COMPUTE_KINDS = ("forward", "backward", "optimizer")
WAIT_KINDS = ("data", "input_dist", "id_wait", "flags_wait", "exclusive_wait", "collision_wait", "vote")


def rank_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, PROFILE_DIR, f"rank{rank}.jsonl")


class CpuWaitClock:
    """The calling thread's time ready to run but waiting for a core, in seconds (the run delay
    Linux keeps per thread, ``/proc/thread-self/schedstat``'s second field), read through a
    descriptor opened once: ``read()`` costs about a microsecond. ``None`` from ``open`` where
    the kernel does not report it."""

    PATH = "/proc/thread-self/schedstat"

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def open(cls) -> "CpuWaitClock | None":
        try:
            clock = cls(os.open(cls.PATH, os.O_RDONLY))
        except OSError:
            return None
        try:
            clock.read()
        except (OSError, ValueError, IndexError):
            clock.close()
            return None
        return clock

    def read(self) -> float:
        return int(os.pread(self.fd, 128, 0).split()[1]) / 1e9

    def close(self) -> None:
        os.close(self.fd)


def phase(kind: str):
    """A ``torch.profiler`` range for a FreeScale phase (a context manager)."""
    return torch.profiler.record_function(f"freescale.{kind}")


class DeviceClock:
    """Events on a device's streams (``torch.get_device_module(device)``; ``new_event`` lets a
    test give its own)."""

    def __init__(self, device: torch.device | str, new_event=None) -> None:
        self.device = torch.device(device)
        if new_event is None:
            module = torch.get_device_module(self.device)
            new_event = lambda: module.Event(enable_timing=True)  # noqa: E731
            self._current = lambda: module.current_stream(self.device)  # noqa: E731
        else:
            self._current = lambda: None  # noqa: E731
        self.new_event = new_event

    def mark(self, stream=None):
        """An event recorded now on ``stream`` (default: the current stream)."""
        event = self.new_event()
        event.record(stream if stream is not None else self._current())
        return event


def device_compute(spans: list) -> float:
    """Seconds inside compute spans (``COMPUTE_KINDS``) and outside wait spans (``WAIT_KINDS``)."""
    def union(kinds):
        merged = []
        for s, e in sorted((s, e) for k, s, e in spans if k in kinds and e > s):
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        return merged

    waits = union(WAIT_KINDS)
    total = 0.0
    for s, e in union(COMPUTE_KINDS):
        total += e - s - sum(max(0.0, min(e, we) - max(s, ws)) for ws, we in waits)
    return total


class StepTimeline:
    """Records one rank's steps. Only the main thread records."""

    def __init__(self, path: str, *, rank: int, world_size: int, clock_offset: float, threads: int,
                 trace_steps: list[int] | None = None, trace_path: str = "",
                 device_clock: DeviceClock | None = None) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.rank = rank
        self.offset = clock_offset
        self._file = open(path, "a", buffering=1 << 16)
        self._write({"meta": {"rank": rank, "world_size": world_size, "clock_offset": clock_offset,
                              "threads": threads, "host": os.uname().nodename}})
        self._in_step = False
        self._spans: list = []
        self._open: dict[str, tuple] = {}  # kind -> (start, thread CPU, profiler range)
        self._span_cpu: dict[str, float] = {}
        self._trace_steps = trace_steps or []
        self._trace_path = trace_path
        self._torch_profiler = None
        self._clock = device_clock
        self._device_open: dict[str, object] = {}
        self._device_spans: list = []
        self._pending: list = []  # (record, first event, spans' events, last event) not yet written
        self._cpu_wait = CpuWaitClock.open()  # this (the main) thread's wait for a core

    def now(self) -> float:
        return time.time() + self.offset

    # Steps ---------------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """``step`` is the number the step will have once done (1-based)."""
        if self._trace_steps and step == self._trace_steps[0]:
            # Recording every step of the window; a schedule makes the profiler mark each step
            # (ProfilerStep#N ranges, which trace tools such as HolisticTraceAnalysis key on),
            # numbered as training numbers them (the profiler counts from 0 at its start).
            self._torch_profiler = torch.profiler.profile(record_shapes=False,
                                                          schedule=lambda _: torch.profiler.ProfilerAction.RECORD)
            self._torch_profiler.step_num = step
            self._torch_profiler.__enter__()
        self._spans = []
        self._open = {}
        self._notes = {}
        self._span_cpu = {}
        self._data_cpu = 0.0
        self._data_cpu_wait = 0.0
        self._in_step = True
        self._cpu0 = time.thread_time()
        self._cpu_wait0 = self._waited_for_core()
        self._process_cpu0 = time.process_time()
        self._start = self.now()
        if self._clock is not None:
            self._device_open = {}
            self._device_spans = []
            self._device_start = self._clock.mark()

    def end_step(self, step: int, output) -> None:
        for _, _, marker in self._open.values():  # a span left open ends with its step in a trace
            marker.__exit__(None, None, None)
        self._open = {}
        end = self.now()
        cpu = time.thread_time() - self._cpu0
        process_cpu = time.process_time() - self._process_cpu0
        self._in_step = False
        record = {
            "step": step, "start": self._start, "end": end, "cpu": cpu, "data_cpu": self._data_cpu,
            "process_cpu": process_cpu, "span_cpu": self._span_cpu,
            "spans": self._spans, "samples": int(output.sample_ids.numel()),
            "uih_tokens": int(output.uih_lengths.sum()), **self._notes,
        }
        if self._cpu_wait is not None:
            record["cpu_wait"] = self._waited_for_core() - self._cpu_wait0
            record["data_cpu_wait"] = self._data_cpu_wait
        if self._clock is None:
            self._write(record)
        else:
            self._pending.append((record, self._device_start, self._device_spans, self._clock.mark()))
            self._write_completed(wait=False)
        if self._torch_profiler is not None and step == self._trace_steps[1]:
            self._torch_profiler.__exit__(None, None, None)  # (no step() first: it would open the next step's range)
            self._torch_profiler.export_chrome_trace(self._trace_path)
            self._torch_profiler = None
        elif self._torch_profiler is not None:
            self._torch_profiler.step()

    # Spans ---------------------------------------------------------------------------------

    def open(self, kind: str) -> None:
        if self._in_step:
            marker = phase(kind)
            marker.__enter__()
            self._open[kind] = (self.now(), time.thread_time(), marker)
            if self._clock is not None:
                self._device_open[kind] = self._clock.mark()

    def note(self, key: str, value) -> None:
        """Add ``key`` to this step's record (summed if noted again in the step)."""
        if self._in_step:
            self._notes[key] = self._notes.get(key, 0) + value

    def close(self, kind: str) -> None:
        opened = self._open.pop(kind, None)
        if opened is not None:
            start, cpu, marker = opened
            marker.__exit__(None, None, None)
            self._spans.append([kind, start, self.now()])
            self._span_cpu[kind] = self._span_cpu.get(kind, 0.0) + time.thread_time() - cpu
            first = self._device_open.pop(kind, None)
            if first is not None:
                self._device_spans.append((kind, first, self._clock.mark()))

    @contextmanager
    def device_span(self, kind: str, stream):
        """A profiler range for the block, and on a GPU the device time of the work issued to
        ``stream`` inside it (on CPU that work is the transport's threads')."""
        if not self._in_step:
            yield
            return
        with phase(kind):
            if self._clock is None or stream is None:
                yield
                return
            first = self._clock.mark(stream)
            try:
                yield
            finally:
                self._device_spans.append((kind, first, self._clock.mark(stream)))

    def _write_completed(self, wait: bool) -> None:
        """Write the pending steps whose events have all completed, in order (all of them,
        waiting for the device, when ``wait``). A span on a side stream may end after the
        step's last event on the current stream (an exchange left running into the next step),
        and a duration needs both of its events complete: every span's end is asked too."""
        while self._pending:
            record, first, spans, last = self._pending[0]
            ends = [last, *(end for _, _, end in spans)]
            if wait:
                for end in ends:
                    end.synchronize()
            elif not all(end.query() for end in ends):
                return
            self._pending.pop(0)
            at = lambda event: record["start"] + first.elapsed_time(event) / 1000.0  # noqa: E731
            record["device_spans"] = [[kind, at(e0), at(e1)] for kind, e0, e1 in spans]
            record["device_step"] = first.elapsed_time(last) / 1000.0
            record["device_compute"] = device_compute(record["device_spans"])
            self._write(record)

    @contextmanager
    def span(self, kind: str):
        self.open(kind)
        try:
            yield
        finally:
            self.close(kind)

    def timed_batches(self, batches: Iterator) -> Iterator:
        """Wrap the loader iterator: time in ``next()`` is the ``data`` span."""
        for_cpu, for_core = time.thread_time, self._waited_for_core
        while True:
            cpu0, core0 = for_cpu(), for_core()
            self.open("data")
            try:
                batch = next(batches)
            finally:
                self.close("data")
                self._data_cpu += for_cpu() - cpu0
                self._data_cpu_wait += for_core() - core0
            yield batch

    def _waited_for_core(self) -> float:
        return self._cpu_wait.read() if self._cpu_wait is not None else 0.0

    def finish(self) -> None:
        self._write_completed(wait=True)
        self._file.close()
        if self._cpu_wait is not None:
            self._cpu_wait.close()
            self._cpu_wait = None

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")


class NullTimeline:
    """Profiling disabled: every call does nothing."""

    rank = 0

    def begin_step(self, step: int) -> None:
        pass

    def end_step(self, step: int, output) -> None:
        pass

    def open(self, kind: str) -> None:
        pass

    def close(self, kind: str) -> None:
        pass

    def span(self, kind: str):
        return nullcontext()

    def device_span(self, kind: str, stream):
        return nullcontext()

    def note(self, key: str, value) -> None:
        pass

    def timed_batches(self, batches: Iterator) -> Iterator:
        return batches

    def finish(self) -> None:
        pass


def instrument_phases(timeline, model: torch.nn.Module, optimizer) -> None:
    """Forward / backward / optimizer spans from module hooks and the optimizer's step."""
    model.register_forward_pre_hook(lambda *_: timeline.open("forward"))

    def after_forward(*_):
        timeline.close("forward")
        timeline.open("backward")

    model.register_forward_hook(after_forward)
    step = optimizer.step

    def timed_step(*args, **kwargs):
        timeline.close("backward")
        with timeline.span("optimizer"):
            return step(*args, **kwargs)

    optimizer.step = timed_step


def read_timelines(run_dir: str) -> tuple[dict[int, dict], dict[int, list[dict]]]:
    """(meta by rank, step records by rank) from a run folder's profile/rank<r>.jsonl files."""
    folder = os.path.join(run_dir, PROFILE_DIR)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no step timelines in {run_dir} (expected {folder}/rank<r>.jsonl; "
                                "train with profile.enable=true)")
    metas, steps = {}, {}
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("rank") and name.endswith(".jsonl")):
            continue
        rank = int(name[4:-6])
        records = steps.setdefault(rank, [])
        with open(os.path.join(folder, name)) as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                if "meta" in rec:
                    metas[rank] = rec["meta"]
                    records.clear()  # a resumed run appends; keep the latest launch
                else:
                    records.append(rec)
    if not steps:
        raise FileNotFoundError(f"no step timelines in {folder}")
    return metas, steps


def build_timeline(cfg, run_dir: str, *, rank: int, world_size: int, threads: int, device: torch.device, group):
    """A StepTimeline for this rank when ``profile.enable``, else a NullTimeline (clocks agreed on ``group``)."""
    if not cfg.enable:
        return NullTimeline()
    from freescale.distributed import estimate_clock_offset
    from freescale.logging import get_logger

    clock = DeviceClock(device) if device.type != "cpu" else None
    if threads > 1 and clock is None:
        get_logger().warning(f"profile: compute is the main thread's CPU time; with {threads} intra-op threads "
                             "per rank it misses the others' work (set run.threads=1 for exact bubbles)")

    trace = os.path.join(run_dir, PROFILE_DIR, f"trace_rank{rank}.json")
    return StepTimeline(rank_file(run_dir, rank), rank=rank, world_size=world_size, clock_offset=estimate_clock_offset(group),
                        threads=threads, trace_steps=cfg.trace_steps, trace_path=trace,
                        device_clock=clock)
