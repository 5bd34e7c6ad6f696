"""The model's gate: how the page's sessions take turns with the model.

A classroom on one small machine: every session's caption goes through one ``Gate``, which
lets as many captions run at once as it has slots (one per core, one torch thread each) and
queues the others in order. When a job's turn comes it takes along the jobs waiting behind it
that can run with it (the same model and settings) and does them all in one batch, so that a
queue drains faster than one caption at a time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass(eq=False)
class _Job:
    """A place in the gate's line. ``key``: jobs with equal keys may run together (None: never)."""

    key: object = None
    item: object = None
    event: threading.Event = field(default_factory=threading.Event)
    asked: float = field(default_factory=time.perf_counter)  # when it joined the line
    state: str = "queued"  # "lead": it was handed a slot; "done": it ran in another job's batch
    out: "Batched | None" = None
    error: BaseException | None = None


@dataclass
class Batched:
    """What ``Gate.run`` gives one job: its result, and what it cost."""

    result: object
    waited: float  # seconds from asking until its batch started
    seconds: float  # the batch's wall time
    cpu: float  # this job's share of the batch's CPU time


class Gate:
    """At most ``slots`` jobs at once; the others wait their turn, first come first served.

    ``run`` batches: a job that gets a slot takes along up to ``batch`` - 1 of the jobs waiting
    behind it that can run with it (an equal key: the same model and settings) and does them all
    in one go. Captioning four images together costs a beam search less than half as much an
    image on one core as one at a time (docs/app-serving.md), so when uploads queue up, the
    queue drains faster."""

    def __init__(self, slots: int, threads: int = 1, batch: int = 1):
        self.slots = max(1, int(slots))
        self.threads = max(1, int(threads))  # torch threads per job
        self.batch = max(1, int(batch))
        self._lock = threading.Lock()
        self._running = 0
        self._queue: deque[_Job] = deque()

    def run(self, key: object, item: object, work: Callable[[list], list],
            on_wait: Callable[[int], None] | None = None) -> Batched:
        """``work([item, ...])`` -> one result per item, for this item and any waiting ones of an equal
        ``key`` (up to ``batch`` in all; a None key runs alone); this item's result. ``on_wait(ahead)``
        is called before waiting, with the number of jobs ahead (running included). An error in
        ``work`` reaches every job of the batch."""
        job = _Job(key, item)
        self._enter(job, on_wait)
        if job.state == "done":
            if job.error is not None:
                raise RuntimeError(str(job.error)) from job.error
            return job.out
        with self._lock:  # a slot held: take along the compatible jobs waiting behind
            mates = [j for j in self._queue if j.key is not None and j.key == key][:self.batch - 1]
            for mate in mates:
                self._queue.remove(mate)
        jobs = [job, *mates]
        began, cpu0 = time.perf_counter(), time.thread_time()
        try:
            results = work([j.item for j in jobs])
        except BaseException as e:
            for mate in mates:
                mate.error, mate.state = e, "done"
                mate.event.set()
            raise
        finally:
            with self._lock:
                self._release()
        seconds, cpu = time.perf_counter() - began, (time.thread_time() - cpu0) / len(jobs)
        for mate, result in zip(mates, results[1:]):
            mate.out = Batched(result, began - mate.asked, seconds, cpu)
            mate.state = "done"
            mate.event.set()
        return Batched(results[0], began - job.asked, seconds, cpu)

    def _enter(self, job: _Job, on_wait: Callable[[int], None] | None) -> None:
        """Return once ``job`` holds a slot ("lead") or has run in another's batch ("done")."""
        with self._lock:
            if self._running < self.slots and not self._queue:
                self._running += 1
                job.state = "lead"
                return
            ahead = self._running + len(self._queue)
            self._queue.append(job)
        try:
            if on_wait is not None:
                on_wait(ahead)
            job.event.wait()  # set by the job that hands its slot over, or that ran this one
        except BaseException:  # stopped while queued (Streamlit raises in the run it stops)
            with self._lock:
                if job in self._queue:
                    self._queue.remove(job)
                elif job.state == "lead":  # handed a slot meanwhile: pass it on
                    self._release()
                # else: taken into a batch; its result is dropped
            raise

    def _release(self) -> None:
        """Give a slot back; the caller holds the lock."""
        if self._queue:
            job = self._queue.popleft()  # the slot goes straight to the next in line
            job.state = "lead"
            job.event.set()
        else:
            self._running -= 1
