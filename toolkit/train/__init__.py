"""Training runtime: process groups, the step loop, metrics and resumable checkpoints."""
