"""terra's command line: one module per console command, on absl flags.

| command | module (``python -m``) | what it does |
|---|---|---|
| ``terra-train`` | ``terra.cli.train`` | pretrain or fine-tune from gin files |
| ``terra-evaluate`` | ``terra.cli.evaluate`` | decode a split from a checkpoint, score ROUGE and log-perplexity |
| ``terra-summarize`` | ``terra.cli.summarize`` | summarize your own documents |
| ``terra-bench`` | ``terra.cli.bench`` | decode speed, training throughput, input pipelines, reversible memory |
| ``terra-reproduce`` | ``terra.cli.reproduce`` | the sparsity and length-generalization studies |
| ``terra-data`` | ``terra.cli.data`` | show a task's examples; prepare arXiv offline |
| ``terra-params`` | ``terra.cli.params`` | parameter counts and weights read per decoded token |
| ``terra-vocab`` | ``terra.cli.vocab`` | train a SentencePiece vocabulary |
| ``terra-quickstart`` | ``terra.cli.quickstart`` | the job behind ``make run`` |
| ``terra-convert`` | ``terra.cli.convert`` | convert the paper's Trax checkpoints |

:mod:`terra.cli.app` parses and runs them; :mod:`terra.cli.flag_groups` holds the flags several
commands share. Library modules have no command line of their own.
"""
