"""The training plan of a trained make_model.py preset: budget and hyper-parameters (no torch here,
so make_model.py can stamp and cache-check a build without importing torch).

scripts/train_small_llama.py reads the plan; a plan's fields and TRAINING_VERSION go into the
model's stamp, so a build is reused only when both match.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bump when anything in scripts/train_small_llama.py that changes the trained weights changes
# (model code, data selection or order, the loop).
TRAINING_VERSION = 1


@dataclass(frozen=True)
class TrainingPlan:
    """How to train one preset: the token budget (num_steps = num_train_tokens // tokens_per_step),
    the optimizer's schedule, the held-out split and the thread count; the same plan and seed give
    the same weights (scripts/train_small_llama.py)."""

    num_train_tokens: int  # training budget, in tokens (input positions over all steps)
    seq_len_tokens: int = 1024  # training window and held-out cut, in tokens
    batch_size_seqs: int = 8  # windows per optimizer step
    peak_lr: float = 3e-3
    final_lr_ratio: float = 0.1  # cosine decays to peak_lr * this
    warmup_ratio: float = 0.05  # of the optimizer steps
    weight_decay: float = 0.1  # on the 2-D weights only
    grad_clip_norm: float = 1.0
    num_heldout_conversations: int = 64
    data_seed: int = 0  # shuffles the conversations (hence the split and the data order)
    num_threads: int = 2  # torch intra-op threads (results depend on it)
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size_seqs * self.seq_len_tokens

    @property
    def num_steps(self) -> int:
        return max(1, self.num_train_tokens // self.tokens_per_step)
