"""The systems `bench.cluster.run` compares: a server kind behind SGLang's router with one policy.

A system is written `KIND:POLICY` (`--systems stock:cache_aware,hiradix:round_robin`):

    KIND    stock     stock RadixAttention: each server only has its own HBM cache
            hiradix   hiradix defaults + `--hiradix-store mooncake` on a Mooncake Store of its own
                      (one master + one holder, `hiradix.testing.mooncake.MooncakeCluster`); DRAM
                      `--hiradix-dram-ratio` x the HBM pool; no NVMe
            hicache   stock SGLang HiCache + the same kind of Mooncake Store as L3
                      (`hicache_mooncake_args/env`), host pool `--hicache-ratio` x the HBM pool: the
                      same DRAM bytes as hiradix's (`bench.ab.systems.with_tier_sizes`)
            KIND-aa   a second fleet of KIND (the A/A control; `stock-aa:cache_aware` by default)
    POLICY  an `smg launch --policy` name (round_robin, cache_aware, power_of_two, least_load, random,
            consistent_hashing, prefix_hash); `cache_aware+events`: smg's cache-aware policy on the
            engines' KV events instead of its approximate tree: the servers run in SGLang's SMG gRPC
            mode with `--kv-events-config` (`bench.cluster.smg_grpc`; needs the smg-grpc-servicer
            package) behind `grpc://` worker URLs, and smg subscribes to each one's events
            (`SubscribeKvEvents`). hiradix publishes every tier's pages (HBM GPU, DRAM CPU_PINNED,
            store EXTERNAL); smg routes by its index of them. In this mode smg tokenizes and
            applies the chat template itself, and the responses carry `cached_tokens` only (no
            per-tier split, no output ids), so such a system's tier columns and `same` are empty.

Every server of every system: the same model, `--max-total-tokens` (the HBM pool), `--page-size 16`,
`--served-model-name default` (the router picks workers by model id), `--sleep-on-idle`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from bench.ab.systems import System, kv_bytes_per_token, with_tier_sizes
from hiradix.testing.mooncake import hicache_mooncake_args, hicache_mooncake_env
from hiradix.testing.server import cpu_args, cpu_env
from hiradix.tiers.store.base import StoreConfig

PAGE_TOKENS = 16
SERVED_MODEL = "default"
KINDS = ("stock", "hiradix", "hicache")
STORE_KINDS = ("hiradix", "hicache")
POLICIES = ("round_robin", "cache_aware", "power_of_two", "least_load", "random", "consistent_hashing",
            "prefix_hash")
LOAD_ONLY_POLICIES = ("round_robin", "power_of_two", "least_load", "random")  # placement ignores prefixes
REFERENCE = "stock:cache_aware"  # what SGLang users run today: the ratios' denominator
AA_SUFFIX = "-aa"
EVENTS_SUFFIX = "+events"  # POLICY suffix: smg routes on the engines' KV events (gRPC mode)
EVENTS_POLICIES = ("cache_aware",)  # the smg policy that reads the event-driven KV index

# N=2: 6 systems x 2 servers = 12 (the most this machine holds); N=4: 3 x 4 = 12.
DEFAULT_SYSTEMS = {
    2: "stock:cache_aware,stock-aa:cache_aware,stock:round_robin,hiradix:round_robin,hiradix:cache_aware,"
       "hicache:cache_aware",
    4: "stock:cache_aware,stock-aa:cache_aware,hiradix:round_robin",
}
SECOND_SYSTEMS = {  # the documented second invocation: the other policies, the same reference and A/A
    2: "stock:cache_aware,stock-aa:cache_aware,hiradix:power_of_two,hiradix:least_load,hicache:round_robin",
    4: "stock:cache_aware,hiradix:power_of_two,hiradix:least_load",
}


@dataclass(frozen=True)
class FleetSystem:
    """One system: `kind` servers (`kind` may end in `-aa`) behind an `smg` router with `policy`."""

    kind: str
    policy: str
    events: bool = False  # servers in SGLang's SMG gRPC mode publishing KV events, smg consuming them

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.policy}" + (EVENTS_SUFFIX if self.events else "")

    @property
    def base_kind(self) -> str:
        """`stock` for `stock-aa`: the server flags it runs with."""
        return self.kind[: -len(AA_SUFFIX)] if self.kind.endswith(AA_SUFFIX) else self.kind

    @property
    def is_aa(self) -> bool:
        return self.kind.endswith(AA_SUFFIX)

    @property
    def has_store(self) -> bool:
        return self.base_kind in STORE_KINDS

    @property
    def slug(self) -> str:
        """A directory name: `hiradix-round_robin` (`hiradix-cache_aware-events`)."""
        return re.sub(r"[^A-Za-z0-9_.-]", "-", self.name)


def parse_systems(text: str) -> list[FleetSystem]:
    """`"stock:cache_aware,hiradix:round_robin"` -> systems, in that order.

    Raises:
        ValueError: On a malformed item, an unknown kind or policy, or a repeated system.
    """
    systems = []
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        kind, sep, policy = item.partition(":")
        base = kind[: -len(AA_SUFFIX)] if kind.endswith(AA_SUFFIX) else kind
        if not sep or base not in KINDS:
            raise ValueError(f"system {item!r}: want KIND:POLICY with KIND from {', '.join(KINDS)} (or KIND-aa)")
        events = policy.endswith(EVENTS_SUFFIX)
        if events:
            policy = policy[: -len(EVENTS_SUFFIX)]
            if policy not in EVENTS_POLICIES:
                raise ValueError(f"system {item!r}: {EVENTS_SUFFIX} goes with {' or '.join(EVENTS_POLICIES)} "
                                 f"(the smg policy that routes by the KV event index), not {policy!r}")
            if base == "hicache":
                raise ValueError(f"system {item!r}: {EVENTS_SUFFIX} is for stock and hiradix servers (HiCache's "
                                 "host pool is sized at its start, before the gRPC servers'; not wired here)")
        if policy not in POLICIES:
            raise ValueError(f"system {item!r}: unknown router policy {policy!r}; known: {', '.join(POLICIES)}")
        systems.append(FleetSystem(kind, policy, events))
    if not systems or len({s.name for s in systems}) != len(systems):
        raise ValueError(f"--systems wants distinct KIND:POLICY[{EVENTS_SUFFIX}] items, got {text!r}")
    return systems


def check_server_budget(systems: Sequence[FleetSystem], servers_per_system: int, max_servers: int) -> None:
    """Refuse a run that would start more SGLang servers than fit in memory (~1.7 GB each here).

    Raises:
        ValueError: naming the total, `--max-servers` and how to fit.
    """
    total = len(systems) * servers_per_system
    if servers_per_system < 1:
        raise ValueError(f"--servers must be >= 1, got {servers_per_system}")
    if total > max_servers:
        raise ValueError(f"{len(systems)} systems x {servers_per_system} servers = {total} servers > --max-servers "
                         f"{max_servers} (a tiny-model server takes ~1.7 GB): drop systems or split the run")


def server_launch(system: FleetSystem, store: Optional[StoreConfig], model_path: Path, max_total_tokens: int,
                  dram_ratio: float, tier_dir: Path, server_index: int) -> tuple[list[str], dict[str, str]]:
    """Flags and environment of server `server_index` of `system` (`store`: its store's client config,
    None for stock).

    Raises:
        ValueError: A store kind without `store`.
    """
    if system.has_store and store is None:
        raise ValueError(f"{system.name} needs a store")
    args = cpu_args(max_total_tokens) + ["--page-size", str(PAGE_TOKENS), "--served-model-name", SERVED_MODEL]
    env = cpu_env()
    if system.base_kind == "hicache":
        args += hicache_mooncake_args(store)
        env.update(hicache_mooncake_env(store))
    elif system.base_kind == "hiradix":
        args += ["--enable-hiradix", "--hiradix-store", "mooncake", "--hiradix-store-config", store.to_json()]
    device_bytes = max_total_tokens * kv_bytes_per_token(model_path)
    sized = with_tier_sizes([System(f"{system.slug}-{server_index}", tuple(args))], dram_ratio, 0.0, device_bytes,
                            tier_dir)  # fmt: skip
    return list(sized[0].server_args), env
