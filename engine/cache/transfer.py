"""The transfer engine: expert loads that run while the forward pass computes.

A prefetch is a *job*: copy one expert from the store into a slot the provider has already claimed
(state LOADING, so nothing evicts or reads it). The provider is the only one that changes the slot
pool; a job only writes the slot's bytes and then says it is done. Two engines behind one interface:

* `InlineTransfer` runs a job where it is submitted, on the forward thread: no overlap, but the
  same scheduling, counting and prediction, so it is the slow obvious baseline of the threaded one.
* `ThreadTransfer` runs jobs on one worker thread, in submission order. Disk reads (`os.preadv`) and
  tensor copies release the GIL, so the read of layer l+1's experts overlaps layer l's compute. On
  CUDA the worker issues the copies on a dedicated copy stream, after waiting (on the device, not the
  host) for the compute work enqueued before the job was submitted, since the slot it writes may
  have been read by that work; it then records an event the compute stream waits on before it uses
  the slot (`Job.wait_device`), so the host never blocks on a copy it does not need yet.

Jobs can be cancelled before they start; a job that started runs to completion (a half-written slot
is never published: the provider releases the slot of a cancelled or failed job). `quiesce()` cancels
what is queued, waits for what runs, and joins the worker: after it no thread touches the store or
the slots, which is what the provider does when generation stops.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

PENDING, RUNNING, DONE, CANCELLED, FAILED = "pending", "running", "done", "cancelled", "failed"


class Job:
    """One expert load: `fn()` writes the bytes; the job records how it ended."""

    __slots__ = ("key", "slot", "fn", "state", "error", "result", "_done", "_lock", "_ready_event", "_copy_event",
                 "_device")

    def __init__(self, key: tuple[int, int], slot: int, fn: Callable[[], object]):
        self.key = key
        self.slot = slot
        self.fn = fn
        self.state = PENDING
        self.error: BaseException | None = None
        self.result = None  # what fn returned
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._ready_event = None  # CUDA: compute work the copy must wait for
        self._copy_event = None  # CUDA: recorded on the copy stream after the copy
        self._device = None  # CUDA: the device whose compute stream uses the slot

    def cancel(self) -> bool:
        """Cancel if it has not started; True if it will never run."""
        with self._lock:
            if self.state == PENDING:
                self.state = CANCELLED
                self._done.set()
                return True
            return self.state == CANCELLED

    def _start(self) -> bool:
        with self._lock:
            if self.state != PENDING:
                return False
            self.state = RUNNING
            return True

    def _finish(self, error: BaseException | None, result=None) -> None:
        with self._lock:
            self.result = result
            self.error = error
            self.state = FAILED if error is not None else DONE
            self._done.set()

    def run(self, after: Callable[[], None] | None = None) -> bool:
        """Run fn here unless cancelled, then `after` (before anyone sees the job done); its result or error
        is kept for the provider. True if fn ran."""
        if not self._start():
            return False
        try:
            result = self.fn()
            if after is not None:
                after()
        except BaseException as e:  # noqa: BLE001 - kept: the provider frees the slot; a demand load re-reads
            self._finish(e)
        else:
            self._finish(None, result)
        return True

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> float:
        """Block until the job ended (done, failed or cancelled); returns the seconds waited."""
        if self._done.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._done.wait()
        return time.perf_counter() - t0

    def wait_device(self) -> None:
        """CUDA: make the current stream wait for the copy (no host sync). No-op on CPU."""
        if self._copy_event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._copy_event)  # that device's, not the default


class InlineTransfer:
    """Runs each job at submission, on the caller's thread."""

    name = "inline"

    def __init__(self, device: torch.device):
        self.device = device

    def submit(self, job: Job) -> Job:
        job.run()
        return job

    def quiesce(self) -> None:
        pass

    def close(self) -> None:
        pass


class ThreadTransfer:
    """One worker thread running jobs in order; on CUDA, copies go on a dedicated copy stream."""

    name = "thread"

    def __init__(self, device: torch.device, thread_name: str = "moechat-prefetch"):
        self.device = device
        self.thread_name = thread_name
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._jobs: list[Job] = []  # submitted and not yet known to have ended
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def submit(self, job: Job) -> Job:
        if self._stream is not None:
            job._ready_event = torch.cuda.Event()
            job._ready_event.record(torch.cuda.current_stream(self.device))
            job._copy_event = torch.cuda.Event()
            job._device = self.device
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()
        self._jobs = [j for j in self._jobs if not j.done()]
        self._jobs.append(job)
        self._queue.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._stream is None:
                job.run()  # a job cancelled while queued does nothing
                continue
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(job._ready_event)
                # The copy event is recorded before the job reads as done: whoever sees it done can wait on it.
                job.run(after=partial(job._copy_event.record, self._stream))

    def quiesce(self) -> None:
        """Cancel queued jobs, wait for the running one, and stop the worker thread."""
        for job in self._jobs:
            job.cancel()
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join()
        self._thread = None
        for job in self._jobs:
            job.wait()
        self._jobs = []

    def close(self) -> None:
        self.quiesce()


def make_transfer(kind: str, device: torch.device):
    if kind == "inline":
        return InlineTransfer(device)
    if kind == "thread":
        return ThreadTransfer(device)
    raise ValueError(f"unknown transfer engine {kind!r}: choose inline or thread")


class CopyStream:
    """A layer's demand misses, all issued together on a dedicated CUDA copy stream once its routing is known.

    `begin()` makes the copy stream wait (on the device) for the compute work enqueued so far, which may still read
    the victims' slots; `copy(dst, src)` enqueues one host->device copy; `record()` marks the end of one expert's
    copy with its own event, and `wait(event)` makes the compute stream wait for exactly that expert. The host
    never blocks: the layer's hits compute while the misses cross the link."""

    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def record(self, key=None):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event, key=None) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


class RecordingStream:
    """The same protocol on a CPU, for tests of its ordering: each copy is done at once and every call is logged
    (`log`: ("begin",), ("copy", nbytes), ("record", key), ("wait", key)). A real-CUDA `gpu` test checks the
    same order with `CopyStream`."""

    name = "recording"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.log: list[tuple] = []

    def begin(self) -> None:
        self.log.append(("begin",))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.log.append(("copy", dst.numel() * dst.element_size()))

    def record(self, key=None):
        self.log.append(("record", key))
        return key

    def wait(self, event, key=None) -> None:
        self.log.append(("wait", key))


def make_copy_stream(device: torch.device):
    """The demand-miss copy stream of a device: CUDA's own, else None (a CPU copies where it computes)."""
    return CopyStream(device) if device.type == "cuda" else None
