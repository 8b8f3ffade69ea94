"""Train a SentencePiece vocabulary (T5 id layout, newline kept as a piece) -> terra.data.vocabulary_training.

  python scripts/train_vocab.py --embedded --out vocab/spm-8k.model --vocab_size 8000
  python scripts/train_vocab.py --input corpus.txt [--input more.txt] --out my.model
  python scripts/train_vocab.py --task c4_span_corruption --c4_json /data/c4 --max_documents 200000 \
      --out vocab/c4-32k.model --vocab_size 32000   # the paper's size, from the user's C4

--input files are UTF-8 text, one document per blank-line-separated block (``--documents
lines`` for one per line). Same as ``python -m terra.data.vocabulary_training``.
"""

import sys

from terra.tensorflow_setup import import_tensorflow_quietly

if __name__ == "__main__":
    import_tensorflow_quietly()  # before terra.data imports it
    from terra.data.vocabulary_training import main

    sys.exit(main())
