"""The Python API: a trained run or a fresh model, ready to generate, score and read logits.

    import terra

    run = terra.load("runs/quickstart/finetune")          # a training run's model_dir
    run.generate(["A long document ..."], max_new_tokens=32, num_beams=4)
    run.score(["A long document ..."], ["its summary"])   # log-likelihood per example
    fresh = terra.build(["models/tiny.gin", "tasks/embedded_lm.gin"])
    fast = terra.load("runs/quickstart/finetune", weights_dtype="int8")  # narrow weights for decoding
    timed = terra.build(["models/terraformer_lsh_800m.gin", "tasks/arxiv_summarization_paper.gin"],
                        random_weights=True, weights_dtype="int8")   # random weights, for timing
    timed.generate([paper], max_new_tokens=256, timing=print)     # prefill and loop seconds per batch

``load`` reads the run's own ``config.gin`` (the model, task, vocabulary and lengths it trained
with) and its latest checkpoint; ``build`` parses gin files and initialises parameters from a
seed. Neither finalizes gin, and every configurable module is imported before parsing, so
importing any terra module afterwards, in any order, raises no gin lock error. Texts go through
the task's vocabulary (with EOS); token arrays (``[batch, length]`` ints, pad 0) are used as
they are. Texts longer than the task's feature lengths are truncated with a warning (once per
model and feature; ``truncate=True`` accepts it silently, ``truncate=False`` refuses). ``load`` and
``build`` may be called from several threads: gin's configuration is global, so one lock holds it
from parsing to the built model.
"""

import dataclasses
import functools
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from terra.tensorflow_setup import quiet_tensorflow_logging

# The API is a notebook's way in: TensorFlow (loaded with terra.data for a model's task) logs
# without its C++ warnings unless the user set TF_CPP_MIN_LOG_LEVEL.
quiet_tensorflow_logging()

import gin  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from terra import files, tensorflow_setup  # noqa: E402
from terra.data import catalog  # noqa: E402  (no seqio: the tasks' names and objectives)
from terra.data.python_vocabulary import PythonSentencePieceVocabulary  # noqa: E402
from terra.decoding import streaming  # noqa: E402
from terra.errors import ConfigError  # noqa: E402
from terra.gin_config import parsing  # noqa: E402
from terra.models.protocol import Model  # noqa: E402
from terra.quantization import check_weights_dtype, quantize_params, weights_dtype_of  # noqa: E402
from terra.text_encoding import clean_article, encode_text  # noqa: E402
from terra.training import checkpointing, run_directory  # noqa: E402

Inputs = Union[str, Sequence[str], np.ndarray, jax.Array, Sequence[Sequence[int]]]

# gin's configuration is one global: a parse and the build that reads it must not interleave with
# another thread's (load/build from two threads would otherwise mix their configs).
_CONFIG_LOCK = threading.RLock()


def run_config_path(model_dir: str) -> str:
    """The absolute path (or URL) of a training run's ``config.gin``; a clear error when there is none."""
    return run_directory.config_path(model_dir)


@dataclasses.dataclass
class InteractiveModel:
    """A model with its parameters, vocabulary and task, for use from Python.

    Attributes:
      model: the ``terra.models.Model`` (network, config, decode contract).
      params: its parameters (a pytree of arrays).
      vocabulary: the task's vocabulary (None when the config names no task: token arrays only): a
        seqio vocabulary, or for a summarization run a ``PythonSentencePieceVocabulary`` with the same
        ids (opened without seqio and TensorFlow).
      task_name: the name of the task (or mixture) the run trained on, or None.
      task (property): the seqio task itself, built on first use (for a summarization run, from
        the run's own config, with the data layer loaded then).
      feature_lengths: ``{"inputs": ..., "targets": ...}``: texts are truncated to these.
      step: the checkpoint step (None for a fresh model).
      model_dir: the run's directory (None for a fresh model).
      weights_dtype: how ``params`` store the weights: 'float32', or 'int8' / 'bfloat16' (a decode
        tree of ``terra.quantization``: generation, scores and logits read the narrow weights).
      config_text: the gin config the model was built from (a run's ``config.gin`` and the
        bindings that opened it, or the parsed files of ``build``): what :meth:`save` writes.
    """

    model: Model
    params: Any
    vocabulary: Any = None
    task_name: Optional[str] = None
    feature_lengths: Dict[str, int] = dataclasses.field(default_factory=dict)
    step: Optional[int] = None
    model_dir: Optional[str] = None
    weights_dtype: str = "float32"
    config_text: Optional[str] = dataclasses.field(default=None, repr=False, compare=False)
    # The seqio task, or what builds it on first use (a run opened without the data layer).
    _task: Any = dataclasses.field(default=None, repr=False, compare=False)
    _build_task: Optional[Callable[[], Any]] = dataclasses.field(default=None, repr=False, compare=False)
    _warned_truncation: set = dataclasses.field(default_factory=set, init=False, repr=False, compare=False)
    # (max_new_tokens, input shape) -> the compiled prefill and generation loop of timed generation
    _compiled: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def config(self):
        return self.model.config

    @property
    def task(self):
        """The seqio task (or mixture) the run trained on, or None; built on first use where
        the run was opened without the data layer."""
        if self._task is None and self._build_task is not None:
            self._task = self._build_task()
        return self._task

    def quantized(self, weights_dtype: str) -> "InteractiveModel":
        """The same model with its float32 weights stored as ``weights_dtype`` ('int8',
        'bfloat16'; 'float32' returns ``self``), e.g. to compare a run's outputs at both widths."""
        if check_weights_dtype(weights_dtype) == self.weights_dtype:
            return self
        if self.weights_dtype != "float32":
            raise ConfigError(
                f"these weights are already {self.weights_dtype}; quantize from the float32 run (terra.load) instead."
            )
        params = quantize_params(self.params, weights_dtype)
        return dataclasses.replace(self, params=params, weights_dtype=weights_dtype)

    def save(self, path: str) -> str:
        """Writes the model as a run directory at ``path`` (a new or empty folder) and returns its
        absolute path: ``config.gin`` (the config it was built from), the vocabulary's
        SentencePiece model (``vocabulary/sentencepiece.model``, where it has one) and an orbax
        checkpoint of ``params`` at ``step`` (0 for a fresh model), narrow weights as they are
        stored. ``terra.load``, ``terra-evaluate --checkpoint`` and ``terra-summarize --checkpoint``
        open it; ``INIT_FROM`` reads its parameters, and ``terra-train`` with ``MODEL_DIR`` there
        continues it from its step with a fresh optimizer (float32 weights only). The folder
        appears whole or not at all: it is written beside ``path`` and renamed into place."""
        from terra import run_config

        if self.config_text is None:
            raise ConfigError("this model has no gin config to save with it: build it with terra.build or terra.load.")
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"path must be a folder to create (a path string), not {type(path).__name__} {path!r}.")
        target = files.absolute(os.fspath(path))
        if files.has_scheme(target):
            raise ConfigError(f"save writes a local folder; copy it to {target} afterwards (e.g. gsutil -m cp -r).")
        if os.path.lexists(target) and (os.path.islink(target) or not os.path.isdir(target) or os.listdir(target)):
            raise ConfigError(f"{target} exists and is not an empty folder: save into a new folder.")
        run_config.check_text(self.config_text, os.path.join(target, run_directory.CONFIG_FILE))
        parent = os.path.dirname(target)
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.saving-", dir=parent)
        try:
            run_directory.write_config(staging, self.config_text)
            run_directory.save_vocabulary(staging, self.vocabulary)  # nothing for one without a file
            checkpointing.save_params(staging, self.params, self.step or 0)
            try:
                if os.path.isdir(target):
                    os.rmdir(target)  # empty: checked above
                os.rename(staging, target)
            except OSError as error:  # another save (a thread, a process) filled the folder meanwhile
                problem = f"{target} could not be written ({error.strerror}): save into a new folder."
                raise ConfigError(problem) from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target

    def __repr__(self) -> str:
        where = f"{self.model_dir} step {self.step}" if self.model_dir else "fresh parameters"
        narrow = "" if self.weights_dtype == "float32" else f", {self.weights_dtype} weights"
        return f"InteractiveModel({self.model!r}, task={self.task_name}, {where}{narrow})"

    # ----- inputs ----------------------------------------------------------------------------
    def _length(self, feature: str) -> int:
        return int(self.feature_lengths.get(feature, self.config.max_len))

    def tokens(
        self, inputs: Inputs, feature: str = "inputs", *, truncate: Optional[bool] = None
    ) -> Tuple[np.ndarray, bool]:
        """``([batch, length] int32, were_texts)``: texts encoded with EOS and cut to the feature's
        length (``truncate``: None warns once per feature, True cuts silently, False refuses), or
        token rows padded with the pad id to the longest row."""
        if isinstance(inputs, str):
            inputs = [inputs]
        if len(inputs) and all(isinstance(x, str) for x in inputs):
            if self.vocabulary is None:
                raise ConfigError(
                    "this model's config names no task, so there is no vocabulary for texts: "
                    "pass token arrays, or build it with a task gin file."
                )
            empty = [i for i, x in enumerate(inputs) if not clean_article(x)]
            if empty:
                raise ConfigError(f"{feature} text {empty[0]} is empty: give every text some words.")
            length = self._length(feature)
            encoded = [encode_text(x, self.vocabulary, length, self.config.eos_id, feature) for x in inputs]
            self._check_truncation(feature, [(i, note) for i, (_, note) in enumerate(encoded) if note], truncate)
            return self._pad([ids for ids, _ in encoded], length), True
        if isinstance(inputs, (np.ndarray, jax.Array)) and inputs.ndim == 1:
            inputs = inputs[None]
        rows = [np.asarray(r).reshape(-1) for r in inputs]
        if not rows or any(r.size == 0 for r in rows):
            raise ConfigError("give at least one non-empty text or token row.")
        if any(not np.issubdtype(r.dtype, np.integer) for r in rows):
            raise ConfigError("token rows must hold integer ids.")
        too_big = [int(r.max()) for r in rows if r.max() >= self.config.vocab_size or r.min() < 0]
        if too_big:
            raise ConfigError(f"token id {too_big[0]} is outside the model's vocabulary [0, {self.config.vocab_size}).")
        return self._pad(rows, max(len(r) for r in rows)), False

    def _check_truncation(self, feature: str, notes: List[Tuple[int, str]], truncate: Optional[bool]) -> None:
        if not notes or truncate:
            return
        first, note = notes[0]
        what = f"{len(notes)} {feature} text(s) exceed the task's {feature} length (text {first}: {note})"
        if truncate is False:
            raise ConfigError(f"{what}; shorten them, or pass truncate=True to use the first tokens.")
        if feature not in self._warned_truncation:
            self._warned_truncation.add(feature)
            warnings.warn(
                f"{what}; only the first tokens are used (truncate=True silences this, truncate=False "
                "refuses such texts).",
                stacklevel=4,
            )

    def _pad(self, rows, length: int) -> np.ndarray:
        out = np.full((len(rows), length), self.config.pad_id, np.int32)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row[:length]
        return out

    def _texts(self, tokens: np.ndarray, lengths: np.ndarray) -> List[str]:
        eos = self.config.eos_id
        return [self.vocabulary.decode([int(t) for t in row[:n] if t != eos]) for row, n in zip(tokens, lengths)]

    # ----- generation ------------------------------------------------------------------------
    def generate(
        self,
        inputs: Inputs,
        *,
        max_new_tokens: Optional[int] = None,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        num_beams: int = 1,
        length_penalty: float = 0.0,
        seed: int = 0,
        batch_size: Optional[int] = None,
        truncate: Optional[bool] = None,
        progress: bool = False,
        timing: Optional[Callable[[dict], Any]] = None,
        stop_at_eos: bool = True,
        streamer: Optional[Callable[[int, Any], Any]] = None,
        repetition_penalty: float = 1.0,
        no_repeat_ngram_size: int = 0,
        num_return_sequences: int = 1,
        stop_strings: Optional[Sequence[str]] = None,
        return_scores: bool = False,
    ) -> Union[List[str], np.ndarray, Tuple[Union[List[str], np.ndarray], List[np.ndarray]]]:
        """Decode every input, ``batch_size`` rows at a time (default: all at once).

        Args:
          inputs: a text or texts (returns texts), or token rows (returns ``[batch, n]`` int32
            tokens, EOS included and pad after it).
          max_new_tokens: most tokens per output (default: the target feature length).
          temperature, top_k, top_p: 0 is greedy; otherwise sampling, optionally from the
            ``top_k`` most likely tokens or the ``top_p`` nucleus; reproducible for a ``seed``.
          num_beams, length_penalty: beam search when ``num_beams > 1``.
          truncate: texts beyond the input length: None cuts them with a warning (once), True
            cuts them silently, False refuses them.
          progress: a bar on standard error over the inputs, with their rate and the time left
            (for long lists decoded ``batch_size`` at a time).
          timing: called as each phase of a batch ends (``num_beams == 1`` only) with a dict:
            ``phase`` ('compiled', only for the first batch of a shape; 'prefilled'; 'generated',
            the last, with every field), ``batch`` (from 0), ``rows``, ``input_tokens`` (non-pad
            tokens of its inputs), ``input_length`` (each row's padded length, what the encoder
            reads), ``compile_s`` (compiling the prefill and the generation loop ahead of the timed
            calls; 0 after the first batch of a shape; in neither time below), ``prefill_s``,
            ``steps`` (tokens generated per row, EOS included) and ``loop_s`` (the jitted
            generation loop: ``steps`` decode steps and their token choices). Each time ends at
            ``block_until_ready``.
          stop_at_eos: False runs every row for ``max_new_tokens`` steps, EOS or not (timing a
            random-weights model, whose greedy EOS would end the loop at an arbitrary step;
            ``num_beams == 1`` only).
          streamer: called as the jitted generation loop decodes, ``streamer(row, piece)``: ``row``
            the output's index, ``piece`` for texts the text that became whole words (a word is
            held back until it ends; the pieces of a row joined are its returned text), for token
            rows each token id (EOS and what follows not included). It runs on a thread of the
            decode (the native queue's reader, or XLA's between steps); an exception it raises
            ends the loop and is raised here (``num_beams == 1`` only; :meth:`stream` iterates
            over the same pieces).
          repetition_penalty: the CTRL penalty of tokens a row has generated already, > 1 to
            discourage them (1 is off); no_repeat_ngram_size: a token that would repeat an n-gram
            of the row is never chosen (0 is off, at most 8). Both act inside the jitted loop on
            each step's logits, greedy or sampled, as Hugging Face's processors of those names.
          num_return_sequences: sampled outputs per input (``temperature > 0``), returned one
            input after another: ``[in0 out0, in0 out1, ..., in1 out0, ...]``.
          stop_strings: texts only: a row ends once its text contains one of them (kept, what
            follows dropped); the loop ends once every row has.
          return_scores: also return, per output, the log-probability (nats) of each of its
            tokens under the model (EOS included): ``(outputs, [float32 array per output])``.
        """
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ConfigError(f"max_new_tokens must be a whole number of at least 1, not {max_new_tokens!r}.")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ConfigError(f"batch_size must be a whole number of at least 1, not {batch_size!r}.")
        if (timing is not None or not stop_at_eos) and num_beams != 1:
            raise ConfigError("timing and stop_at_eos=False time the sampling loop: use them with num_beams=1.")
        if streamer is not None and num_beams != 1:
            raise ConfigError(
                "streaming hands over each chosen token; beam search ranks its beams at the end: num_beams=1."
            )
        from terra.decoding.generate import checked_controls

        try:
            controls = checked_controls(repetition_penalty, no_repeat_ngram_size, return_scores)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if controls is not None and num_beams != 1:
            raise ConfigError(
                "repetition_penalty, no_repeat_ngram_size and return_scores act on the sampling loop: num_beams=1."
            )
        if not isinstance(num_return_sequences, int) or num_return_sequences < 1:
            raise ConfigError(
                f"num_return_sequences must be a whole number of at least 1, not {num_return_sequences!r}."
            )
        if num_return_sequences > 1 and (temperature <= 0 or num_beams != 1):
            raise ConfigError(
                f"num_return_sequences={num_return_sequences} samples several outputs per input: set temperature > 0 "
                "(greedy decoding gives one), with num_beams=1."
            )
        stop_strings = _stop_strings(stop_strings)
        tokens, were_texts = self.tokens(inputs, truncate=truncate)
        if stop_strings and not were_texts:
            raise ConfigError("stop_strings end texts: give texts, not token rows (or stop on a token with EOS).")
        tokens = np.repeat(tokens, num_return_sequences, axis=0)  # each input's outputs side by side
        max_new_tokens = max_new_tokens or self._length("targets")
        batch_size = batch_size or len(tokens)
        from tqdm import tqdm

        outputs, lengths, scores = [], [], []
        bar = tqdm(
            total=len(tokens), desc="generate", unit="input", file=sys.stderr, dynamic_ncols=True, disable=not progress
        )
        with bar:
            for start in range(0, len(tokens), batch_size):
                chunk = tokens[start : start + batch_size]
                rows = len(chunk)
                if rows < batch_size:  # one shape per call: pad the last chunk with pad rows
                    chunk = np.concatenate(
                        [chunk, np.full((batch_size - rows, chunk.shape[1]), self.config.pad_id, np.int32)]
                    )
                options = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + start)
                stream = None
                if streamer is not None or stop_strings:
                    stream = streaming.BatchStream(
                        streamer or (lambda row, piece: None),
                        rows=rows,
                        eos_id=self.config.eos_id,
                        first_row=start,
                        vocabulary=self.vocabulary if were_texts else None,
                        stop_strings=stop_strings,
                    )
                    options["stream"] = stream
                if timing is not None or not stop_at_eos:
                    about = dict(
                        batch=start // batch_size,
                        rows=rows,
                        input_tokens=int(np.sum(chunk[:rows] != self.config.pad_id)),
                        input_length=int(chunk.shape[1]),
                    )
                    result = self._timed_generation(
                        chunk, max_new_tokens, stop_at_eos, timing, about, controls=controls, **options
                    )
                else:
                    result = self.model.generate(
                        self.params,
                        chunk,
                        max_decode_length=max_new_tokens,
                        num_beams=num_beams,
                        length_penalty=length_penalty,
                        repetition_penalty=repetition_penalty,
                        no_repeat_ngram_size=no_repeat_ngram_size,
                        return_scores=return_scores,
                        **options,
                    )
                if stream is not None:
                    stream.finish()  # the rows' held-back words; a streamer's exception is raised
                out = np.full((rows, max_new_tokens), self.config.pad_id, np.int32)
                out[:, : result.tokens.shape[1]] = result.tokens[:rows]
                outputs.append(out)
                lengths.append(result.lengths[:rows])
                if return_scores:
                    scores += [row[:n] for row, n in zip(result.scores[:rows], result.lengths[:rows])]
                bar.update(rows)
        tokens_out, lengths_out = np.concatenate(outputs), np.concatenate(lengths)
        if were_texts:
            texts = [_cut_at_stop(text, stop_strings) for text in self._texts(tokens_out, lengths_out)]
            return (texts, scores) if return_scores else texts
        return (tokens_out, scores) if return_scores else tokens_out

    def _timed_generation(
        self,
        chunk,
        max_new_tokens: int,
        stop_at_eos: bool,
        timing,
        about: dict,
        *,
        temperature,
        top_k,
        top_p,
        seed,
        stream=None,
        controls=None,
    ):
        """One batch as ``terra.decoding.generate`` decodes it (the same prefill and jitted
        generation loop, so the same tokens for a seed), with the prefill and the loop compiled
        ahead of time (once per shape) and each timed to ``block_until_ready``; ``timing`` (unless
        None) is called with ``about`` and the times so far as each phase ends (see ``generate``)."""
        from terra.decoding.generate import finished

        if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
            raise ConfigError(f"temperature={temperature} must be >= 0, top_k={top_k} >= 1, top_p={top_p} in (0, 1].")

        def report(phase: str, **times) -> None:
            if timing is not None:
                timing(dict(about, phase=phase, **times))

        decoder = self.model.decoder(max_new_tokens)
        inputs = jnp.asarray(chunk, jnp.int32)
        pad, eos = self.config.pad_id, (self.config.eos_id if stop_at_eos else -1)  # -1: no token stops it
        start = jnp.full((inputs.shape[0],), pad, jnp.int32)
        rng = jax.random.key(seed)
        scalars = (
            jnp.int32(max_new_tokens),
            jnp.float32(temperature),
            jnp.int32(eos),
            jnp.int32(pad),
            jnp.int32(0 if top_k is None else top_k),  # 0 and 1.0 are the traced loop's "off"
            jnp.float32(1.0 if top_p is None else top_p),
        )
        # The stream's id and the controls are operands of the loop (None: the loop without them).
        opened = None if stream is None else streaming.open_stream(stream, inputs.shape[0])
        operands = (None if opened is None else opened.operand, controls)
        key = (max_new_tokens, inputs.shape, stream is not None, controls is not None)
        times = {"compile_s": 0.0}
        try:
            if key not in self._compiled:
                t0 = time.perf_counter()
                prefill = decoder.prefill.lower(self.params, inputs).compile()
                cache = jax.eval_shape(decoder.prefill, self.params, inputs)
                loop_fn = jax.jit(decoder.generate_tokens, donate_argnums=(1,))
                loop = loop_fn.lower(self.params, cache, start, rng, *scalars, *operands).compile()
                self._compiled[key] = (prefill, loop)
                times["compile_s"] = time.perf_counter() - t0
                report("compiled", **times)
            prefill, loop = self._compiled[key]
            t0 = time.perf_counter()
            cache = jax.block_until_ready(prefill(self.params, inputs))
            times["prefill_s"] = time.perf_counter() - t0
            report("prefilled", **times)
            t0 = time.perf_counter()
            out = jax.block_until_ready(loop(self.params, cache, start, rng, *scalars, *operands))
            times["loop_s"] = time.perf_counter() - t0
        finally:
            if opened is not None:
                opened.close()
        times["steps"] = int(out[1])
        report("generated", **times)
        return finished(out, self.config.eos_id, with_scores=controls is not None)

    def stream(self, inputs: Inputs, **options) -> Iterator[Tuple[int, Union[str, int]]]:
        """``(row, piece)`` pairs as the jitted generation loop decodes ``inputs``: for texts, text
        that became whole words (``generate``'s ``streamer``), for token rows each token id. The
        pieces of a row joined are what ``generate`` returns for it with the same options (any of
        ``generate``'s but ``num_beams`` and ``streamer``); the tokens are chosen inside the same
        loop, so a seed samples the same text.

            for row, piece in run.stream("A long document ...", max_new_tokens=64):
                print(piece, end="", flush=True)

        The decode runs on a thread of its own while the pieces are consumed; leaving the loop
        early (``break``, an exception) ends the decode after its next piece. Errors in the
        inputs or options are raised by the first ``next``."""
        pieces: "queue.SimpleQueue" = queue.SimpleQueue()
        consumer_gone = threading.Event()
        end = object()

        def hand_over(row, piece):
            if consumer_gone.is_set():
                raise _StreamAbandoned()
            pieces.put((row, piece))

        def decode():
            try:
                self.generate(inputs, streamer=hand_over, **options)
            except _StreamAbandoned:
                pass
            except BaseException as error:  # noqa: BLE001  (raised on the consumer's thread)
                pieces.put(error)
            pieces.put(end)

        thread = threading.Thread(target=decode, name="terra-stream", daemon=True)
        thread.start()
        try:
            while True:
                item = pieces.get()
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            consumer_gone.set()
            thread.join()

    def summarize(self, texts: Union[str, Sequence[str]], *, force: bool = False, **options) -> List[str]:
        """Summaries of ``texts`` (``generate`` options apply). Refuses a model whose task is not
        a summarization task (its outputs would be its pretraining objective's, e.g. sentinel
        tokens) unless ``force``."""
        if not force and (self.task_name is None or not catalog.is_summarization(self.task_name)):
            _summarization_required(self.task_name)
        return self.generate(texts, **options)

    # ----- teacher forcing -------------------------------------------------------------------
    def _batch(self, inputs: Inputs, targets: Inputs, truncate: Optional[bool]) -> Dict[str, jax.Array]:
        encoder, _ = self.tokens(inputs, "inputs", truncate=truncate)
        decoder, _ = self.tokens(targets, "targets", truncate=truncate)
        if len(encoder) != len(decoder):
            raise ConfigError(f"{len(encoder)} inputs but {len(decoder)} targets.")
        return {"encoder_input_tokens": jnp.asarray(encoder), "decoder_target_tokens": jnp.asarray(decoder)}

    @functools.cached_property
    def _jit_score(self):
        return jax.jit(self.model.score)

    @functools.cached_property
    def _jit_logits(self):
        return jax.jit(lambda params, batch: self.model.logits(params, batch))

    def score(self, inputs: Inputs, targets: Inputs, *, truncate: Optional[bool] = None) -> np.ndarray:
        """``[batch]`` float32 log-likelihood (nats) of each target given its input (texts get EOS,
        as the tasks' targets do; pad positions of token rows are not scored). ``truncate`` as in
        ``generate``: a target cut to the task's length is scored only on its first tokens."""
        return np.asarray(self._jit_score(self.params, self._batch(inputs, targets, truncate)))

    def logits(
        self, encoder_tokens: Inputs, decoder_target_tokens: Inputs, *, truncate: Optional[bool] = None
    ) -> jax.Array:
        """Teacher-forced logits ``[batch, target_length, vocab]`` float32 (the decoder reads the
        targets shifted right, the pad id first)."""
        return self._jit_logits(self.params, self._batch(encoder_tokens, decoder_target_tokens, truncate))


def _stop_strings(stop_strings) -> List[str]:
    if stop_strings is None:
        return []
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    if not isinstance(stop_strings, (list, tuple)) or not all(isinstance(s, str) and s for s in stop_strings):
        raise ConfigError(f"stop_strings must be non-empty strings, e.g. ['\\n\\n'], not {stop_strings!r}.")
    return list(stop_strings)


def _cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to and including the first of ``stop_strings`` in it (as a whole)."""
    end = streaming.stop_end(text, stop_strings)
    return text if end is None else text[:end]


class _StreamAbandoned(Exception):
    """Raised into a decode whose ``stream`` consumer has stopped iterating: ends its loop."""


def _tasks():
    """``terra.data.tasks``, the data layer registered first (seqio on TensorFlow: loaded only
    for a model with a task, so a model config alone builds without it). TensorFlow is imported
    as the commands import it, without the lines its C++ start-up prints past its log level
    (``import terra`` itself redirects nothing; this runs only once a model needs its task)."""
    tensorflow_setup.import_tensorflow_quietly()
    parsing.register_terra_configurables(data_layer=True)
    from terra.data import tasks

    return tasks


def _summarization_required(task_name: Optional[str]) -> None:
    objective = catalog.objective(task_name) if task_name is not None else "no"
    raise ConfigError(
        f"this model was trained on a {objective} task, not summarization: it would not write summaries. "
        "Use a run fine-tuned on a summarization task (e.g. experiments/finetune_arxiv_terraformer.gin), "
        "or force it (force=True, --force)."
    )


def _from_parsed_config(
    params_from,
    model_dir: Optional[str] = None,
    require_summarization: bool = False,
    text_vocabulary: Optional[Tuple[str, int]] = None,
    build_task: Optional[Callable[[], Any]] = None,
    config_text: Optional[str] = None,
):
    """The model the parsed config builds, its task and vocabulary, and ``params_from(model)``
    (``(params, step, how they store the weights)``).
    ``text_vocabulary``: ``(SentencePiece model file, extra_ids)`` of a summarization run opened
    without the data layer; its task is then built by ``build_task`` on first use."""
    model = parsing.build_model()
    task_name = parsing.bound_value("%TASK")
    if require_summarization and (task_name is None or not catalog.is_summarization(task_name)):
        _summarization_required(task_name)
    lengths = dict(parsing.bound_value("%TASK_FEATURE_LENGTHS", {}) or {})
    task = None
    if text_vocabulary is not None:
        vocabulary = PythonSentencePieceVocabulary(*text_vocabulary)
        sizes = {"inputs": vocabulary.vocab_size, "targets": vocabulary.vocab_size}
        catalog.check_fits(sizes, lengths, vocab_size=model.config.vocab_size, max_len=model.config.max_len)
    elif task_name:
        tasks = _tasks()
        task = tasks.resolve(task_name)
        vocabulary = task.output_features["targets"].vocabulary
        if lengths:
            tasks.check_vocabulary_and_lengths(
                task, lengths, vocab_size=model.config.vocab_size, max_len=model.config.max_len
            )
    else:
        vocabulary = None
    params, step, weights_dtype = params_from(model)
    return InteractiveModel(
        model=model,
        params=params,
        vocabulary=vocabulary,
        task_name=task_name,
        feature_lengths=lengths,
        step=step,
        model_dir=files.absolute(model_dir) if model_dir else None,
        weights_dtype=weights_dtype,
        config_text=config_text,
        _task=task,
        _build_task=build_task if text_vocabulary is not None else None,
    )


def _text_vocabulary(statements: Sequence[Any]) -> Optional[Tuple[str, int]]:
    """``(SentencePiece model file, extra_ids)`` when ``statements`` (a run's config, then the
    bindings that open it, then the user's; the last binding wins) train a summarization task
    whose texts go through ``text_vocabulary`` with a model file: what is needed to read and
    write its texts without building the task (or loading seqio and TensorFlow). None otherwise."""
    from gin import config_parser

    from terra.gin_config import registry_file

    values = {}
    for statement in statements:
        if isinstance(statement, config_parser.BindingStatement) and not statement.scope:
            selector = registry_file.full_selector(statement.selector) if statement.arg_name else statement.selector
            values[(selector, statement.arg_name)] = statement.value
    vocabulary = "terra.data.text_vocabulary"
    task, path = values.get(("TASK", "")), values.get((vocabulary, "spm_path"))
    extra_ids = values.get((vocabulary, "extra_ids"), catalog.EXTRA_IDS)
    spec = catalog.TASKS.get(task) if isinstance(task, str) else None
    if (
        spec is not None
        and spec.text_vocabulary
        and isinstance(path, str)
        and path
        and type(extra_ids) is int
        and values.get((vocabulary, "embedded_vocab_size")) is None
    ):
        return files.absolute(path), extra_ids
    return None


def _binding_statements(bindings: Sequence[str]) -> List[Any]:
    from terra.gin_config.reading import read_statements

    statements = []
    for binding in bindings:
        try:
            statements += read_statements(binding)
        except SyntaxError:  # gin reports it when the bindings are parsed
            pass
    return statements


def _step_number(step: Union[int, str, None]) -> Optional[int]:
    if step is None or (isinstance(step, int) and not isinstance(step, bool)):
        return step
    if isinstance(step, str) and step.strip().isdigit():
        return int(step)
    raise ConfigError(f"step must be a checkpoint's step number, e.g. 100, not {step!r}.")


def _strings(value: Any, argument: str, example: str) -> List[str]:
    """``value`` as a list of strings (one string or a sequence of them); a ConfigError naming
    ``argument`` and its expected form otherwise (a dict, None, a number)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(
        f"{argument} must be a string or a list of strings, e.g. {example}, not {type(value).__name__} {value!r}."
    )


def _bindings(bindings: Any) -> List[str]:
    if isinstance(bindings, dict):
        raise ConfigError(
            'bindings must be gin binding strings, e.g. ["TransformerConfig.d_ff = 96"], not a dict: '
            "write each entry as 'NAME = VALUE'."
        )
    return _strings(bindings, "bindings", '["TransformerConfig.d_ff = 96"]')


def _cache_dtype_bindings(cache_dtype: Optional[str]) -> List[str]:
    """The gin binding that stores the decode caches as ``cache_dtype`` (None: as configured)."""
    if cache_dtype is None:
        return []
    from terra.backends.decode_state import check_cache_dtype

    return [f"TransformerConfig.cache_dtype = {check_cache_dtype(cache_dtype)!r}"]


def load(
    model_dir: str,
    step: Union[int, str, None] = None,
    bindings: Union[str, Sequence[str]] = (),
    *,
    require_summarization: bool = False,
    weights_dtype: Optional[str] = None,
    cache_dtype: Optional[str] = None,
) -> InteractiveModel:
    """A training run's model, parameters (checkpoint ``step``, default the latest), task and
    vocabulary, configured by the run's own ``config.gin`` plus ``bindings`` (gin binding
    strings, e.g. data locations: ``"terra.data.arxiv_source.tfds_data_dir = '/data/tfds'"``).
    ``require_summarization``: refuse, before reading the checkpoint, a run whose task is not
    a summarization task. ``weights_dtype``: 'int8' or 'bfloat16' stores the weights narrow
    for decoding (``InteractiveModel.quantized``); None keeps them as the checkpoint stores them
    (float32 from training; narrow where a quantized model was saved, which no other width can
    be made from). ``cache_dtype``: 'float32', 'bfloat16' or
    'int8' stores the attention caches a decode step reads that way (the binding
    ``TransformerConfig.cache_dtype``, after ``bindings``; None keeps the run's)."""
    if weights_dtype is not None:
        check_weights_dtype(weights_dtype)
    step = _step_number(step)
    if not isinstance(model_dir, (str, os.PathLike)):
        raise ConfigError(
            f"model_dir must be a run's folder (a path string), not {type(model_dir).__name__} {model_dir!r}."
        )
    model_dir = os.fspath(model_dir)
    bindings = _bindings(bindings) + _cache_dtype_bindings(cache_dtype)
    config = run_directory.read_config(model_dir)  # checked as data before gin sees it
    opening = [*run_directory.load_bindings(model_dir, config, bindings), *bindings]
    # A summarization run's texts need only its SentencePiece model: it opens without the data
    # layer (seqio and TensorFlow), and its task is built from its own config when first asked for.
    text_vocabulary = _text_vocabulary([*config.statements, *_binding_statements(opening)])

    def build_task():
        with _CONFIG_LOCK:
            parsing.parse_gin([config], opening, finalize=False)
            return _tasks().resolve(parsing.bound_value("%TASK"))

    def params_from(model):
        params, restored_step = checkpointing.load_params(model, model_dir, step)
        return params, restored_step, weights_dtype_of(params)

    with _CONFIG_LOCK:
        parsing.parse_gin([config], opening, finalize=False, data_layer=None if text_vocabulary is None else False)
        run = _from_parsed_config(
            params_from,
            model_dir,
            require_summarization,
            text_vocabulary=text_vocabulary,
            build_task=build_task,
            # what save() writes: the run's config and the user's bindings (its place is bound on load)
            config_text="\n".join([config.text.rstrip("\n"), *bindings]) + "\n",
        )
    if weights_dtype is not None and run.weights_dtype not in ("float32", weights_dtype):
        raise ConfigError(
            f"{model_dir} stores {run.weights_dtype} weights (a quantized model saved from Python), which no other "
            f"width can be made from: open it with weights_dtype={run.weights_dtype!r} (or leave weights_dtype out)."
        )
    return run if weights_dtype is None else run.quantized(weights_dtype)


def build(
    gin_files: Union[str, Sequence[str]],
    bindings: Union[str, Sequence[str]] = (),
    seed: int = 0,
    *,
    weights_dtype: str = "float32",
    cache_dtype: Optional[str] = None,
    random_weights: bool = False,
    require_summarization: bool = False,
    search_paths: Sequence[str] = (),
) -> InteractiveModel:
    """A freshly initialised model from gin files (one file or a list: a model config, optionally
    a task config for the vocabulary and lengths; names as ``--gin_file`` takes them, also looked
    up under ``search_paths``) and ``bindings``; parameters drawn from ``seed`` (and stored as
    ``weights_dtype``; ``cache_dtype`` as in :func:`load`).

    ``random_weights``: instead of the model's initialisers (one jitted program, slow to compile
    at the 800M widths), draw each weight from numpy, uniform with the variance of N(0, 1/fan_in),
    and store it as ``weights_dtype`` as soon as it is drawn (the decode benchmark's
    ``terra.benchmarks.decode_speed.random_params``): for timing a paper-size model without a
    checkpoint; its outputs are noise. ``require_summarization`` as in :func:`load`."""
    check_weights_dtype(weights_dtype)
    gin_files = _strings(gin_files, "gin_files", '["models/tiny.gin", "tasks/synthetic_copy.gin"]')
    bindings = _bindings(bindings) + _cache_dtype_bindings(cache_dtype)
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise ConfigError(f"seed must be a whole number, e.g. 0, not {type(seed).__name__} {seed!r}.")
    seed = int(seed)

    def params_from(model):
        if random_weights:
            from terra.benchmarks.decode_speed import random_params

            return random_params(model, seed, weights_dtype), None, weights_dtype
        return model.init_params(jax.random.key(seed)), None, "float32"

    with _CONFIG_LOCK:
        parsing.parse_gin(gin_files, bindings, finalize=False, search_paths=search_paths)
        config_text = gin.config_str()  # what save() writes
        run = _from_parsed_config(params_from, require_summarization=require_summarization, config_text=config_text)
    return run.quantized(weights_dtype)
