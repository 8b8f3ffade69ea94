"""``python -m terra.summarize --checkpoint MODEL_DIR FILE...``: summarize your own documents.

Each FILE is a plain-text document, or Cohan-format JSON (one paper per line with
``article_text``, as the arXiv release), or ``-`` for standard input. The run's own
``config.gin`` gives the model, the vocabulary and the input length, and the text goes through
the training preprocessing: ``<S>``/``</S>`` tags removed, tokenized, truncated to the model's
input length (with a note on standard error) and closed with EOS. Summaries go to standard
output, one block per document. Decoding is greedy unless ``--temperature`` is set (the paper
sampled its abstracts at 0.5).

  python -m terra.summarize --checkpoint runs/quickstart/finetune my_notes.txt
  cat paper.txt | python -m terra.summarize --checkpoint /runs/terraformer_arxiv --temperature 0.5 -
"""

import argparse
import json
import sys
from typing import List, Optional, Sequence, Tuple


from terra import gin_utils
from terra.errors import ConfigError, InputError
from terra.text_encoding import clean_article, encode_text


def _decode_utf8(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); convert it first, "
            f"e.g. `iconv -f latin1 -t utf-8 {name} > {name}.utf8`."
        ) from None


def _documents(text: str, name: str) -> List[Tuple[str, str]]:
    """``[(label, article text)]``: Cohan JSON lines (one paper each) or the whole plain text."""
    from terra.data.sources import cohan_example

    lines = [l for l in text.splitlines() if l.strip()]
    records = []
    if lines and lines[0].lstrip().startswith("{"):
        try:
            records = [json.loads(l) for l in lines]
        except json.JSONDecodeError:
            records = []
    if records and all(isinstance(r, dict) and "article_text" in r for r in records):
        docs = []
        for i, r in enumerate(records):
            label = f"{name} [{r.get('article_id', i)}]"
            docs.append((label, cohan_example(r)["article"]))
        return docs
    return [(name, text)]


def read_documents(paths: Sequence[str], stdin=None) -> List[Tuple[str, str]]:
    """Every document of every path; raises ``InputError`` naming each unusable file."""
    docs, problems = [], []
    for path in paths:
        name = "standard input" if path == "-" else path
        try:
            if path == "-":
                data = (stdin or sys.stdin.buffer).read()
            else:
                with open(path, "rb") as f:
                    data = f.read()
            found = _documents(_decode_utf8(data, name), name)
            for label, text in found:
                if not clean_article(text):
                    raise InputError(f"{label} is empty: there is no text to summarize.")
            docs += found
        except OSError as e:
            problems.append(f"{name}: cannot be read ({e.strerror or e}).")
        except InputError as e:
            problems.append(str(e))
    if problems:
        raise InputError("nothing was summarized:\n  " + "\n  ".join(problems))
    return docs


def main(argv: Optional[Sequence[str]] = None, stdin=None, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    parser = argparse.ArgumentParser(
        prog="python -m terra.summarize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="plain-text or Cohan-JSON files; - reads standard input")
    parser.add_argument("--checkpoint", required=True, help="a terra model_dir (its config.gin and checkpoints)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--max_decode_length", type=int, default=None, help="default: the run's target length")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--force", action="store_true",
                        help="summarize with a run whose task is not a summarization task anyway")
    from terra.data import tasks

    tasks.add_data_flags(parser)
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    bindings, unknown = gin_utils.split_gin_args(extra)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature={args.temperature} must be >= 0 (0 is greedy).")
    docs = read_documents(args.files, stdin)  # bad input fails before the model is loaded

    from terra import api

    run = api.load(args.checkpoint, args.step, [*tasks.data_flag_bindings(args), *bindings],
                   require_summarization=not args.force)
    lengths = run.feature_lengths
    encoded = []
    for label, text in docs:
        ids, note = encode_text(text, run.vocabulary, lengths["inputs"], run.config.eos_id)
        if note:
            print(f"note: {label}: {note}.", file=err)
        encoded.append(ids)
    tokens = run.generate(encoded, max_new_tokens=args.max_decode_length or lengths["targets"],
                          temperature=args.temperature, seed=args.seed, batch_size=min(args.batch_size, len(encoded)))
    step = run.step
    for (label, _), summary in zip(docs, tokens):
        print(f"== {label} (step {step})", file=out)
        print(run.vocabulary.decode([int(t) for t in summary if t not in (run.config.eos_id, run.config.pad_id)]), file=out)
        print(file=out)
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(lambda: main(sys.argv[1:]))
