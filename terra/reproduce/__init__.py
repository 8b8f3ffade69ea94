"""The paper's claims reproduced at small scale, one command each (``terra-reproduce``):

* ``sparsity`` (:mod:`terra.reproduce.sparsity`): sparse models reach the dense model's eval
  log-perplexity at the same steps (Figures 1, 3, 5, 7), with their decode times;
* ``length_generalization`` (:mod:`terra.reproduce.length_generalization`): Terraformer against
  Transformer on copy and addition twice as long as in training (Table 4).

Both train through the trainer of ``terra-train`` from the shipped gin configs (:mod:`terra.reproduce.runs`).
"""
