"""swarmtrain.core.heap: what a process built at startup is out of the collector's full passes."""

from __future__ import annotations

import gc
import subprocess
import sys

from swarmtrain.core.heap import settle_heap


def test_objects_made_before_settling_are_not_walked_by_later_collections() -> None:
    script = """
import gc
from swarmtrain.core.heap import settle_heap
before = [[i] for i in range(1000)]  # tracked containers, made at "startup"
garbage = []
garbage.append(garbage)  # a cycle nobody refers to: collected, not frozen
del garbage
frozen = settle_heap()
after = [[i] for i in range(10)]
walked = {id(o) for o in gc.get_objects()}
assert frozen >= 1000, frozen
assert not any(id(o) in walked for o in before[:50])
assert all(id(o) in walked for o in after)
assert gc.collect() == 0  # (nothing left over from before)
print("ok", frozen)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr


def test_settle_heap_counts_what_it_froze() -> None:
    try:
        n = settle_heap()
        assert n == gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # (this test process's heap goes back as it was)
