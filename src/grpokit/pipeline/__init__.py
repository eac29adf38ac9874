"""The top of grpokit: the stages of a run (SFT, GRPO, PPO, reward models, evaluation) and how the
command line composes them; where a run resumes; the before/after report; the rollout-worker process."""
