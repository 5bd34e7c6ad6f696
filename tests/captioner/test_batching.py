"""The one batcher (captioner/batching.py) that the web app and `captioner serve` share: slots
taken in order, waiting jobs of one key run together, a window to gather them, a bounded line
and a deadline for waiting in it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from captioner.batching import CoreShare, Gate, QueueFull, WaitedTooLong
from tests.builders import hold_gate as _hold


def _next_job_gets_a_turn(gate) -> bool:
    """Whether a job started now on another thread gets its turn within 5 s."""
    done = threading.Event()
    threading.Thread(target=gate.run, args=(None, 0, lambda items: done.set() or items), daemon=True).start()
    return done.wait(5)


def test_the_gate_lets_slots_jobs_run_at_once_and_the_rest_wait_in_order():
    gate = Gate(slots=2)
    running, most, order, told, waited = [0], [0], [], {}, {}
    lock = threading.Lock()
    done = {i: threading.Event() for i in range(6)}  # each job holds its slot until told to finish

    def work(items):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            order.extend(items)
        for i in items:
            done[i].wait(10)
        with lock:
            running[0] -= 1
        return items

    def job(i: int) -> None:
        waited[i] = gate.run(None, i, work, on_wait=lambda ahead: told.__setitem__(i, ahead)).waited

    def until(condition) -> None:
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.001)

    threads = []
    for i in range(6):
        threads.append(threading.Thread(target=job, args=(i,)))
        threads[-1].start()
        until(lambda: i in order if i < 2 else i in told)  # arrive in order: running or waiting first
    assert told == {2: 2, 3: 3, 4: 4, 5: 5}  # jobs ahead, running included
    for i in range(4):  # each finished job lets in the first in line, and only it
        done[i].set()
        until(lambda: i + 2 in order)
        assert order == list(range(i + 3))
    done[4].set()
    done[5].set()
    for t in threads:
        t.join(10)
    assert most[0] == 2 and order == list(range(6))
    assert all(w >= 0 for w in waited.values()) and waited[5] > waited[0]


def test_a_job_that_fails_gives_its_turn_back():
    gate = Gate(slots=1)

    def work(items):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        gate.run(None, 0, work)
    assert _next_job_gets_a_turn(gate)


def _queue_behind(gate, jobs: list[tuple[object, int]], work, out: dict) -> list[threading.Thread]:
    """Start gate.run(key, item, work) for each (key, item) in order, each on its own thread, each
    once the one before is in line (the gate's slots are held). ``out[item]``: what each got, or its error."""
    threads, queued = [], threading.Semaphore(0)
    for key, item in jobs:
        def job(key=key, item=item):
            try:
                out[item] = gate.run(key, item, work, on_wait=lambda ahead: queued.release())
            except Exception as e:
                out[item] = e
        threads.append(threading.Thread(target=job))
        threads[-1].start()
        assert queued.acquire(timeout=5)  # in line before the next one comes
    return threads


def test_jobs_waiting_with_the_same_key_run_together_in_order():
    gate = Gate(slots=1, batch=3)
    calls, out = [], {}

    def work(items):
        calls.append(list(items))
        return [10 * i for i in items]

    release = _hold(gate)  # the slot is busy: everything below queues
    threads = _queue_behind(gate, [("a", 1), ("a", 2), ("b", 3), ("a", 4), ("a", 5), ("a", 6)], work, out)
    release.set()
    for t in threads:
        t.join(10)
    # The first in line takes along the next two "a"s; "b" runs alone; the "a"s left after it together.
    assert calls == [[1, 2, 4], [3], [5, 6]]
    assert {i: o.result for i, o in out.items()} == {i: 10 * i for i in range(1, 7)}  # each its own result
    assert all(o.waited >= 0 and o.cpu >= 0 for o in out.values())
    assert _next_job_gets_a_turn(gate)


def test_an_error_in_a_batch_reaches_each_of_its_jobs_and_the_slot_is_given_back():
    gate = Gate(slots=1, batch=4)
    out = {}

    def work(items):
        raise RuntimeError("out of memory")

    release = _hold(gate)
    threads = _queue_behind(gate, [("a", 1), ("a", 2), ("a", 3)], work, out)
    release.set()
    for t in threads:
        t.join(10)
    assert all(isinstance(out[i], RuntimeError) and "out of memory" in str(out[i]) for i in (1, 2, 3))
    assert _next_job_gets_a_turn(gate)


def test_a_job_stopped_while_queued_leaves_its_place_to_the_next():
    """Streamlit stops a run (a new upload, a closed page) by raising at its next command: the
    waiting message itself may raise. The queued job's place must not be lost with it."""
    gate = Gate(slots=1)
    release = _hold(gate)

    def stopped(ahead: int) -> None:
        raise KeyboardInterrupt("the page was closed")

    with pytest.raises(KeyboardInterrupt):
        gate.run(None, 1, lambda items: items, on_wait=stopped)
    release.set()
    assert _next_job_gets_a_turn(gate)


def _arrive(gate, key, item, work, out: dict, **kw) -> threading.Thread:
    def job():
        try:
            out[item] = gate.run(key, item, work, **kw)
        except Exception as e:
            out[item] = e
    t = threading.Thread(target=job)
    t.start()
    return t


def test_a_job_waits_max_wait_for_others_to_arrive_and_runs_them_in_its_batch():
    """Nothing queued when the first comes: with a window it waits for the others, not alone."""
    gate = Gate(slots=1, batch=4, max_wait=0.5)
    calls, out = [], {}

    def work(items):
        calls.append(list(items))
        return items

    threads = [_arrive(gate, "a", 1, work, out)]
    time.sleep(0.05)
    threads += [_arrive(gate, "a", i, work, out) for i in (2, 3)]
    for t in threads:
        t.join(10)
    assert sorted(map(sorted, calls)) == [[1, 2, 3]] and calls[0][0] == 1


def test_a_full_batch_starts_without_waiting_out_the_window():
    gate = Gate(slots=1, batch=2, max_wait=30)
    out = {}
    began = time.perf_counter()
    threads = [_arrive(gate, "a", i, lambda items: items, out) for i in (1, 2)]
    for t in threads:
        t.join(10)
    assert time.perf_counter() - began < 5 and {out[1].result, out[2].result} == {1, 2}


def test_without_a_window_a_lone_job_runs_at_once():
    gate = Gate(slots=1, batch=8)
    began = time.perf_counter()
    assert gate.run("a", 1, lambda items: items).result == 1
    assert time.perf_counter() - began < 0.5


def test_a_job_that_queued_behind_a_window_gets_a_free_slot_when_it_ends():
    """A job of another key that came while a batch gathered is not left in line while a slot is free."""
    gate = Gate(slots=2, batch=3, max_wait=0.3)
    out, release = {}, threading.Event()

    def held(items):
        release.wait(10)
        return items

    threads = [_arrive(gate, "a", 1, held, out)]
    time.sleep(0.05)
    threads.append(_arrive(gate, "a", 2, held, out))  # joins 1's batch
    time.sleep(0.05)
    threads.append(_arrive(gate, "b", 3, lambda items: items, out))  # queued behind the gathering one
    threads[-1].join(5)
    assert out.get(3) is not None and out[3].result == 3  # ran beside the held batch of 1 and 2
    release.set()
    for t in threads:
        t.join(10)
    assert out[1].size == 2 and out[2].result == 2


def test_a_full_line_refuses_at_once_and_says_so():
    gate = Gate(slots=1, max_queue=2)
    release = _hold(gate)
    out = {}
    queued = threading.Semaphore(0)
    threads = [_arrive(gate, None, i, lambda items: items, out, on_wait=lambda ahead: queued.release())
               for i in (1, 2)]
    for _ in threads:
        assert queued.acquire(timeout=5)
    assert gate.full and gate.queued == 2
    began = time.perf_counter()
    with pytest.raises(QueueFull):
        gate.run(None, 3, lambda items: items)
    assert time.perf_counter() - began < 1
    release.set()
    for t in threads:
        t.join(10)
    assert out[1].result == 1 and out[2].result == 2 and not gate.full


def test_a_job_still_in_line_after_its_timeout_leaves_the_line():
    gate = Gate(slots=1, max_queue=1)
    release = _hold(gate)
    began = time.perf_counter()
    with pytest.raises(WaitedTooLong):
        gate.run(None, 1, lambda items: items, timeout=0.1)
    assert 0.1 <= time.perf_counter() - began < 2
    assert gate.queued == 0  # its place is free for the next
    release.set()
    assert _next_job_gets_a_turn(gate)


def test_a_timeout_that_comes_after_the_job_began_lets_it_finish():
    gate = Gate(slots=1)

    def slow(items):
        time.sleep(0.3)
        return items

    assert gate.run(None, 1, slow, timeout=0.05).result == 1


def test_a_window_waits_only_while_a_job_is_on_its_way():
    """A server announces a request as it reads it: a lone job does not wait out the window for
    mates that are not coming, and does wait for one that was announced."""
    gate = Gate(slots=1, batch=4, max_wait=5, announced=True)
    began = time.perf_counter()
    gate.announce()
    assert gate.run("a", 1, lambda items: items, announced=True).size == 1  # nothing else on its way
    assert time.perf_counter() - began < 1
    out = {}
    gate.announce()
    gate.announce()  # a second request, still being read
    first = _arrive(gate, "a", 1, lambda items: items, out, announced=True)
    time.sleep(0.2)
    assert 1 not in out  # it waits for the announced one
    out[2] = gate.run("a", 2, lambda items: items, announced=True)
    first.join(10)
    assert out[1].size == 2 and out[2].size == 2
    gate.announce()
    gate.withdraw()  # announced, then refused before it joined the line: nothing waits for it
    began = time.perf_counter()
    assert gate.run("a", 3, lambda items: items).size == 1 and time.perf_counter() - began < 1


@pytest.mark.parametrize("slots", [1, 2])
def test_the_batches_run_on_the_gates_own_threads_one_a_slot_whoever_asks(slots):
    """Torch keeps its compute threads per calling thread: the batches must not run on the
    callers' threads, one new pool a request, but on as many threads as the gate has slots."""
    gate = Gate(slots=slots)
    ran_on, callers = set(), set()
    lock = threading.Lock()

    def work(items):
        with lock:
            ran_on.add(threading.current_thread())
        time.sleep(0.002)
        return items

    def job(i: int) -> None:
        callers.add(threading.current_thread())  # the objects: an ended thread's ident is reused
        assert gate.run(None, i, work).result == i

    for _ in range(3):  # three waves of ten callers, each on a thread of its own
        threads = [threading.Thread(target=job, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(callers) >= 10 and 1 <= len(ran_on) <= slots and not ran_on & callers  # a thread is made as needed


@pytest.mark.parametrize("slots", [1, 3])
def test_on_each_thread_reaches_every_thread_the_batches_then_run_on(slots):
    gate = Gate(slots=slots)
    warmed = []
    gate.on_each_thread(lambda: warmed.append(threading.get_ident()))
    assert len(warmed) == len(set(warmed)) == slots
    ran_on, release = set(), threading.Event()

    def work(items):
        ran_on.add(threading.get_ident())
        release.wait(5)
        return items

    threads = [threading.Thread(target=gate.run, args=(None, i, work)) for i in range(2 * slots)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    release.set()
    for t in threads:
        t.join()
    assert ran_on == set(warmed)


def test_counts_below_one_are_taken_as_one():
    gate = Gate(slots=0, threads=0, batch=0)
    assert (gate.slots, gate.threads, gate.batch) == (1, 1, 1)
    plain = Gate(slots=2)  # by default one torch thread a batch, one job a batch, no window
    assert (plain.threads, plain.batch, plain.max_wait) == (1, 1, 0.0)
    assert gate.run("k", 7, lambda items: [i * 2 for i in items]).result == 14


def test_a_window_of_a_batch_of_two_waits_for_its_mate_and_ends_on_time():
    gate = Gate(slots=1, batch=2, max_wait=0.4)
    out = {}
    first = _arrive(gate, "k", 1, lambda items: time.sleep(0.05) or items, out)
    time.sleep(0.1)
    out[2] = gate.run("k", 2, lambda items: items)
    first.join(5)
    assert out[1].size == out[2].size == 2  # the second came within the window: one batch
    began = time.perf_counter()
    alone = gate.run("k", 3, lambda items: time.sleep(0.05) or items)
    waited = time.perf_counter() - began
    assert alone.size == 1 and 0.35 < waited < 0.9  # no mate: the window (0.4 s), then the batch
    assert 0.04 < alone.seconds < 0.4  # the batch's own wall time, not the wait before it


def test_a_batch_alone_takes_every_core_and_batches_at_once_share_them():
    """CoreShare: the threads a batch starting now may use are the cores divided among the
    batches running then, itself included; a batch that ends gives its share back."""
    share = CoreShare(4)
    with share.batch() as alone:
        assert alone == 4
        with share.batch() as second:
            assert second == 2
            with share.batch() as third:
                assert third == 1  # never fewer than one, never more than the cores
            with share.batch() as again:
                assert again == 1  # 4 // 3 batches running
        with share.batch() as after:
            assert after == 2
    with share.batch() as last:
        assert last == 4
    assert share.running == 0


def test_a_batch_that_raises_gives_its_share_back():
    share = CoreShare(2)
    with pytest.raises(ValueError):
        with share.batch():
            raise ValueError("the model failed")
    assert share.running == 0
    with share.batch() as threads:
        assert threads == 2


def test_forked_processes_count_each_others_batches():
    """Across processes forked after it is made (`captioner serve --processes`): a child's batch
    is counted by the parent's next one."""
    share = CoreShare(2, processes=2)
    started, finish = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the child holds a batch until told
        code = 1
        try:
            with share.batch() as threads:
                os.write(started[1], bytes([threads]))
                os.read(finish[0], 1)
            code = 0
        finally:
            os._exit(code)
    try:
        assert os.read(started[0], 1) == bytes([2])
        with share.batch() as threads:
            assert threads == 1 and share.running == 2
    finally:
        os.write(finish[1], b"x")
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert share.running == 0


def test_a_job_handed_the_slot_after_waiting_in_line_waits_for_one_on_its_way():
    """The window counts from when a job may run, not from when it asked: under load a job that
    waited in line behind a batch still takes along a request being read when its turn comes
    (else each batch ran with the few that had finished decoding: batches of 1 to 4 of 16)."""
    gate = Gate(slots=1, batch=4, max_wait=0.4, announced=True)
    release, out = threading.Event(), {}

    def held(items):
        release.wait(10)
        return items

    gate.announce()
    first = _arrive(gate, "a", 1, held, out, announced=True)
    time.sleep(0.1)
    gate.announce()
    second = _arrive(gate, "a", 2, lambda items: items, out, announced=True)  # in line behind the held batch
    time.sleep(0.6)  # longer than the window after it asked
    gate.announce()  # a third request, still being read when the slot is handed over
    release.set()
    first.join(10)
    time.sleep(0.1)
    out[3] = gate.run("a", 3, lambda items: items, announced=True)
    second.join(10)
    assert out[1].size == 1 and out[2].size == 2 and out[3].size == 2


def _started(gate, key, item, out: dict, running: set, release: threading.Event, **kw) -> threading.Thread:
    """A job whose work records that it runs, then holds until ``release``."""
    def work(items):
        running.update(items)
        release.wait(10)
        return items
    return _arrive(gate, key, item, work, out, **kw)


def test_a_slot_given_back_to_an_empty_line_is_one_slot():
    """After a batch ends with nobody waiting, the gate still runs one batch at a time."""
    gate = Gate(slots=1)
    assert gate.run("a", 0, lambda items: items).result == 0
    out, running, release = {}, set(), threading.Event()
    threads = [_started(gate, None, i, out, running, release) for i in (1, 2)]
    time.sleep(0.3)
    assert len(running) == 1 and gate.queued == 1  # the other waits in line for the slot
    release.set()
    for t in threads:
        t.join(10)
    assert running == {1, 2}


def test_a_slot_handed_to_a_job_that_queued_behind_a_gathering_is_counted():
    """A job of another key that queued behind a gathering batch gets the free slot when the
    window ends; that slot is taken: a job that comes next waits in line while both run."""
    gate = Gate(slots=2, batch=3, max_wait=0.3)
    out, running, release = {}, set(), threading.Event()
    threads = [_started(gate, "a", 1, out, running, release)]
    time.sleep(0.05)
    threads.append(_started(gate, "a", 2, out, running, release))  # joins 1's batch
    time.sleep(0.05)
    threads.append(_started(gate, "b", 3, out, running, release))  # in line behind the gathering one
    time.sleep(0.6)  # the window has ended: 1 and 2 run, 3 was handed the second slot
    assert running == {1, 2, 3}
    threads.append(_started(gate, "c", 4, out, running, release))
    time.sleep(0.3)
    assert 4 not in running and gate.queued == 1  # both slots are taken: it waits in line
    release.set()
    for t in threads:
        t.join(10)
    assert 4 in running and out[1].size == 2 and out[3].size == 1


def test_each_job_is_told_how_long_it_waited_and_its_share_of_the_batch_s_cpu():
    gate = Gate(slots=1, batch=2, max_wait=0.2)
    out, release = {}, threading.Event()

    def spin(items):  # 0.2 s of this thread's CPU, whatever else runs
        release.wait(10)
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass
        return items

    first = _arrive(gate, "a", 1, spin, out)
    time.sleep(0.3)  # 1 runs (its window ended), held
    threads = [_arrive(gate, "a", i, spin, out) for i in (2, 3)]  # in line behind it, then one batch
    time.sleep(0.3)
    release.set()
    for t in (first, *threads):
        t.join(10)
    assert out[1].waited < 0.28 and 0.35 < out[2].waited < 5 and 0.35 < out[3].waited < 5  # 1: its window
    assert out[2].size == out[3].size == 2
    assert 0.09 < out[2].cpu < 0.15 and 0.18 < out[1].cpu < 0.3  # half the batch's 0.2 s each; 1 alone


@pytest.mark.parametrize("files,expected", [
    ({}, 16),  # no limit found: the CPUs this process may run on
    ({"cpu.max": "max 100000\n"}, 16),  # cgroup v2, no quota
    ({"cpu.max": "200000 100000\n"}, 2),  # a container given 2 CPUs (docker --cpus 2)
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu.max": "6400000 100000\n"}, 16),  # a quota above the CPUs it may run on
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 16),
    ({"cpu.max": "garbage\n"}, 16),
])
def test_the_usable_cores_heed_a_container_s_cpu_quota(tmp_path, monkeypatch, files, expected):
    """A container limited to N CPUs on a larger host sees every CPU in its affinity mask; its
    quota is in the cgroup files. Servers and loaders sized by the host would crowd N CPUs."""
    import captioner.batching as batching

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(batching, "CGROUP", tmp_path)
    monkeypatch.setattr(batching, "_affinity", lambda: 16)
    assert batching.usable_cores() == expected
