"""Run configs: the trainer's and the evaluator's bindings from macros."""
