"""``python -m terra.train --gin_file=... [--gin_file=...] --gin.NAME=VALUE ...``

Pretraining and fine-tuning from gin: the named files (model, task, run; or one experiment that
includes them) and any binding overridden on the command line (the T5X form). Data locations
come as flags (``--tfds_data_dir``, ``--c4_json``, ``--arxiv_cohan``, ``--vocabulary``).
Multi-host: start one process per host with ``--coordinator host:port --num_processes N
--process_id i`` (or the ``TERRA_COORDINATOR``/``TERRA_NUM_PROCESSES``/``TERRA_PROCESS_ID``
environment); ``scripts/launch_local_multihost.sh`` shows it on one machine.

Examples::

  python -m terra.train --gin_file=experiments/quickstart.gin --gin.MODEL_DIR="'runs/quick'"
  python -m terra.train --gin_file=experiments/pretrain_c4_dense_800m.gin \\
      --gin.MODEL_DIR="'/runs/dense'" --c4_json=/data/c4 --vocabulary=vocab/c4-32k.model
"""

import argparse
import sys
from typing import Optional, Sequence

from terra import gin_utils


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m terra.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coordinator", default=None, help="host:port of process 0 (multi-host)")
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    gin_utils.add_gin_flags(parser)
    from terra.data import tasks  # registers the data configurables before gin is parsed

    tasks.add_data_flags(parser)
    known, _ = parser.parse_known_args([a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--gin.")])
    from terra.parallel import mesh

    # Before anything creates the JAX backend.
    mesh.initialize_distributed(
        coordinator_address=known.coordinator, num_processes=known.num_processes, process_id=known.process_id)
    import terra.training.trainer as trainer

    gin_utils.parse_flags(parser, argv, flag_bindings=tasks.data_flag_bindings)
    try:
        result = trainer.Trainer().run()
    except RuntimeError as e:
        if "Required bindings" in str(e):  # a %gin.REQUIRED macro or Trainer argument left unset
            raise gin_utils.explain_gin_error(e, "running terra.train") from None
        raise
    print(f"terra.train: finished at step {result.step}" + (" (preempted; rerun to resume)" if result.preempted else ""))
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(lambda: main(sys.argv[1:]))
