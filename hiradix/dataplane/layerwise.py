"""Layer-by-layer DRAM -> HBM loading that overlaps the forward pass (CachedAttention §3.2.1).

Streaming contract, written down once:

* ``submit(op_id, copy_layer)`` queues one promotion (or, with a list of op ids, one copy
  plan that serves several: the CUDA mover merges a batch's promotions into one); ``copy_layer(i)``
  copies layer ``i`` of its pages from DRAM into its HBM slots.
* ``start()`` is called once per batch after its promotions are queued (SGLang's
  ``ready_to_load_host_cache``) and returns the producer index that the batch carries as
  ``hicache_consumer_index``; ``-1`` when nothing was queued.
* The model worker calls ``set_consumer(index)`` before the forward; SGLang's KV pool calls
  ``wait_until(i)`` from ``get_key_buffer``/``get_value_buffer`` before attention reads layer
  ``i`` (``sglang/srt/mem_cache/memory_pool.py``; the same interface as SGLang's
  ``LayerDoneCounter`` in ``managers/cache_controller.py``).

On CUDA the copies of each batch run on a side stream at ``start()``, one event per layer, with
SGLang's own ``LayerDoneCounter`` (``managers/cache_controller.py``; the plugin passes the class
in as ``counter_factory``, this package does not import SGLang); ``wait_until(i)`` makes the compute stream wait for event
``i`` (no CPU stall), so loading layer i+1 overlaps the forward of layer i. On CPU the same
path runs with synchronous per-layer copies: ``wait_until(i)`` performs the queued copies of
layers ``<= i`` just before attention needs them. Either way :meth:`finished` reports
promotions whose every layer has landed, so their DRAM pages can be unpinned.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch


@dataclass(eq=False)
class _Load:
    op_ids: tuple[int, ...]
    copy_layer: Callable[[int], None]
    next_layer: int = 0  # layers [0, next_layer) are done (CPU mode)
    producer: int = -1  # CUDA: LayerDoneCounter slot whose events track this load


class LayerwiseLoader:
    """Per-layer load counter for hiradix promotions.

    Args:
        num_layers: layers in the device KV pool (local to this pipeline stage).
        device: the device KV pool's device; CUDA enables stream/event overlap.
        counter_factory: CUDA only: builds the per-layer event counter from ``num_layers``
            (SGLang's ``LayerDoneCounter``: ``update_producer``, ``events[i].complete(layer)``,
            ``finish_event``, ``set_consumer``, ``wait_until``, ``reset``).

    Raises:
        ValueError: a CUDA device without ``counter_factory``.
    """

    def __init__(self, num_layers: int, device: torch.device, counter_factory: Optional[Callable[[int], Any]] = None):
        self.num_layers = num_layers
        self.cuda = device.type == "cuda"
        self.consumer_index = -1
        self._queued: list[_Load] = []  # submitted, not yet started
        self._active: list[_Load] = []  # started, some layers may still be pending
        if self.cuda:
            if counter_factory is None:
                raise ValueError("LayerwiseLoader on CUDA needs counter_factory (SGLang's LayerDoneCounter)")
            self._counter = counter_factory(num_layers)
            self._stream = torch.cuda.Stream(device=device)

    def submit(self, op_id: Union[int, Sequence[int]], copy_layer: Callable[[int], None]) -> None:
        """Queue a promotion (or one plan serving the promotions ``op_id``); copies start at :meth:`start`."""
        op_ids = (op_id,) if isinstance(op_id, int) else tuple(op_id)
        self._queued.append(_Load(op_ids, copy_layer))

    def start(self) -> int:
        """Start the queued promotions; returns the producer index, or -1 if none."""
        if not self._queued:
            return -1
        loads, self._queued = self._queued, []
        if not self.cuda:
            self._active.extend(loads)
            return 0
        producer = self._counter.update_producer()
        events = self._counter.events[producer]
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for layer in range(self.num_layers):
                for load in loads:
                    load.copy_layer(layer)
                events.complete(layer)
        for load in loads:
            load.producer = producer
            load.next_layer = self.num_layers
        self._active.extend(loads)
        return producer

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index
        if self.cuda:
            self._counter.set_consumer(index)

    def wait_until(self, layer: int) -> None:
        """Make layer ``layer`` of the started promotions visible to the forward pass."""
        if self.cuda:
            self._counter.wait_until(layer)
            return
        for load in self._active:
            while load.next_layer <= layer:
                load.copy_layer(load.next_layer)
                load.next_layer += 1

    def flush(self) -> None:
        """Finish every queued or started promotion now (before freeing or reusing slots)."""
        self.start()
        if self.cuda:
            self._stream.synchronize()
            return
        self.wait_until(self.num_layers - 1)

    def finished(self) -> list[int]:
        """Op ids of promotions whose every layer has landed; they are forgotten here."""
        done, still = [], []
        for load in self._active:
            landed = (
                self._counter.events[load.producer].finish_event.query()
                if self.cuda
                else load.next_layer >= self.num_layers
            )
            if landed:
                done.extend(load.op_ids)
            else:
                still.append(load)
        self._active = still
        return done

    def reset(self) -> None:
        """Drop everything (after :meth:`flush`)."""
        self._queued.clear()
        self._active.clear()
        self.consumer_index = -1
        if self.cuda:
            self._counter.reset()
