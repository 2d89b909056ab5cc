"""LayerwiseLoader on the CPU: lazy per-layer copies at ``wait_until``, completion by op id."""

from __future__ import annotations

import pytest
import torch

from hiradix.dataplane.layerwise import LayerwiseLoader

NUM_LAYERS = 4


class Recorder:
    """``copy_layer`` callbacks that log ``(op_id, layer)`` into one shared list, in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def copier(self, op_id: int):
        return lambda layer: self.calls.append((op_id, layer))


@pytest.fixture
def loader() -> LayerwiseLoader:
    return LayerwiseLoader(NUM_LAYERS, torch.device("cpu"))


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


def test_start_returns_minus_one_when_nothing_is_queued(loader):
    assert not loader.cuda
    assert loader.start() == -1
    assert loader.finished() == []


def test_start_returns_zero_and_copies_nothing_yet(loader, rec):
    loader.submit(7, rec.copier(7))
    loader.submit(8, rec.copier(8))
    assert rec.calls == []  # submit only queues
    assert loader.start() == 0
    assert rec.calls == []  # CPU copies are lazy: they run at wait_until
    assert loader.start() == -1  # both were taken by the first start
    assert loader.finished() == []


def test_wait_until_copies_exactly_the_layers_up_to_i(loader, rec):
    loader.submit(1, rec.copier(1))
    loader.submit(2, rec.copier(2))
    loader.start()
    loader.wait_until(0)
    assert rec.calls == [(1, 0), (2, 0)]
    loader.wait_until(0)  # idempotent: nothing copied twice
    assert rec.calls == [(1, 0), (2, 0)]
    loader.wait_until(2)  # layers 1 and 2 of each load, each load's layers in order
    assert rec.calls == [(1, 0), (2, 0), (1, 1), (1, 2), (2, 1), (2, 2)]
    loader.wait_until(1)  # already landed: no copy
    assert len(rec.calls) == 6
    loader.wait_until(NUM_LAYERS - 1)
    assert rec.calls[6:] == [(1, 3), (2, 3)]
    for op in (1, 2):
        assert [layer for o, layer in rec.calls if o == op] == list(range(NUM_LAYERS))


def test_wait_until_ignores_loads_not_started(loader, rec):
    loader.submit(1, rec.copier(1))
    loader.start()
    loader.submit(2, rec.copier(2))  # queued for the next batch
    loader.wait_until(1)
    assert rec.calls == [(1, 0), (1, 1)]
    assert loader.start() == 0
    loader.wait_until(0)
    assert rec.calls == [(1, 0), (1, 1), (2, 0)]


def test_finished_reports_after_last_layer_and_only_once(loader, rec):
    loader.submit(5, rec.copier(5))
    loader.submit(6, rec.copier(6))
    assert loader.finished() == []  # queued, not started
    loader.start()
    loader.wait_until(NUM_LAYERS - 2)
    assert loader.finished() == []  # one layer still missing
    loader.wait_until(NUM_LAYERS - 1)
    assert loader.finished() == [5, 6]
    assert loader.finished() == []  # forgotten once reported
    calls = len(rec.calls)
    loader.wait_until(NUM_LAYERS - 1)
    assert len(rec.calls) == calls == 2 * NUM_LAYERS  # a forgotten load is never copied again


def test_finished_separates_done_from_pending(loader, rec):
    loader.submit(1, rec.copier(1))
    loader.start()
    loader.wait_until(NUM_LAYERS - 1)
    loader.submit(2, rec.copier(2))
    loader.start()
    loader.wait_until(0)
    assert loader.finished() == [1]
    loader.wait_until(NUM_LAYERS - 1)
    assert loader.finished() == [2]
    assert rec.calls.count((2, 0)) == 1


def test_flush_starts_and_completes_everything(loader, rec):
    loader.submit(1, rec.copier(1))
    loader.start()
    loader.wait_until(1)
    loader.submit(2, rec.copier(2))  # not started: flush starts it
    loader.flush()
    assert sorted(rec.calls) == [(op, layer) for op in (1, 2) for layer in range(NUM_LAYERS)]
    assert len(rec.calls) == 2 * NUM_LAYERS  # no layer twice
    assert loader.finished() == [1, 2]
    assert loader.start() == -1


def test_flush_with_nothing_pending_copies_nothing(loader, rec):
    loader.flush()
    assert rec.calls == [] and loader.finished() == []


def test_reset_drops_queued_and_active_loads(loader, rec):
    loader.submit(1, rec.copier(1))
    loader.start()
    loader.wait_until(0)
    loader.submit(2, rec.copier(2))
    loader.set_consumer(0)
    assert loader.consumer_index == 0
    loader.reset()
    assert loader.consumer_index == -1
    assert loader.start() == -1  # the queued load is gone
    loader.flush()
    assert rec.calls == [(1, 0)]  # nothing ran after the reset
    assert loader.finished() == []


def test_cuda_without_counter_factory_raises():
    """Raised before any CUDA call (no stream is made), so this needs no GPU."""
    with pytest.raises(ValueError, match="counter_factory"):
        LayerwiseLoader(NUM_LAYERS, torch.device("cuda"))


def test_cuda_path_uses_the_counter_factory_with_num_layers(monkeypatch):
    """The factory gets ``num_layers``; the stream is the only CUDA object (stubbed here)."""
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: ("stream", device))
    loader = LayerwiseLoader(NUM_LAYERS, torch.device("cuda"), counter_factory=made.append)
    assert made == [NUM_LAYERS]
    assert loader.cuda
