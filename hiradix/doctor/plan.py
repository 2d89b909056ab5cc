"""What the launch flags mean for this machine, as the SGLang side of the doctor worked it out.

:func:`hiradix.sglang_plugin.doctor_flags.examine` fills a :class:`LaunchPlan` from the command
line (SGLang's parser, hiradix's validation, the model's ``config.json`` and SGLang's own
resolution); the machine checks of this package read only this record, so they need no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

from hiradix.config import HiRadixConfig


@dataclass(frozen=True, slots=True)
class KVFacts:
    """The KV page layout of one rank, as the server's pool will have it (SGLang's ``ModelConfig``).

    Attributes:
        num_layers: attention layers in the pool.
        num_kv_heads: KV heads of one rank (1 for MLA).
        head_dim: elements per head; MLA: ``kv_lora_rank + qk_rope_head_dim``.
        rope_dim: MLA: ``qk_rope_head_dim``; 0 for per-head K/V.
        model_dtype: SGLang's resolved model dtype as the fingerprint spells it (``"torch.bfloat16"``),
            or None when unknown.
        kv_dtype: the stored KV element type's torch name (``"bfloat16"``; ``"uint8"`` for an fp8
            cache), or None when unknown.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    model_dtype: str | None
    kv_dtype: str | None


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """A validated hiradix launch, as far as the machine checks need it.

    Attributes:
        config: the validated hiradix settings.
        model_path: ``--model-path`` as given.
        revision: ``--revision`` or None.
        page_size: tokens per page the server will run with.
        tp_size: ``--tp-size``.
        attn_dp_size: DP attention ranks (1 without DP attention).
        nvme_ranks: the TP ranks of this node that own an NVMe directory ``hiradix-rank<r>``.
        host_copies: copies of the DRAM and NVMe tiers on this node (one per scheduler, or one
            per attention-TP group for an MLA model's shared copy).
        shared_host_copy: an MLA model under TP with one host copy its ranks share.
        dram_bytes_per_copy: DRAM one copy reserves, in bytes; None when it is sized from the
            device pool at start (``--hiradix-dram-ratio`` without ``--max-total-tokens``).
        kv: the KV layout facts, or None when the model's config could not be read.
    """

    config: HiRadixConfig
    model_path: str
    revision: str | None
    page_size: int
    tp_size: int
    attn_dp_size: int
    nvme_ranks: tuple[int, ...]
    host_copies: int
    shared_host_copy: bool
    dram_bytes_per_copy: int | None
    kv: KVFacts | None

    @property
    def copies_text(self) -> str:
        """How the sizes multiply on this node, in words: "per TP rank x 8 ranks" or "per node"."""
        if self.shared_host_copy:
            groups = f" x {self.host_copies} attention-TP groups" if self.host_copies > 1 else ""
            return (f"per node (one copy shared by the {self.tp_size // max(1, self.attn_dp_size)} TP ranks "
                    f"of this MLA model, --hiradix-mla-host-copy node){groups}")
        if self.host_copies == 1:
            return "per TP rank x 1 rank"
        return f"per TP rank x {self.host_copies} ranks"
