"""The CPU KV pool is reserved without being charged against the machine's memory (bm.runtime.host_memory)."""

from __future__ import annotations

import sys

import pytest
import torch

from bm.runtime import ModelRunner, load_model
from bm.runtime.host_memory import reserved_zeros
from bm.runtime.model_loader import ModelConfig

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MAP_NORESERVE is Linux's")


def mapping_flags(address: int) -> set[str]:
    """The kernel's flags (``VmFlags`` in /proc/self/smaps) of the mapping holding ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@linux_only
def test_reserved_zeros_are_zeros_in_a_mapping_the_kernel_does_not_charge_before_it_is_written():
    """``nr``: no swap reserved, so fork() does not count the pool against RAM (the sweep's workers,
    a DataLoader, multiprocessing could not start beside two 14 GB pools on a 24 GB machine)."""
    pool = reserved_zeros((2, 3, 64, 16, 8), torch.bfloat16)
    assert pool.shape == (2, 3, 64, 16, 8) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert not pool.any()
    assert "nr" in mapping_flags(pool.data_ptr())
    pool[1, 2, 63] = 1.5  # writable to the last element
    assert pool.sum().item() == 1.5 * 16 * 8


def test_reserved_zeros_of_no_elements_is_an_empty_tensor():
    assert reserved_zeros((0, 4), torch.float32).shape == (0, 4)


@linux_only
def test_a_cpu_runners_kv_pool_is_reserved_without_charge():
    loaded = load_model(ModelConfig(device="cpu", seed=0))
    runner = ModelRunner(loaded, 64, 16, 256)
    caches = [c for c in runner.kv_caches if c is not None]
    assert caches and all(not c.any() for c in caches)
    assert all("nr" in mapping_flags(c.data_ptr()) for c in caches)
