"""Experiments: a model, a task and a run config, composed."""
