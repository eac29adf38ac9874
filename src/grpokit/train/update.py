"""The update: mu epochs of optimizer steps over minibatches of a batch's rows, each accumulated over
micro-batches. One loop for the policy and for PPO's critic (Trainer.update hands it to the
algorithm); the policy's micro-loss and the metrics its sums reduce to are here beside it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpokit import distributed
from grpokit.config import GRPOConfig
from grpokit.errors import renamed_names
from grpokit.math import loss_denominator
from grpokit.micro_batches import RowLayout
from grpokit.models.sharding import grad_norm_value
from grpokit.models.logprobs import token_logprobs
from grpokit.train.algorithm import Algorithm, Batch


def split_minibatch(rows: torch.Tensor, row_lengths: torch.Tensor | None, config: GRPOConfig, layout: RowLayout,
                  lockstep: bool) -> list:
    """`rows` cut into micro-batches: at most grpo.micro_batch_size rows each and, given each row's
    length in tokens, at most grpo.max_tokens_per_micro_batch tokens (rows x the longest), in
    order of length (micro_batches.split_by_tokens); packed (grpo.pack_rows), whole packed rows of
    the step's layout, at most grpo.micro_batch_size of them (RowLayout.micro_batches)."""
    if row_lengths is None:
        return list(rows.split(config.micro_batch_size))
    groups = layout.micro_batches(row_lengths.to(rows.device)[rows], config.max_tokens_per_micro_batch,
                                  config.micro_batch_size, "grpo.max_tokens_per_micro_batch", lockstep)
    return [rows[g.to(rows.device)] for g in groups]


@dataclass
class Optimized:
    """What one update trains: a model with its optimizer and learning-rate schedule (the policy's,
    or an algorithm's own model, PPO's critic)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object


def update(target: Optimized, batch: Batch, micro_loss, config: GRPOConfig, token_weighted: bool = False
           ) -> tuple[dict, int]:
    """mu epochs of optimizer steps of `target` over minibatches of the batch's rows, each accumulated
    over micro-batches. A minibatch's rows are split into micro-batches in order of length (each
    row's forward length in tokens, from the batch's layout) under grpo.max_tokens_per_micro_batch,
    so each micro-batch's forward, cut to its longest row, computes little padding.

    micro_loss(rows, epoch, total) -> (loss, sums): the micro-batch's share of the minibatch
    loss, i.e. its sum of terms divided by `total`, the count the whole minibatch averages
    over (tokens when token_weighted, else what grpo.loss_aggregation names; see
    math.loss_denominator), and tensors to add up for the log. Summed over micro-batches
    the losses are exactly the minibatch's loss. A non-finite loss or gradient skips the
    optimizer step: no NaN reaches the weights. Returns (summed log values, skipped steps).

    Several processes: `total` is the count over every process's rows of the minibatch
    (each process holds its own rows), so each back-propagates sum_local / global count and
    the summed gradients are the whole minibatch's. Skips are agreed by all processes, and
    the log sums come back summed over processes."""
    model, optimizer, scheduler = target.model, target.optimizer, target.scheduler
    loss_mask, layout = batch.loss_mask, batch.layout
    row_lengths = layout.row_lengths(batch.rollout.attention_mask, batch.rollout.prompt_length)
    aggregation = "token" if token_weighted else config.loss_aggregation
    totals: dict[str, float] = {}
    steps: dict[str, float] = {}
    skipped = 0
    lockstep = distributed.world_size() > 1  # every process makes the same forward/backward calls
    model.train()
    for epoch in range(config.num_iterations):
        for minibatch in torch.randperm(loss_mask.shape[0]).chunk(config.num_minibatches):
            minibatch = minibatch.to(loss_mask.device)
            counts = distributed.all_reduce_sum(torch.tensor(
                [loss_denominator(loss_mask[minibatch], aggregation), float(loss_mask[minibatch].sum())],
                dtype=torch.float64))
            total, tokens = float(counts[0]), float(counts[1])
            if total == 0 or tokens == 0:
                continue  # every sample of this minibatch failed its reward, on every process
            optimizer.zero_grad(set_to_none=True)
            finite = True
            for micro in split_minibatch(minibatch, row_lengths, config, layout, lockstep):
                loss, sums = micro_loss(micro, epoch, total)
                if not torch.isfinite(loss):
                    finite = False  # one bad micro-batch poisons the minibatch: skip it whole
                    if not lockstep:
                        break
                loss.backward()  # in lockstep even a NaN loss: the others' backward waits for ours
                for key, value in sums.items():
                    totals[key] = totals.get(key, 0.0) + float(value)
            finite = distributed.all_agree(finite)
            norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)) \
                if finite else None
            if norm is None or not torch.isfinite(norm):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            steps["grad_norm_sum"] = steps.get("grad_norm_sum", 0.0) + float(norm)
            steps["optimizer_steps"] = steps.get("optimizer_steps", 0.0) + 1
            optimizer.step()
            scheduler.step()
    model.eval()
    # grad norms and steps are already global (the same on every process); the rest adds up
    return {**distributed.sum_dict(totals), **steps}, skipped


def policy_micro_loss(model: torch.nn.Module, algorithm: Algorithm, config: GRPOConfig, batch: Batch,
                      advantages: torch.Tensor):
    """micro_loss(rows, epoch, total) for update(): the algorithm's loss of those rows of the batch over
    the minibatch's count `total`, and the tensors the log sums. Every tensor lives on the policy's device."""
    rollout, loss_mask, layout = batch.rollout, batch.loss_mask, batch.layout
    ref_logp, old_logp = batch.ref_logp, batch.old_logp
    with_ref = ref_logp is not None and algorithm.loss_beta > 0
    policy_mask = rollout.policy_mask  # [N, T], once for every micro-batch

    def micro_loss(micro: torch.Tensor, epoch: int, total: float | None = None):
        mask = loss_mask[micro]
        logp, entropy = token_logprobs(model, rollout.input_ids[micro], rollout.attention_mask[micro],
                                       rollout.prompt_length, config.temperature, len(micro), with_entropy=epoch == 0,
                                       **layout.forward_options())
        old = old_logp[micro] if old_logp is not None else logp.detach()
        sampling = rollout.sampling_logp[micro] if rollout.sampling_logp is not None else None
        loss, stats = algorithm.loss(logp, old, ref_logp[micro] if with_ref else None, advantages[micro],
                                     mask, total, sampling)
        tokens = stats["tokens"]
        sums = {key: stats[key] * tokens for key in ("kl", "clip_fraction", "ratio_mean", "policy_loss")}
        sums.update(loss=loss.detach(), tokens=tokens)
        if sampling is not None:  # how far the engine's log-probs are from the trainer's pi_old
            sums["rollout/logp_mismatch"] = ((old.to(sampling.dtype) - sampling).abs() * mask).sum()
        # the correction's own shares: tis is_capped_frac, icepop is_dropped_frac, ...
        sums.update({f"rollout/{k}": v * tokens for k, v in stats.items() if k.startswith("is_")})
        if entropy is not None:
            cm = policy_mask[micro].to(entropy.dtype)
            sums.update(entropy_sum=(entropy * cm).sum(), entropy_tokens=cm.sum())
        return loss, sums

    return micro_loss


def policy_metrics(sums: dict, skipped: int) -> dict:
    """The step's policy metrics from update()'s sums: token means, the mean loss and grad norm over
    optimizer steps, the entropy, and how many steps were skipped."""
    tokens = sums.get("tokens", 0.0)
    out = {k: sums[k] / tokens for k in ("kl", "clip_fraction", "ratio_mean", "policy_loss") if k in sums} \
        if tokens else {"kl": 0.0, "clip_fraction": 0.0, "ratio_mean": 1.0}
    out["loss"] = sums.get("loss", 0.0) / max(1.0, sums.get("optimizer_steps", 0.0))  # mean over optimizer steps
    out.update({k: v / tokens for k, v in sums.items() if k.startswith("rollout/") and tokens})
    out["entropy"] = sums["entropy_sum"] / sums["entropy_tokens"] if sums.get("entropy_tokens") else float("nan")
    out["grad_norm"] = sums["grad_norm_sum"] / sums["optimizer_steps"] if sums.get("optimizer_steps") else 0.0
    out["skipped_updates"] = skipped
    return out



# micro_batches, this module's old name (grpokit.micro_batches is the module of that name)
__getattr__ = renamed_names(__name__, {"micro_batches": (split_minibatch, "split_minibatch")})
