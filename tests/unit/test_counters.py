"""``counters.Counters``: what vLLM's stats pipeline takes every step is exactly what was added
since the previous take (failures by reason too), whichever fields moved."""

from vllm_kvplugin.counters import FAILURES, Counters


def test_each_delta_holds_what_was_added_since_the_last_one():
    c = Counters(("a", "b", "c"), with_failures=True)
    assert c.take_delta() == {}
    c.add(a=2, b=1.5)
    c.add(a=3)
    c.failure("bad_digest")
    assert c.take_delta() == {"a": 5, "b": 1.5, FAILURES: {"bad_digest": 1}}
    assert c.take_delta() == {}
    c.add(c=1)
    c.failure("bad_digest", 2)
    c.failure("missing")
    assert c.take_delta() == {"c": 1, FAILURES: {"bad_digest": 2, "missing": 1}}
    c.add(a=0)  # touched, unchanged: not reported
    assert c.take_delta() == {}
    assert c.snapshot() == {"a": 5, "b": 1.5, "c": 1, FAILURES: {"bad_digest": 3, "missing": 1}}


def test_a_reset_starts_the_deltas_over():
    c = Counters(("a",), with_failures=False)
    c.add(a=4)
    c.reset()
    assert c.take_delta() == {}
    c.add(a=1)
    assert c.take_delta() == {"a": 1}
    assert FAILURES not in c.snapshot()
