"""A process reward model that verifies with its language model's own likelihood
(reward_model.model.head: likelihood).

Step j's logit is  a * sum_{i<=j} log p(step i | everything before it) + b : the running sum of the
frozen causal LM's step log-probabilities, through a two-parameter logistic head fit by BCE on the
step labels. A model that knows the task's arithmetic puts little probability on a wrong step, so
the sum drops at the first slip and stays down, as the prefix rule's labels do (a step is right
only when it and every step before it are right). A score head at the step's last token has to
learn that comparison from binary labels alone; on the demo it does not (docs/results/reward-models.md).

Only a and b train; the LM is frozen (a copy of pi_SFT, or a larger checkpoint), so the verifier
never drifts with the policy, and an iterative refresh refits a and b on the new policy's samples.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from grpokit.data.reward_data import split_steps
from grpokit.models.device import model_device
from grpokit.models.logprobs import labelled_logprobs
from grpokit.rewards.learned import encode
from grpokit.rewards.process import StepScores, step_char_ends


IGNORE = -100  # a label no log-prob is taken for (padding)


class LikelihoodFitError(ValueError):
    """Step labels a and b cannot be fit on; the message says what the data lacks and how to get it."""


class LikelihoodProcessRewardModel:
    """Step scores sigmoid(a * running sum of step log-probs + b) from a frozen causal LM."""

    kind = "process"
    head = "likelihood"

    def __init__(self, model, tokenizer, delimiter: str = "\n", batch_size: int = 64, weight: float = 1.0,
                 bias: float = 0.0):
        if not delimiter:
            raise ValueError("a process reward model needs a non-empty step delimiter, e.g. '\\n' or '\\n\\n'")
        self.model, self.tokenizer, self.delimiter, self.batch_size = model, tokenizer, delimiter, batch_size
        self.weight, self.bias = weight, bias
        self.model.requires_grad_(False).eval()

    def split(self, completion: str) -> list[str]:
        """The completion's steps; one (possibly empty) step when it has no delimiter."""
        return split_steps(completion, self.delimiter) or [completion]

    @torch.no_grad()
    def step_log_prob_sums(self, prompts: list[str], steps: list[list[str]]) -> list[torch.Tensor]:
        """Running sums over steps of log p(step | prompt, earlier steps): one [K_i] tensor per completion."""
        out = []
        device = model_device(self.model)
        for start in range(0, len(prompts), self.batch_size):
            batch_prompts = prompts[start : start + self.batch_size]
            batch_steps = steps[start : start + self.batch_size]
            inputs = encode(self.tokenizer, batch_prompts, batch_steps)
            ids, mask = inputs.input_ids.to(device), inputs.attention_mask.to(device)
            labels = ids.masked_fill(mask == 0, IGNORE)
            # Through the trainer's chunked path: only tiles of positions reach the LM head, never the
            # batch's whole [rows, L, vocabulary] float32 logits (several GB at 64 rows of a 49k vocabulary).
            flat = labelled_logprobs(self.model, {"input_ids": ids, "attention_mask": mask}, labels, IGNORE)
            token_lp = torch.zeros(ids.shape[0], ids.shape[1] - 1)  # token k is predicted at column k - 1
            token_lp[(labels[:, 1:] != IGNORE).cpu()] = flat.float().cpu()
            for i, (prompt, ends) in enumerate(zip(batch_prompts, inputs.step_positions)):
                begin = len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]) - 1
                sums = []
                for end in ends:
                    sums.append(token_lp[i, max(begin, 0) : max(end, 0)].sum())
                    begin = end
                out.append(torch.stack(sums).cumsum(0))
        return out

    def step_logits(self, prompts: list[str], steps: list[list[str]]) -> list[torch.Tensor]:
        return [self.weight * s + self.bias for s in self.step_log_prob_sums(prompts, steps)]

    def fit(self, prompts: list[str], steps: list[list[str]], labels: list[list[bool]]) -> float:
        """Fit a and b by logistic regression on every step's running sum (the LM stays frozen);
        returns the final BCE. Fit on z-scores: a confident model's sums reach -30 and below."""
        x = torch.cat(self.step_log_prob_sums(prompts, steps)).double() if prompts else torch.zeros(0)
        y = torch.tensor([float(v) for row in labels for v in row], dtype=torch.float64)
        # One step, or steps of one log-probability, leave the z-scores undefined (a NaN a and b). Labels
        # all alike still fit: b goes far to that side, finite, and the next refresh refits it.
        if len(x) < 2 or bool((x == x[0]).all()):
            raise LikelihoodFitError(
                f"the likelihood head's a and b cannot be fit on {len(x)} labelled step(s): it needs at least two "
                "steps of different log-probabilities; sample more reward-model data "
                "(reward_model.data.num_questions)")
        center, scale = x.mean(), x.std().clamp_min(1e-6)
        z = (x - center) / scale
        a = torch.zeros((), dtype=torch.float64, requires_grad=True)
        b = torch.zeros((), dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([a, b], max_iter=200, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            loss = F.binary_cross_entropy_with_logits(a * z + b, y)
            loss.backward()
            return loss

        optimizer.step(closure)
        a, b = a.detach(), b.detach()
        weight, bias = float(a / scale), float(b - a * center / scale)
        if not (math.isfinite(weight) and math.isfinite(bias)):
            raise LikelihoodFitError(f"the likelihood head's fit diverged (a={weight}, b={bias}) on {len(x)} steps; "
                                     "sample more reward-model data (reward_model.data.num_questions)")
        self.weight, self.bias = weight, bias
        with torch.no_grad():
            return float(F.binary_cross_entropy_with_logits(self.weight * x + self.bias, y))

    @torch.no_grad()
    def score_steps(self, prompts: list[str], completions: list[str]) -> list[StepScores]:
        steps = [self.split(c) for c in completions]
        logits = self.step_logits(prompts, steps)
        return [StepScores(torch.sigmoid(row).tolist(), step_char_ends(pieces), self.delimiter in completion)
                for completion, pieces, row in zip(completions, steps, logits)]
