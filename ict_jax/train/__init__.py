"""A training run: building it from a Config, the loop, checkpoints, run logs."""
