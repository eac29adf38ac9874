"""Training loops: SFT (pi_SFT) and GRPO."""
