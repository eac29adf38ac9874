"""The trainer's checkpoint job: what a checkpoint holds besides the policy's weights, how every
process writes its part, and how a run resumes exactly where the state says. Mixed into Trainer
(train/loop.py), whose attributes it reads: the policy, optimizer, scheduler, prompt order, sampler,
failure streaks, algorithm and run directory."""

from __future__ import annotations

import shutil
from pathlib import Path

from grpokit import distributed
from grpokit.models.lora import merged_state_dict
from grpokit.models.sharding import full_state_dict, load_optimizer_state, local_tensors
from grpokit.models.wrapping import is_sharded
from grpokit.run.checkpoint import rank_state_file
from grpokit.run.metrics import truncate_metrics
from grpokit.train import state as train_state


class Checkpointing:
    """save_checkpoint / resume_from, and the trainer state they carry (state_dict / load_state_dict)."""

    def state_dict(self) -> dict:
        """What an exact resume needs besides the weights: this process's part (optimizer shards,
        RNG streams); the data order and step are the same on every process."""
        return {
            "global_step": self.global_step,
            "world_size": self.world_size,
            "optimizer": local_tensors(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.prompts.state_dict(),
            **self.failures.state_dict(),
            **self.sampler.state_dict(),
            "rng": train_state.capture_rng(),
            **self.algorithm.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.global_step = int(state["global_step"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.prompts.load_state_dict(state["sampler"], train_state.as_tuple)
        self.failures.load_state_dict(state)
        self.sampler.load_state_dict(state, self.global_step)
        self.algorithm.load_state_dict(state)
        train_state.restore_rng(state["rng"])

    def save_checkpoint(self) -> Path:
        """checkpoints/step-N: HF weights + trainer state + config, atomically; `latest` -> it.
        Every process calls it: rank 0 writes the gathered weights, each process its own state."""
        self.algorithm.before_save()  # gathers what the algorithm saves (collective under FSDP2)
        self.sampler.before_save(self.global_step)
        # the full weights, gathered once (collective under FSDP2; on rank 0)
        self._gathered = full_state_dict(self.model) if is_sharded(self.model) or self.save_merged else None
        try:
            return self.checkpoints.save(self.global_step, self.model, self.tokenizer, self._write_extra_files,
                                         rank_extra=self._write_rank_state, state_dict=self._gathered)
        finally:
            self._gathered = None

    def _write_extra_files(self, directory: Path) -> None:
        """Everything besides the policy that goes into a checkpoint (rank 0)."""
        self.algorithm.save_files(directory)
        if self.save_merged:  # the merged model, loadable with from_pretrained alone
            self.model.get_base_model().save_pretrained(directory / "merged", safe_serialization=True,
                                                        state_dict=merged_state_dict(self.model, self._gathered))
            self.tokenizer.save_pretrained(directory / "merged")
        if (self.run_dir / "config.yaml").is_file():
            shutil.copyfile(self.run_dir / "config.yaml", directory / "config.yaml")

    def _write_rank_state(self, directory: Path) -> None:
        """This process's trainer state: trainer_state.pt on rank 0, trainer_state.rank{r}.pt on rank r."""
        train_state.save_state(self.state_dict(), directory / rank_state_file(self.rank))

    def resume_from(self, checkpoint: str | Path) -> None:
        """Restore trainer state from `checkpoint` (the weights are loaded by the caller) and drop
        metrics rows logged after it, so the log continues exactly where the state does."""
        self.algorithm.load_files(Path(checkpoint))
        self.load_state_dict(train_state.load_state(Path(checkpoint) / rank_state_file(self.rank)))
        if distributed.is_main():
            truncate_metrics(self.run_dir / "metrics.jsonl", self.global_step)
        if self.engine.copies_weights:  # the engine was built from the base (LoRA): give it the resumed adapter
            self.push_weights(self.global_step)
