"""The local tier's scheduler-side index: dedup, pins, pending stores, LRU."""

from __future__ import annotations

from vllm_kvplugin.tiers.local_cpu import LocalIndex, SlotState


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_pending_is_invisible_until_committed():
    idx = LocalIndex(4, 100)
    slot, evicted = idx.allocate(k(0))
    assert evicted == 0 and not idx.ready(k(0))
    assert idx.allocate(k(0)) is None  # stored once
    idx.commit(slot, ok=True)
    assert idx.ready(k(0)) and not idx.ready(k(1))


def test_failed_store_frees_slot():
    idx = LocalIndex(1, 100)
    slot, _ = idx.allocate(k(0))
    idx.commit(slot, ok=False)
    assert idx.state(slot) is SlotState.FREE and not idx.contains(k(0))
    assert idx.allocate(k(1)) is not None


def test_lru_evicts_unpinned_tail_first():
    idx = LocalIndex(3, 100)
    slots = [idx.allocate(k(i))[0] for i in range(3)]
    for s in slots:
        idx.commit(s, ok=True)
    idx.touch([k(0), k(1), k(2)])  # a prefix: chunk 0 most recent, chunk 2 the oldest
    pinned = idx.pin([k(2)])
    got = idx.allocate(k(9))
    assert got is not None and got[1] == 100
    assert idx.contains(k(2)) and not idx.contains(k(1))  # pinned 2 survived; 1 evicted
    idx.unpin(pinned[0])


def test_full_and_all_pinned_refuses():
    idx = LocalIndex(1, 100)
    s, _ = idx.allocate(k(0))
    idx.commit(s, True)
    idx.pin([k(0)])
    assert idx.allocate(k(1)) is None


def test_drop_while_pinned_frees_after_unpin():
    idx = LocalIndex(2, 100)
    s, _ = idx.allocate(k(0))
    idx.commit(s, True)
    idx.pin([k(0)])
    idx.drop(s)
    assert not idx.ready(k(0)) and idx.state(s) is not SlotState.FREE
    idx.unpin(s)
    assert idx.state(s) is SlotState.FREE


def test_clear_forgets_pinned_and_pending_objects():
    """reset_cache: nothing stored before is found again, also what a load still pins or a
    store has not committed yet; their slots free once released."""
    idx = LocalIndex(3, 100)
    a, _ = idx.allocate(k(0))
    idx.commit(a, True)
    idx.pin([k(0)])
    b, _ = idx.allocate(k(1))  # a store in flight
    idx.clear()
    assert not idx.contains(k(0)) and not idx.contains(k(1))
    idx.commit(b, True)  # the store lands after the reset: never visible
    assert not idx.ready(k(1)) and idx.state(b) is SlotState.FREE
    assert idx.state(a) is not SlotState.FREE
    idx.unpin(a)
    assert idx.state(a) is SlotState.FREE


def test_pool_views_are_the_slots_bytes_made_once():
    """``LocalPool.views``: the slot's payload as bytes and as ``[1, *shape]``, the same memory
    as ``payload`` (a write through one is seen through the others), the same objects each time."""
    import torch

    from vllm_kvplugin.tiers.local_cpu import LocalPool

    pool = LocalPool([(2, 2, 4, 1, 8)], [torch.bfloat16], 3, pin_memory=False)
    data, tensor = pool.views(0, 1)
    assert pool.views(0, 1)[0] is data and pool.views(0, 1)[1] is tensor
    assert tuple(tensor.shape) == (1, 2, 2, 4, 1, 8) and tensor.dtype == torch.bfloat16
    assert data.nbytes == tensor.numel() * 2
    pool.payloads[0].zero_()
    pool.payload(0, 1).view(-1).view(torch.uint8)[5] = 0xA7
    assert data[5] == 0xA7 and tensor.view(-1).view(torch.uint8)[5] == 0xA7
    assert not any(pool.views(0, s)[0].tobytes().strip(b"\0") for s in (0, 2))  # slot 1's alone
