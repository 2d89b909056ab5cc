"""Train a small Llama-architecture model on ShareGPT chats, on the CPU, for scripts/make_model.py.

The `trained` preset of make_model.py gets weights whose predictions mean something, so that
features that change outputs (RoPE-shifted KV reuse, compressed KV) can be measured by how much
they change held-out perplexity.

Model (written here, in plain torch, in the layout of HF `LlamaForCausalLM` / SGLang
`models/llama.py`, so its `state_dict()` names are the checkpoint names): token embedding;
per layer a pre-norm GQA attention with RoPE in the "neox" (rotate-half) convention and a
pre-norm SwiGLU MLP (`down(silu(gate(x)) * up(x))`); final RMSNorm; an untied LM head.

Data: every usable ShareGPT conversation (`bench.common.conversations.iter_sharegpt_records`,
file order; human/gpt/system roles, no empty message, >= 2 messages) rendered with the
model's ChatML template (`render_chatml`, the same text as make_model.CHAT_TEMPLATE) and
tokenized with the local tokenizer. `random.Random(plan.data_seed)` shuffles them once; the first
`plan.num_heldout_conversations` are held out (each cut to `plan.seq_len_tokens` tokens), the
rest are concatenated in that order into one training stream cut into `seq_len_tokens`
windows (next-token targets). Training: AdamW, linear warm-up then cosine decay, gradient
clipping, a budget in tokens (`plan.num_train_tokens`), fixed seeds, fixed thread count,
`torch.use_deterministic_algorithms(True)`: the same plan gives the same weights on the same machine.

The plan and its version are in scripts/training_plan.py (bump TRAINING_VERSION there when
this file changes the weights).

Held-out perplexity = exp(sum of next-token NLL / number of predicted tokens) over the held-out
conversations, each scored from its first token (position 0) alone.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from training_plan import TrainingPlan

ROLE_MAP = {"human": "user", "gpt": "assistant", "system": "system"}  # ShareGPT `from` -> ChatML role


class LlamaShape(Protocol):
    """The architecture fields read here (make_model.Preset has them)."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(num_positions: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, shape (num_positions, head_dim), float32; angle p * theta^(-2i/head_dim),
    the i-th frequency repeated in both halves (rotate-half convention)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., T, head_dim) by position: pairs (i, i + head_dim/2) turn by their angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        h, self.num_heads, self.num_kv_heads = shape.hidden_size, shape.num_attention_heads, shape.num_key_value_heads
        self.head_dim = h // self.num_heads
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.num_heads // self.num_kv_heads  # query head j reads KV head j // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, shape: LlamaShape, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, eps) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, eps)


class SmallLlama(nn.Module):
    """LlamaForCausalLM in plain torch; `state_dict()` keys are the HF checkpoint names.

    Args:
        shape: Architecture (make_model.Preset).
        vocab_size: Tokens in the vocabulary.
        max_positions: Rows of the RoPE tables (longest input, in tokens).
        eps: RMSNorm epsilon.
    """

    def __init__(self, shape: LlamaShape, vocab_size: int, max_positions: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.model = LlamaBody(shape, vocab_size, eps)
        self.lm_head = nn.Linear(shape.hidden_size, vocab_size, bias=False)
        cos, sin = rope_cos_sin(max_positions, shape.hidden_size // shape.num_attention_heads, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits, shape (batch, T, vocab_size), float32, for input_ids (batch, T) int64 (T <= max_positions)."""
        t = input_ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def init_weights(self, generator: torch.Generator, std: float) -> None:
        """Norms 1; other weights N(0, std), residual outputs (o_proj, down_proj) N(0, std / sqrt(2 L)); name order."""
        residual_std = std / math.sqrt(2 * len(self.model.layers))
        with torch.no_grad():
            for name, param in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    s = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                    param.normal_(0.0, s, generator=generator)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

def render_chatml(messages: Sequence[dict]) -> str:
    """The ChatML text of make_model.CHAT_TEMPLATE (no generation prompt): per message
    `<|im_start|>{role}\\n{content stripped}<|im_end|>\\n`."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content'].strip()}<|im_end|>\n" for m in messages)


def record_to_messages(record: dict) -> list[dict] | None:
    """A ShareGPT record's whole conversation as ChatML messages, or None (unknown role, empty
    message, fewer than 2 messages)."""
    messages = []
    for item in record.get("conversations") or []:
        role, text = ROLE_MAP.get(item.get("from")), (item.get("value") or "").strip()
        if role is None or not text:
            return None
        messages.append({"role": role, "content": text})
    return messages if len(messages) >= 2 else None


def sharegpt_chats(data_seed: int) -> list[str]:
    """Every usable ShareGPT conversation as ChatML text, shuffled by `random.Random(data_seed)`.

    Raises:
        ImportError, OSError, ValueError: As `bench.common.conversations.iter_sharegpt_records`.
    """
    from bench.common.conversations import iter_sharegpt_records

    chats = [render_chatml(m) for m in map(record_to_messages, iter_sharegpt_records()) if m is not None]
    random.Random(data_seed).shuffle(chats)
    return chats


def training_windows(token_ids: Iterator[list[int]], seq_len_tokens: int, num_windows: int) -> torch.Tensor:
    """The first `num_windows` windows of the concatenated stream, shape (num_windows, seq_len_tokens + 1),
    int64; window i is stream[i * seq_len_tokens : (i + 1) * seq_len_tokens + 1] (inputs + shifted targets).

    Raises:
        ValueError: If the stream is too short.
    """
    need = num_windows * seq_len_tokens + 1
    stream: list[int] = []
    for ids in token_ids:
        stream.extend(ids)
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise ValueError(f"training data has {len(stream)} tokens, the budget needs {need}")
    flat = torch.tensor(stream[:need], dtype=torch.int64)
    starts = torch.arange(num_windows) * seq_len_tokens
    return flat[starts[:, None] + torch.arange(seq_len_tokens + 1)]


# ---------------------------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------------------------

def lr_at(step: int, plan: TrainingPlan) -> float:
    """Learning rate of 0-based optimizer `step`: linear warm-up, then cosine to peak * final_lr_ratio."""
    warmup = max(1, round(plan.warmup_ratio * plan.num_steps))
    if step < warmup:
        return plan.peak_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, plan.num_steps - warmup)
    floor = plan.peak_lr * plan.final_lr_ratio
    return floor + 0.5 * (plan.peak_lr - floor) * (1.0 + math.cos(math.pi * progress))


def train(model: SmallLlama, windows: torch.Tensor, plan: TrainingPlan, log: Callable[[str], None] = print) -> list[float]:
    """Run `plan.num_steps` AdamW steps over `windows` (num_steps * batch_size_seqs, seq_len + 1) in order.

    Returns:
        The training loss (mean NLL per token, nats) of every step.
    """
    decay = [p for n, p in sorted(model.named_parameters()) if p.ndim == 2]
    no_decay = [p for n, p in sorted(model.named_parameters()) if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": plan.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=plan.peak_lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    losses, t0 = [], time.monotonic()
    model.train()
    for step in range(plan.num_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, plan)
        batch = windows[step * plan.batch_size_seqs:(step + 1) * plan.batch_size_seqs]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), plan.grad_clip_norm, foreach=False)
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == plan.num_steps - 1:
            log(f"[train] step {step + 1}/{plan.num_steps} loss {losses[-1]:.3f} "
                f"lr {lr_at(step, plan):.2e} {time.monotonic() - t0:.0f} s")
    model.eval()
    return losses


@torch.no_grad()
def heldout_nll(model: SmallLlama, sequences: Sequence[list[int]]) -> tuple[float, int]:
    """Sum of next-token NLL (nats, float64 sum) and number of predicted tokens over `sequences`,
    each scored alone from position 0 (a sequence of n tokens predicts n - 1)."""
    total, count = 0.0, 0
    for ids in sequences:
        if len(ids) < 2:
            continue
        x = torch.tensor([ids], dtype=torch.int64)
        logits = model(x[:, :-1])[0]
        total += F.cross_entropy(logits, x[0, 1:], reduction="sum").double().item()
        count += len(ids) - 1
    return total, count


@dataclass(frozen=True)
class TrainingResult:
    """What `train_small_llama` returns (weights ready for safetensors, with the numbers the stamp records)."""

    weights: dict  # checkpoint name -> float32 tensor, contiguous
    heldout_perplexity: float  # exp(mean NLL per predicted token) on the held-out conversations
    heldout_num_tokens: int  # predicted tokens in the held-out set
    final_train_loss: float  # mean of the last 10 steps' losses, nats per token
    train_s: float  # wall-clock seconds of the optimizer loop


def train_small_llama(shape: LlamaShape, vocab_size: int, encode: Callable[[str], list[int]],
                      plan: TrainingPlan, seed: int, chats: Sequence[str] | None = None,
                      log: Callable[[str], None] = print) -> TrainingResult:
    """Train a SmallLlama per `plan` on ShareGPT (or `chats`), deterministically.

    Args:
        shape: Architecture (make_model.Preset).
        vocab_size: Tokens in the vocabulary of `encode`.
        encode: Text -> token ids (the local tokenizer, special tokens recognised).
        plan: Budget and hyper-parameters.
        seed: Seed of the weight initialisation.
        chats: ChatML texts in data order (held-out first); None: `sharegpt_chats(plan.data_seed)`.

    Raises:
        ValueError: If the data is too short for the budget.
    """
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(plan.num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        chats = sharegpt_chats(plan.data_seed) if chats is None else chats
        heldout = [encode(c)[:plan.seq_len_tokens] for c in chats[:plan.num_heldout_conversations]]
        train_ids = (encode(c) for c in chats[plan.num_heldout_conversations:])
        windows = training_windows(train_ids, plan.seq_len_tokens, plan.num_steps * plan.batch_size_seqs)
        torch.manual_seed(seed)
        model = SmallLlama(shape, vocab_size, plan.seq_len_tokens, plan.rms_norm_eps)
        model.init_weights(torch.Generator().manual_seed(seed), plan.init_std)
        t0 = time.monotonic()
        losses = train(model, windows, plan, log)
        train_s = time.monotonic() - t0
        total, count = heldout_nll(model, heldout)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    weights = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    return TrainingResult(weights, math.exp(total / count), count,
                          sum(losses[-10:]) / len(losses[-10:]), train_s)
