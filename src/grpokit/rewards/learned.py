"""Learned rewards: an outcome reward model (one scalar per completion) and a process reward
model (one score per reasoning step), both Hugging Face checkpoints with a scalar head.

  outcome  AutoModelForSequenceClassification, num_labels=1: r(q, o) read at the last token
  process  AutoModelForTokenClassification, num_labels=1: step j's score is sigmoid(logit) at
           the last token of step j; steps are the completion split on a delimiter

Reward models always read text, tokenized with their own tokenizer, in training and in
scoring alike; so a reward model whose tokenizer differs from the policy's is never
misaligned. Step ends come back as character offsets, and `policy_step_ends` maps them onto
the policy's own sampled tokens for process advantages (docs/algorithm.md, eq. 6).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from grpokit.models.checkpoint_dirs import master_weights_dir
from grpokit.run.checkpoint import CheckpointError, save_checkpoint
from grpokit.data.reward_data import split_steps
from grpokit.models.loading import resolve_device
from grpokit.models.precision import compute_autocast, resolve_precision, set_compute_dtype
from grpokit.models.value import scalar_head_from_policy
from grpokit.models.vocabulary import VocabularyMismatch, mask_ghost_rows
from grpokit.rewards.process import StepScores, step_char_ends
from grpokit.models.device import model_device

META_FILE = "grpokit_reward_model.json"
Kind = Literal["outcome", "process"]


@dataclass(frozen=True)
class RewardModelInfo:
    """What a reward model checkpoint is, saved beside its weights as grpokit_reward_model.json."""

    kind: Kind
    step_delimiter: str = "\n"
    head: str = "score"  # or "likelihood": a causal LM whose step log-probs give the scores (likelihood_prm.py)
    weight: float = 1.0  # the likelihood head's a and b: logit = a * running sum of step log-probs + b
    bias: float = 0.0


def _auto_class(kind: str):
    from transformers import (
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    if kind == "outcome":
        return AutoModelForSequenceClassification
    if kind == "process":
        return AutoModelForTokenClassification
    raise ValueError(f"reward model kind must be 'outcome' or 'process', got {kind!r}")


def new_reward_model(policy: torch.nn.Module, tokenizer, kind: Kind) -> torch.nn.Module:
    """A reward model initialised from the policy's backbone (DeepSeekMath initialises its reward
    models from the SFT model) with a zero head, so every score starts at 0."""
    model = scalar_head_from_policy(policy, _auto_class(kind))
    model.config.pad_token_id = tokenizer.pad_token_id  # sequence heads find the last token by it
    return model.eval()


def save_reward_model(model, tokenizer, info: RewardModelInfo, path: str | Path, metrics: dict | None = None) -> Path:
    """Atomically write weights, tokenizer, grpokit_reward_model.json (and metrics.json)."""
    def extra(directory: Path) -> None:
        record = asdict(info)
        if info.head == "score":  # the file score heads always had: kind and step_delimiter
            record = {"kind": info.kind, "step_delimiter": info.step_delimiter}
        (directory / META_FILE).write_text(json.dumps(record, indent=2))
        if metrics is not None:
            (directory / "metrics.json").write_text(json.dumps(metrics, indent=2))

    return save_checkpoint(model, tokenizer, path, extra=extra)


def load_reward_model(path: str | Path, device: str = "auto", dtype: str = "auto", master_dtype: str = "same"):
    """(model, tokenizer, info) from a directory written by `grpokit train-rm`. `dtype` is the compute
    dtype, as for the policy; `master_dtype` "fp32" for a reward model that trains on (iterative GRPO),
    "same" for one that only scores (models/precision.py)."""
    from transformers import AutoTokenizer

    directory = Path(path)
    meta = directory / META_FILE
    if not meta.is_file():
        raise CheckpointError(
            f"{directory} is not a grpokit reward model: {META_FILE} is missing. Train one with "
            "`grpokit train-rm`, or write that file with {\"kind\": \"outcome\"} or {\"kind\": \"process\", "
            "\"step_delimiter\": \"\\n\"} next to a sequence- or token-classification checkpoint"
        )
    info = RewardModelInfo(**json.loads(meta.read_text()))
    dev = resolve_device(device)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    precision = resolve_precision(dtype, master_dtype, dev)
    weights = (master_weights_dir(directory) if precision.master == torch.float32 else None) or directory
    if info.head == "likelihood":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(weights, dtype=precision.master).to(dev)
        # As the policy it was built from was loaded (models/loading.py): the embedding rows past the
        # tokenizer score nothing, or every step's log-prob would count their mass and the scores shift.
        try:
            mask_ghost_rows(model, tokenizer, str(directory))
        except VocabularyMismatch as err:
            raise CheckpointError(str(err)) from None
    else:
        model = _auto_class(info.kind).from_pretrained(weights, dtype=precision.master, num_labels=1).to(dev)
    set_compute_dtype(model, precision.compute)
    model.config.pad_token_id = tokenizer.pad_token_id  # `encode` pads with it; the sequence head must agree
    return model.eval(), tokenizer, info


# --------------------------------------------------------------------------- tokenization


def _token_ends_of(tokenizer, text: str, char_ends: list[int]) -> tuple[list[int], list[int]]:
    """(token ids of `text`, index of the token holding each char_end's last character)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        ends = []
        for c in char_ends:
            # The last token that starts before c holds character c - 1, delimiter included.
            k = max((i for i, (s, e) in enumerate(offsets) if s < c and e > s), default=len(ids) - 1)
            ends.append(k)
        return ids, ends
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # slow tokenizers: prefix lengths
    return ids, [len(tokenizer(text[:c], add_special_tokens=False)["input_ids"]) - 1 for c in char_ends]


@dataclass
class RewardModelInputs:
    """Right-padded reward-model inputs; step_positions[i][j] is the column of step j's last token."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    step_positions: list[list[int]]


def encode(tokenizer, prompts: list[str], steps: list[list[str]]) -> RewardModelInputs:
    """Tokenize prompt + completion (the completion given as its steps) for a reward model."""
    rows, positions = [], []
    for prompt, pieces in zip(prompts, steps):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        text = "".join(pieces)
        char_ends = step_char_ends(pieces)
        completion_ids, ends = _token_ends_of(tokenizer, text, char_ends) if text else ([], [])
        if not completion_ids:  # an empty completion: its single step is read at the last prompt token
            ends = [-1] * max(1, len(pieces))
        if not prompt_ids and not completion_ids:
            raise ValueError("a reward model cannot score an empty prompt with an empty completion")
        rows.append(prompt_ids + completion_ids)
        positions.append([len(prompt_ids) + k for k in ends])
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return RewardModelInputs(ids, mask, positions)


def policy_step_ends(tokenizer, completion_ids: list[int], char_ends: list[int]) -> list[int]:
    """Map step ends (character offsets into the decoded completion) onto the policy's sampled tokens.

    completion_ids: the completion's tokens, EOS included. Step j ends at the token that completes
    its last character: the smallest k with len(decode(ids[:k+1])) >= char_ends[j], found by
    bisection. The final step ends at the last token (EOS included), so every token is credited.
    """
    n = len(completion_ids)
    if n == 0:
        raise ValueError("a completion with no tokens has no steps to map")

    def decoded_length(k: int) -> int:
        return len(tokenizer.decode(completion_ids[: k + 1], skip_special_tokens=True))

    ends = []
    for j, c in enumerate(char_ends):
        if j == len(char_ends) - 1:
            ends.append(n - 1)
            continue
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if decoded_length(mid) >= c:
                hi = mid
            else:
                lo = mid + 1
        ends.append(max(lo, ends[-1] if ends else 0))
    return ends


# --------------------------------------------------------------------------- scoring


class OutcomeRewardModel:
    """r(q, o): one scalar per completion. Callable as a reward function (TRL's contract), so it
    mixes with rule-based rewards by weight like any other."""

    kind = "outcome"

    def __init__(self, model, tokenizer, batch_size: int = 64):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size

    def forward(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        """Scores with gradients (for training): [N] float32."""
        inputs = encode(self.tokenizer, prompts, [[c] for c in completions])
        device = model_device(self.model)
        with compute_autocast(self.model):
            out = self.model(input_ids=inputs.input_ids.to(device), attention_mask=inputs.attention_mask.to(device))
        return out.logits[:, 0].float()

    @torch.no_grad()
    def scores(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        """[N] scores, in micro-batches of `batch_size`, without gradients."""
        self.model.eval()
        out = [self.forward(prompts[i : i + self.batch_size], completions[i : i + self.batch_size]).cpu()
               for i in range(0, len(completions), self.batch_size)]
        return torch.cat(out) if out else torch.zeros(0)

    def __call__(self, prompts: list[str], completions: list[str], **_) -> list[float]:
        return self.scores(prompts, completions).tolist()


class ProcessRewardModel:
    """One score per step: the completion is split on `delimiter`, and each step is judged at its
    last token (delimiter included) given everything before it."""

    kind = "process"

    def __init__(self, model, tokenizer, delimiter: str = "\n", batch_size: int = 64):
        if not delimiter:
            raise ValueError("a process reward model needs a non-empty step delimiter, e.g. '\\n' or '\\n\\n'")
        self.model, self.tokenizer, self.delimiter, self.batch_size = model, tokenizer, delimiter, batch_size

    def split(self, completion: str) -> list[str]:
        """The completion's steps; one (possibly empty) step when it has no delimiter."""
        return split_steps(completion, self.delimiter) or [completion]

    def step_logits(self, prompts: list[str], steps: list[list[str]]) -> list[torch.Tensor]:
        """Logits with gradients (for training): one [K_i] tensor per completion."""
        inputs = encode(self.tokenizer, prompts, steps)
        device = model_device(self.model)
        with compute_autocast(self.model):
            logits = self.model(input_ids=inputs.input_ids.to(device),
                                attention_mask=inputs.attention_mask.to(device)).logits[..., 0].float()
        return [logits[i, torch.tensor(p, device=device)] for i, p in enumerate(inputs.step_positions)]

    @torch.no_grad()
    def score_steps(self, prompts: list[str], completions: list[str]) -> list[StepScores]:
        self.model.eval()
        out = []
        for start in range(0, len(completions), self.batch_size):
            batch = completions[start : start + self.batch_size]
            steps = [self.split(c) for c in batch]
            logits = self.step_logits(prompts[start : start + self.batch_size], steps)
            for completion, pieces, row in zip(batch, steps, logits):
                out.append(StepScores(torch.sigmoid(row).cpu().tolist(), step_char_ends(pieces),
                                      self.delimiter in completion))
        return out
