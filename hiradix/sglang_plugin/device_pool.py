"""SGLang's paged device allocator as the core's device pool port."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


class SGLangDevicePool:
    """SGLang's paged device allocator as the core's :class:`~hiradix.core.ports.DevicePool`.

    Args:
        allocator: SGLang's ``token_to_kv_pool_allocator`` (page-granular).
        device: its device (slot tensors live there).
    """

    def __init__(self, allocator: Any, device: torch.device):
        self.allocator = allocator
        self._empty = torch.empty((0,), dtype=torch.int64, device=device)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def alloc(self, num_tokens: int) -> Optional[torch.Tensor]:
        return self.allocator.alloc(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free_segment(slots, start_pos=0)  # whole pages: start_pos only asserts alignment

    def concat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts)) if parts else self._empty
