"""Expert buffers in host memory ask for transparent huge pages (engine/cache/hostmem.py): big plain CPU buffers
get them where Linux offers THP, small ones and other devices are left alone, and the expert stores allocate
through it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moechat.engine.cache import hostmem
from moechat.engine.cache.slots import SlotPool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
                    reason="needs Linux with transparent huge pages in madvise or always mode")
def test_a_big_buffer_is_backed_by_huge_pages():
    before = _anon_huge_kb()
    t = hostmem.empty((48, 1 << 20), torch.uint8)  # 48 MB
    assert hostmem.advise_huge(t)
    t.fill_(7)  # first touch: the kernel faults in 2 MB pages
    assert _anon_huge_kb() - before >= 16 * 1024, "no huge pages after madvise"
    assert int(t[17, 12345]) == 7


def test_small_buffers_and_other_memory_are_left_alone():
    assert not hostmem.advise_huge(torch.empty(1 << 20, dtype=torch.uint8))  # 1 MB: no whole 2 MB page inside
    assert not hostmem.advise_huge(torch.empty(0))
    assert hostmem.empty((3, 5), torch.float32).shape == (3, 5)


def test_the_slot_pool_asks_for_huge_pages(monkeypatch):
    seen = []
    monkeypatch.setattr(hostmem, "advise_huge", lambda t: seen.append(t.shape) or False)
    pool = SlotPool(4, 2, 8, {"w13": ((6, 4), torch.bfloat16), "w2": ((4, 3), torch.bfloat16)})
    # one buffer of C slots, each one contiguous row that the named tensors view
    assert seen == [(4, pool.slot_bytes)] and pool.buffers["w13"].shape == (4, 6, 4)
    assert pool.buffers["w13"].untyped_storage().data_ptr() == pool.raw.data_ptr()
