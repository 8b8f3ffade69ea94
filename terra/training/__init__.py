"""Training pieces: losses (the trainer, optimizers and checkpointing plug in here)."""
