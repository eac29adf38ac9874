"""Measurements: the cost of GRPO vs PPO, measured (`cost`) and estimated (`memory`)."""
