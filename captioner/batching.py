"""The one batcher: how concurrent captions take turns with the model, and are made together.

The web app's sessions and `captioner serve`'s requests each go through one ``Gate``, which
lets as many batches run at once as it has slots and queues the other jobs in order. When a
job's turn comes it takes along the jobs waiting behind it that can run with it (the same
model and settings) and does them all in one batch, so that a queue drains faster than one
caption at a time. A server adds what a page's queue does not need: a window in which a job
with a slot waits for others to arrive (``max_wait``), a line of bounded length
(``max_queue``: beyond it a job is refused at once, ``QueueFull``) and a deadline for waiting
in it (``timeout``: ``WaitedTooLong``).

The batches run on the gate's own threads, one a slot, whichever caller's job leads them:
torch keeps its pool of compute threads per calling thread, so a model called from a new
thread each request builds a new pool each time (a caption took 1.5x as long so, docs/serving.md).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

CGROUP = Path("/sys/fs/cgroup")  # where Linux keeps a container's CPU quota


class QueueFull(RuntimeError):
    """The line is as long as the gate allows: the job was not queued; ask again later."""


class WaitedTooLong(TimeoutError):
    """The job was still in line when its timeout ran out: it was taken out, and did not run."""


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
    size: int = 1  # the jobs in its batch


class Gate:
    """At most ``slots`` batches at once; the other jobs wait their turn, first come first served.

    ``run`` batches: a job that gets a slot takes along up to ``batch`` - 1 of the jobs waiting
    behind it that can run with it (an equal key: the same model and settings) and does them all
    in one go. Captioning four images together costs a beam search less than half as much an
    image on one core as one at a time (docs/app-serving.md), so when jobs queue up, the queue
    drains faster. With ``max_wait`` seconds, a job handed a slot before its batch is full waits
    up to that long from then for others of its key to arrive (the jobs that come meanwhile
    join it rather than take another slot), whether it asked just now or queued first.
    ``announced``: callers announce each job as it is on its way (``announce``, then
    ``run(..., announced=True)`` or ``withdraw``), and a window waits only while one is, so that
    a lone job never waits for mates that are not coming.
    ``max_queue``: the most jobs waiting (None: no limit)."""

    def __init__(self, slots: int, threads: int = 1, batch: int = 1, *, max_wait: float = 0.0,
                 max_queue: int | None = None, announced: bool = False):
        self.slots = max(1, int(slots))
        self.threads = max(1, int(threads))  # torch threads per job
        self.batch = max(1, int(batch))
        self.max_wait = max(0.0, float(max_wait))
        self.max_queue = max_queue
        self.announced = announced
        self._coming = 0  # jobs announced that have not joined the line yet
        self.last_seconds = 0.0  # the wall time of the latest batch: what the next one may take
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # told when a job joins the line
        self._running = 0
        self._queue: deque[_Job] = deque()
        self._gathering: list[object] = []  # the keys of the jobs that hold a slot and wait for mates
        self._runner = ThreadPoolExecutor(self.slots, thread_name_prefix="gate")  # where the batches run

    def on_each_thread(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once on each of the threads the batches run on, before any job: a
        server warms its model there (torch's first batch on a thread pays one-off costs)."""
        together = threading.Barrier(self.slots)  # each call holds its thread until all have one
        calls = [self._runner.submit(lambda: (together.wait(), fn())) for _ in range(self.slots)]
        for call in calls:
            call.result()

    @property
    def queued(self) -> int:
        """Jobs in line now (not the running ones)."""
        return len(self._queue)

    @property
    def full(self) -> bool:
        """Whether a job that came now would be refused (``QueueFull``)."""
        return self.max_queue is not None and len(self._queue) >= self.max_queue

    def announce(self) -> None:
        """A job is on its way (a request being read): a gathering batch may wait for it."""
        with self._lock:
            self._coming += 1

    def withdraw(self) -> None:
        """An announced job will not come after all."""
        with self._lock:
            self._came()

    def _came(self) -> None:
        """One announced job came or will not; the caller holds the lock."""
        self._coming = max(0, self._coming - 1)
        self._arrived.notify_all()

    def run(self, key: object, item: object, work: Callable[[list], list],
            on_wait: Callable[[int], None] | None = None, timeout: float | None = None,
            announced: bool = False) -> Batched:
        """``work([item, ...])`` -> one result per item, for this item and any waiting ones of an equal
        ``key`` (up to ``batch`` in all; a None key runs alone); this item's result. ``on_wait(ahead)``
        is called before waiting, with the number of jobs ahead (running included). An error in
        ``work`` reaches every job of the batch. A full line raises ``QueueFull`` at once; a job
        still in line ``timeout`` seconds after it asked raises ``WaitedTooLong`` (once its batch
        has begun, it finishes). ``announced``: this job was announced (``announce``)."""
        job = _Job(key, item)
        self._enter(job, on_wait, timeout, announced)
        if job.state == "done":
            if job.error is not None:
                raise RuntimeError(str(job.error)) from job.error
            return job.out
        mates = self._mates(job)
        jobs = [job, *mates]
        began = time.perf_counter()
        batch = self._runner.submit(_timed, work, [j.item for j in jobs])
        try:
            results, cpu = batch.result()
        except BaseException as e:
            wait_for([batch])  # the slot is not given back while its batch still runs
            for mate in mates:
                mate.error, mate.state = e, "done"
                mate.event.set()
            raise
        finally:
            with self._lock:
                self.last_seconds = time.perf_counter() - began
                self._release()
        seconds, cpu = time.perf_counter() - began, cpu / len(jobs)
        for mate, result in zip(mates, results[1:]):
            mate.out = Batched(result, began - mate.asked, seconds, cpu, len(jobs))
            mate.state = "done"
            mate.event.set()
        return Batched(results[0], began - job.asked, seconds, cpu, len(jobs))

    def _mates(self, job: _Job) -> list[_Job]:
        """The compatible jobs waiting behind ``job``, which holds a slot, taken out of the line: those
        there now, or with ``max_wait`` those that arrive until its batch is full or its window (from
        now) ends."""
        key = job.key
        with self._lock:
            def waiting() -> list[_Job]:
                return [j for j in self._queue if j.key is not None and j.key == key][:self.batch - 1]

            if key is not None and self.batch > 1 and self.max_wait > 0:
                self._gathering.append(key)
                until = time.perf_counter() + self.max_wait  # from its turn: a job that queued waits too
                try:
                    while len(waiting()) < self.batch - 1 and (self._coming or not self.announced):
                        left = until - time.perf_counter()
                        if left <= 0:
                            break
                        self._arrived.wait(left)
                finally:
                    self._gathering.remove(key)
            mates = waiting()
            for mate in mates:
                self._queue.remove(mate)
            self._dispatch()  # jobs that queued behind a gathering one while a slot was free
        return mates

    def _enter(self, job: _Job, on_wait: Callable[[int], None] | None, timeout: float | None,
               announced: bool) -> None:
        """Return once ``job`` holds a slot ("lead") or has run in another's batch ("done")."""
        with self._lock:
            if announced:
                self._came()
            gathered = job.key is not None and any(k == job.key for k in self._gathering)
            if self._running < self.slots and not self._queue and not gathered:
                self._running += 1
                job.state = "lead"
                return
            if self.full:
                raise QueueFull(f"{len(self._queue)} jobs are waiting already, as many as the gate allows")
            ahead = self._running + len(self._queue)
            self._queue.append(job)
            self._arrived.notify_all()
        try:
            if on_wait is not None:
                on_wait(ahead)
            # set by the job that hands its slot over, or that ran this one
            if not job.event.wait(None if timeout is None else max(0.0, job.asked + timeout - time.perf_counter())):
                with self._lock:
                    if job in self._queue:
                        self._queue.remove(job)
                        raise WaitedTooLong(f"still waiting for the model after {timeout:g} s")
                job.event.wait()  # its batch has begun (or it holds a slot): it finishes
        except WaitedTooLong:
            raise
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

    def _dispatch(self) -> None:
        """Hand the free slots to the first in line; the caller holds the lock."""
        while self._running < self.slots and self._queue:
            self._running += 1
            job = self._queue.popleft()
            job.state = "lead"
            job.event.set()


def _timed(work: Callable[[list], list], items: list) -> tuple[list, float]:
    """``work(items)`` and the CPU seconds it took on this thread."""
    cpu = time.thread_time()
    return work(items), time.thread_time() - cpu


class CoreShare:
    """The machine's cores, shared among the batches running at once: a batch that starts takes
    ``cores // running`` compute threads (itself counted, at least one). A batch alone gets every
    core, so that one request is captioned as fast as the machine allows; batches at once (several
    server processes, or several slots) get a core or so each rather than two threads a core,
    which would make each wait on the other's threads. With ``processes`` > 1 the count lives in
    memory shared with processes forked after this is made (``captioner serve --processes``)."""

    def __init__(self, cores: int, processes: int = 1):
        self.cores = max(1, int(cores))
        if processes > 1:
            import multiprocessing

            self._count = multiprocessing.RawValue("i", 0)
            self._lock = multiprocessing.Lock()
        else:
            self._count = _Count()
            self._lock = threading.Lock()

    @property
    def running(self) -> int:
        """Batches running now, in every process sharing this."""
        return self._count.value

    @contextmanager
    def batch(self) -> Iterator[int]:
        """Count a batch as running while the block runs; the threads it may use."""
        with self._lock:
            self._count.value += 1
            running = self._count.value
        try:
            yield max(1, self.cores // running)
        finally:
            with self._lock:
                self._count.value -= 1


@dataclass
class _Count:
    value: int = 0


def _affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _quota() -> float | None:
    """The CPUs this process's cgroup may use (a container's ``--cpus``), or None without a quota."""
    try:
        quota, period = (CGROUP / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000" or "200000 100000"
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota = int((CGROUP / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((CGROUP / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """The cores this process may keep busy: those it may run on, at most its container's CPU
    quota (rounded up). Inside a container given 2 CPUs of a 64-core host, the affinity mask
    alone says 64, and threads or processes sized by it crowd the 2."""
    cores = _affinity()
    quota = _quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores
