"""The tier plan: one rank's tier facts resolved once (hiradix.core.plan)."""

from __future__ import annotations

import pytest

from hiradix.core.node import Tier
from hiradix.core.plan import EXACT, TierPlan, TierSpec


def test_a_plan_gives_each_tiers_page_bytes_and_the_host_bytes_reserved():
    plan = TierPlan(hbm_page_bytes=4096,
                    dram=TierSpec(Tier.DRAM, 100, 4096, reserved_bytes=409_600),
                    nvme=TierSpec(Tier.NVME, 50, 1088, page_format="fp8", reserved_bytes=50 * 4096),
                    store=TierSpec(Tier.STORE, 0, 4096, key_prefix="fp/"))  # fmt: skip
    assert plan.page_bytes_by_tier == (4096, 4096, 1088, 4096)
    assert plan.reserved_bytes == (409_600, 204_800)
    assert plan.nvme_slots == 50 and plan.store_key_prefix == "fp/"
    assert plan.nvme.page_format == "fp8" and plan.dram.page_format == EXACT


def test_an_absent_tier_reserves_nothing_and_reads_as_off():
    plan = TierPlan.uniform(page_bytes=64, dram_pages=8)
    assert plan.nvme is None and plan.store is None
    assert plan.nvme_slots == 0 and plan.store_key_prefix is None and plan.reserved_bytes == (0, 0)
    assert plan.page_bytes_by_tier == (64, 64, 64, 64)
    with_store = TierPlan.uniform(64, 8, 16, store_key_prefix="k/", write_through=False)
    assert with_store.nvme_slots == 16 and with_store.store_key_prefix == "k/" and not with_store.write_through


@pytest.mark.parametrize("spec", [
    lambda: TierSpec(Tier.DRAM, 1, 64, key_prefix="k/"),  # only the store has keys
    lambda: TierSpec(Tier.STORE, 0, 64),  # the store needs its keys
    lambda: TierSpec(Tier.NVME, -1, 64),
    lambda: TierSpec(Tier.NVME, 1, 0),
    lambda: TierPlan(64, TierSpec(Tier.NVME, 1, 64)),  # DRAM in the NVMe place
    lambda: TierPlan.uniform(64, 8, store_write_policy="sometimes"),
])  # fmt: skip
def test_an_inconsistent_plan_is_refused(spec):
    with pytest.raises(AssertionError):
        spec()
