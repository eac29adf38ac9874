"""GRPO in one file: DeepSeekMath's RL stage (Shao et al., 2024, Algorithm 1 with mu = 1) on the demo's
chain-arithmetic task, read top to bottom. Each step:

    1. sample G completions for each of B questions from pi_old (= pi_theta: one update per batch)
    2. reward each completion with the rule-based verifier
    3. group-relative advantages, outcome supervision           (eq. 5)
    4. the k3 KL of pi_theta to the frozen pi_ref, per token    (eq. 4)
    5. the clipped objective J_GRPO, one AdamW step on -J       (eq. 3)

It is built on torch, transformers and grpokit.math (the k3 estimator) alone, plus the demo task's own
helpers in grpokit.data.arithmetic: its questions, its prompt "Q: 7+5-3\\n" and its verifier
`chain_accuracy` (1 when the "A: n" line is right). The equation numbers are the paper's, as
docs/algorithm.md writes them out. `grpokit train` runs the same algorithm through a modular loop
(train/loop.py and what it calls), with its defaults as the defaults here;
tests/test_one_file_grpo.py checks that both give the same rewards and losses step for step.

    grpokit demo --output-dir runs/demo                 # pi_SFT: runs/demo/checkpoints/sft
    python examples/grpo_in_one_file.py runs/demo/checkpoints/sft --steps 150
"""

from __future__ import annotations

import argparse
import copy
import random
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from grpokit.data import arithmetic
from grpokit.math import kl_k3


@dataclass
class Settings:
    """grpokit's defaults for the same keys (grpokit train --help), which the demo runs with."""

    seed: int = 0
    steps: int = 150                 # grpo.max_steps
    questions_per_step: int = 16     # B, grpo.prompts_per_step
    group_size: int = 8              # G, grpo.num_generations
    max_new_tokens: int = 96         # grpo.max_completion_length
    temperature: float = 0.7         # grpo.temperature: the policy trained is the tempered one
    learning_rate: float = 3e-5      # grpo.learning_rate
    warmup_steps: int = 20           # grpo.warmup_steps: linear warm-up, then constant; 0 = none
    beta: float = 0.04               # grpo.beta, the KL coefficient
    epsilon: float = 0.2             # grpo.epsilon, the clip range
    max_grad_norm: float = 1.0       # grpo.max_grad_norm
    num_questions: int = 20000       # task.num_rl_questions
    eval_questions: int = 500        # task.num_eval_questions
    heldout_percent: int = 10        # task.heldout_percent: the hash's lowest share, never trained on
    validation_percent: int = 5      # task.validation_percent: the next share, kept out of training too


# --------------------------------------------------------------------------------------- the task


def split(settings: Settings) -> arithmetic.ChainSpec:
    """The demo task's shape, with its fixed held-out and validation shares of a hash of the question."""
    return arithmetic.ChainSpec(heldout_percent=settings.heldout_percent, validation_percent=settings.validation_percent)


def training_questions(settings: Settings) -> list[dict]:
    """The demo's RL questions: {"prompt": "Q: 7+5-3\\n", "question": ..., "answer": "9"}; the same draw
    as grpokit's chain task (seed + 1, the training side of the fixed split)."""
    questions = arithmetic.sample_questions(settings.num_questions, settings.seed + 1, split(settings), "train")
    return [{k: row[k] for k in ("prompt", "question", "answer")} for row in arithmetic.make_rows(questions)]


def heldout_questions(settings: Settings) -> list[dict]:
    return arithmetic.make_rows(arithmetic.sample_questions(settings.eval_questions, 0, split(settings), "heldout"))


class QuestionOrder:
    """Questions in shuffled epochs from the seed: each step takes the next B."""

    def __init__(self, rows: list[dict], seed: int):
        self.rows, self.rng, self.order = rows, random.Random(seed), []

    def next(self, n: int) -> list[dict]:
        while len(self.order) < n:
            self.order += self.rng.sample(range(len(self.rows)), len(self.rows))
        picked, self.order = self.order[:n], self.order[n:]
        return [self.rows[i] for i in picked]


# ------------------------------------------------------------------------------ 1. sample G per question


@dataclass
class Batch:
    input_ids: torch.Tensor       # [N, P + T]: each prompt left-padded to P, then its completion
    attention_mask: torch.Tensor  # [N, P + T]: 1 on real prompt and completion tokens
    mask: torch.Tensor            # [N, T]: 1 on completion tokens up to and including the first EOS
    prompt_length: int            # P
    completions: list[str]        # N = B x G texts, each question's G in a row


@torch.no_grad()
def sample(policy, tokenizer, prompts: list[str], settings: Settings, greedy: bool = False) -> Batch:
    """G completions of each prompt (1 when greedy), drawn from torch's global random stream."""
    g = 1 if greedy else settings.group_size
    tokenizer.padding_side = "left"  # every completion starts at column P
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids, prompt_mask = enc["input_ids"].repeat_interleave(g, 0), enc["attention_mask"].repeat_interleave(g, 0)
    eos = tokenizer.eos_token_id
    generation = GenerationConfig(max_new_tokens=settings.max_new_tokens, do_sample=not greedy,
                                  temperature=None if greedy else settings.temperature,
                                  top_p=None if greedy else 1.0, top_k=None if greedy else 0,  # the whole vocabulary
                                  eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    policy.eval()
    out = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation)
    completion = out[:, prompt_ids.shape[1]:]
    # Through the first EOS: a token counts when no EOS came before it.
    is_eos = (completion == eos).long()
    mask = ((is_eos.cumsum(1) - is_eos) == 0).long()
    completion = torch.where(mask.bool(), completion, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode([ids[m.bool()] for ids, m in zip(completion, mask)], skip_special_tokens=True)
    return Batch(torch.cat([prompt_ids, completion], 1), torch.cat([prompt_mask, mask], 1), mask,
                 prompt_ids.shape[1], texts)


# --------------------------------------------------------------------------------------- 2. reward


def reward(rows: list[dict], batch: Batch, reward_fn, group_size: int) -> torch.Tensor:
    """[N] rewards. reward_fn has TRL's signature, fn(prompts, completions, **columns) -> list[float]."""
    rows = [row for row in rows for _ in range(group_size)]  # each question's row, once per completion
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    scores = reward_fn([row["prompt"] for row in rows], batch.completions, **columns)
    return torch.tensor(scores, dtype=torch.float32)


# ------------------------------------------------------------------- 3. group-relative advantages (eq. 5)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """Eq. 5, outcome supervision: A_i = (r_i - mean(r)) / std(r) over the G completions of one question,
    the same A_i for every token of completion i. A group whose rewards are all equal teaches nothing:
    exactly 0 (not a rounding residue over eps)."""
    r = rewards.view(-1, group_size)
    mean, std = r.mean(1, keepdim=True), r.std(1, keepdim=True)  # std with G - 1, as torch.std
    advantages = (r - mean) / (std + eps)
    all_equal = (r == r[:, :1]).all(1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).view(-1)


# --------------------------------------------------------------------- per-token log-probs of a completion


def token_logprobs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """[N, T] log pi(o_t | q, o_<t) of each sampled completion token, under the tempered distribution
    the tokens were sampled from (logits / temperature); 0 on padding."""
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding takes no positions
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions,
                   use_cache=False).logits
    logits = logits[:, batch.prompt_length - 1:-1].float() / temperature  # column c predicts token c + 1
    targets = batch.input_ids[:, batch.prompt_length:]
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp * batch.mask


# -------------------------------------------------------------- 4 and 5. the k3 KL and the clipped objective


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, epsilon: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-J_GRPO (eq. 3) and the mean KL per token:

        J = 1/G sum_i 1/|o_i| sum_t { min(rho A_i, clip(rho, 1 - eps, 1 + eps) A_i) - beta KL_k3 },
        rho = pi_theta(o_t) / pi_old(o_t),  KL_k3 = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1   (eq. 4)

    With one update per batch pi_old is pi_theta itself (old_logp = logp.detach()): rho = 1 in value and
    the clip never binds, but rho's gradient is grad log pi_theta, the policy gradient."""
    m = mask.float()
    ratio = torch.exp(logp - old_logp)
    a = advantages.unsqueeze(1)  # outcome supervision: every token of o_i shares A_i
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - epsilon, 1 + epsilon) * a)
    kl = kl_k3(logp, ref_logp)  # eq. 4, unbiased and >= 0; grpokit.math keeps it exact near 0
    per_token = surrogate - beta * kl
    lengths = m.sum(1)
    per_output = (per_token * m).sum(1) / lengths.clamp(min=1)  # 1/|o_i| sum_t
    rows = lengths > 0
    objective = per_output[rows].sum() / rows.sum().clamp(min=1)  # 1/G sum_i, over every question's group
    return -objective, (kl * m).sum() / m.sum().clamp(min=1)


# ------------------------------------------------------------------------------------------- the loop


def learning_rate(settings: Settings, step: int) -> float:
    """Linear warm-up over warmup_steps, then constant; warmup_steps = 0: the full rate from the first step."""
    return settings.learning_rate * min(1.0, (step + 1) / max(1, settings.warmup_steps))


def train(policy, tokenizer, settings: Settings, reward_fn=arithmetic.chain_accuracy, log=print) -> list[dict]:
    """GRPO on the demo task from `policy` (pi_SFT); trains it in place and returns one record per step."""
    reference = copy.deepcopy(policy).eval().requires_grad_(False)  # pi_ref: frozen pi_SFT
    optimizer = torch.optim.AdamW(policy.parameters(), lr=settings.learning_rate, weight_decay=0.0,
                                  betas=(0.9, 0.99))
    order = QuestionOrder(training_questions(settings), settings.seed)
    torch.manual_seed(settings.seed)  # generate samples from torch's global stream
    history = []
    for step in range(settings.steps):
        rows = order.next(settings.questions_per_step)
        batch = sample(policy, tokenizer, [row["prompt"] for row in rows], settings)         # 1
        rewards = reward(rows, batch, reward_fn, settings.group_size)                       # 2
        advantages = group_advantages(rewards, settings.group_size)                        # 3, eq. 5
        with torch.no_grad():
            ref_logp = token_logprobs(reference, batch, settings.temperature)
        # The minibatch order, as a PPO loop shuffles it (one minibatch here: the order changes no number,
        # only which random draws the next step's sampling gets, the same as grpokit's).
        rows_in_order = torch.randperm(len(batch.completions))
        policy.train()
        logp = token_logprobs(policy, batch, settings.temperature)
        loss, kl = grpo_loss(logp[rows_in_order], logp.detach()[rows_in_order], ref_logp[rows_in_order],   # 4, 5
                             advantages[rows_in_order], batch.mask[rows_in_order], settings.epsilon, settings.beta)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), settings.max_grad_norm)
        optimizer.step()
        policy.eval()
        record = {"step": step + 1, "reward/mean": float(rewards.mean()), "loss": float(loss), "kl": float(kl),
                  "grad_norm": float(grad_norm), "completions": batch.completions}
        history.append(record)
        log(f"step {step + 1}: reward {record['reward/mean']:.3f}, loss {record['loss']:+.4f}, kl {record['kl']:.4f}")
    return history


def greedy_accuracy(policy, tokenizer, rows: list[dict], settings: Settings) -> float:
    """Held-out accuracy of greedy answers, the demo's headline metric."""
    batch = sample(policy, tokenizer, [row["prompt"] for row in rows], settings, greedy=True)
    right = arithmetic.chain_accuracy([], batch.completions, [row["answer"] for row in rows])
    return sum(right) / len(right)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sft", help="pi_SFT: a saved checkpoint directory, e.g. runs/demo/checkpoints/sft")
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--seed", type=int, default=Settings.seed)
    parser.add_argument("--eval-questions", type=int, default=Settings.eval_questions)
    args = parser.parse_args()
    settings = Settings(seed=args.seed, steps=args.steps, eval_questions=args.eval_questions)
    policy = AutoModelForCausalLM.from_pretrained(args.sft, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.sft)
    heldout = heldout_questions(settings)
    before = greedy_accuracy(policy, tokenizer, heldout, settings)
    train(policy, tokenizer, settings)
    after = greedy_accuracy(policy, tokenizer, heldout, settings)
    print(f"held-out greedy accuracy on {len(heldout)} questions: {before:.1%} -> {after:.1%} "
          f"({100 * (after - before):+.1f} pt)")


if __name__ == "__main__":
    main()
