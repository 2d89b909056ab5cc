"""Pinning the DRAM tier for CUDA: the fallback decisions a CPU machine can check.

Without CUDA, ``cudaHostRegister`` is never reached: registration reports why, the pool stays
pageable with exactly one warning, and closing it works as before. The GPU side (a pool really
registered, unregistered at close) is in ``tests/dataplane/test_device_copy_gpu.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hiradix.dataplane.layout import KVLayout
from hiradix.tiers import pinned
from hiradix.tiers.dram import DramPool

LAYOUT = KVLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
CUDA = torch.cuda.is_available()

MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 08:01 123  /usr/lib/x86_64-linux-gnu/libc.so.6
7f1000000000-7f1000100000 r-xp 00000000 08:01 456  /venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13
7f2000000000-7f2000001000 rw-p 00000000 00:00 0
"""


def test_libcudart_path_is_read_from_the_maps():
    assert pinned.libcudart_path(MAPS) == "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
    assert pinned.libcudart_path("7f0-7f1 r--p 0 08:01 1 /usr/lib/libc.so.6\n") is None
    assert pinned.libcudart_path("") is None


def test_register_refuses_an_empty_range():
    assert "nothing to register" in pinned.cuda_host_register(0, 4096)
    assert "nothing to register" in pinned.cuda_host_register(0x1000, 0)


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA answer")
def test_without_cuda_registration_says_why():
    assert pinned.cuda_host_register(0x7F0000000000, 4096) == "no CUDA device"
    assert pinned.cuda_host_unregister(0x7F0000000000) == "no CUDA device"
    assert pinned.host_pointer_usable_on_device(0) is None  # no libcudart mapped here


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA fallback")
def test_pool_stays_pageable_with_one_warning(tmp_path, caplog):
    pool = DramPool.create_anonymous(LAYOUT, 4)
    try:
        with caplog.at_level(logging.WARNING, logger="hiradix.tiers.dram"):
            assert pool.pin_for_cuda() is False
            assert pool.pin_for_cuda() is False  # not tried again, not warned again
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "stays pageable" in warnings[0].getMessage()
        assert not pool.cuda_pinned and pool.pin_failure == "no CUDA device"
        pool.tensor[0].fill_(1.5)  # still a working pool
        assert float(pool.tensor[0].flatten()[0]) == 1.5
    finally:
        pool.close()
    assert not pool.cuda_pinned
    pool.close()  # idempotent
