"""The verdict box of a one-process engine: posts taken once, in full, by the engine they name."""

from __future__ import annotations

import gc
import threading

from vllm_kvplugin.connector.verdicts import Posted, find_box, open_box


def test_posts_are_taken_once_and_the_latest_per_request_wins():
    box = open_box("engine-a")
    assert box.take() == Posted() and not box.pending()
    box.post("r1", 1, 8)
    box.post("r2", 2, 0)
    box.post("r1", 3, 5)  # a later fetch of r1: its verdict replaces the earlier one
    assert box.pending()
    posted = box.take()
    assert sorted(posted.verdicts) == [("r1", 3, 5), ("r2", 2, 0)] and posted.bad == {}
    assert box.take() == Posted() and not box.pending()


def test_bad_slots_are_taken_with_the_verdicts_even_when_a_verdict_is_replaced():
    box = open_box("engine-bad")
    box.post("r1", 1, 2, {(0, 7): "checksum"})
    box.post("r1", 2, 3, {(0, 9): "checksum", (1, 7): "bad_header"})  # replaces r1's verdict, not its bad slot
    posted = box.take()
    assert posted.verdicts == [("r1", 2, 3)]
    assert posted.bad == {(0, 7): "checksum", (0, 9): "checksum", (1, 7): "bad_header"}
    assert box.take() == Posted()


def test_store_results_add_up_until_taken():
    box = open_box("engine-stores")
    box.post_stores({(0, 1): 1}, {}, {b"k1": 1})
    assert box.pending()
    box.post_stores({(0, 1): 1, (0, 2): 1}, {(1, 3): 1}, {b"k1": 1, b"k2": 1})
    posted = box.take()
    assert posted.stored == {(0, 1): 2, (0, 2): 1} and posted.store_failed == {(1, 3): 1}
    assert posted.store_done == {b"k1": 2, b"k2": 1} and posted.verdicts == []
    assert box.take() == Posted()


def test_a_worker_finds_only_its_own_engines_box_while_the_scheduler_keeps_it():
    a, b = open_box("engine-x"), open_box("engine-y")
    assert find_box("engine-x") is a and find_box("engine-y") is b
    assert find_box("engine-z") is None  # no scheduler half in this process: the metadata path
    del a
    gc.collect()
    assert find_box("engine-x") is None  # the engine is gone: nothing is posted to it
    assert find_box("engine-y") is b


def test_posts_from_other_threads_are_all_taken():
    box = open_box("engine-threads")
    threads = [threading.Thread(target=lambda i=i: [box.post(f"r{i}-{k}", k, k) for k in range(200)])
               for i in range(4)]
    got = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        got += box.take().verdicts
    for t in threads:
        t.join()
    got += box.take().verdicts
    assert len(got) == 800 and len({rid for rid, _, _ in got}) == 800


def test_the_fetcher_is_held_weakly_and_goes_with_its_worker():
    """A worker half gone (an engine shut down) leaves no fetcher or loader behind for the
    scheduler half."""

    class Worker:
        def fetch_now(self, req, fingerprint, wait_s):
            return (req, fingerprint, wait_s)

        def load_now(self, req, epoch):
            return ("load", req, epoch)

    box = open_box("engine-fetcher")
    assert box.fetcher() is None and box.loader() is None
    w = Worker()
    box.attach_worker(w.fetch_now, w.load_now)
    assert box.fetcher()("r", b"fp", 0.1) == ("r", b"fp", 0.1)
    assert box.loader()("r", 3) == ("load", "r", 3)
    del w
    gc.collect()
    assert box.fetcher() is None and box.loader() is None
