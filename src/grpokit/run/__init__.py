"""A run on disk and in the console: its directory and lock, checkpoints, metrics.jsonl and the
loggers beside it, progress lines, and the signals that stop it cleanly."""
