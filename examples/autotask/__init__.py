"""A task without a reward function: inputs generated from a one-line description, groups judged (README.md)."""
