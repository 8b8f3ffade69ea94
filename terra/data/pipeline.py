"""Task -> batches: the input side of training and evaluation.

``seqio`` provider (task or mixture) → per-host shard (``seqio.ShardInfo(process_index,
process_count)``, so each host reads only its own files or examples) → preprocessors with a
fixed seed → feature converter (model features) → fixed-size batches of numpy arrays.

Resuming without replaying: :class:`BatchIterator` saves and restores the ``tf.data`` iterator
state itself (``tf.train.Checkpoint(iterator=...)``, as T5X's dataset checkpointing does), so a
job restarted at step k continues with batch k + 1 of the same stream in the time it takes to
load the state, however large k is.
"""

import os
from typing import Iterator, Mapping, Optional

import gin
import jax
import numpy as np
import seqio
import tensorflow as tf

from terra.data import feature_converters, graph_functions, json_lines, tasks
from terra.errors import ConfigError, InputError


def host_shard_info() -> seqio.ShardInfo:
    """This process's share of the data in a multi-host run (all of it on one host)."""
    return seqio.ShardInfo(index=jax.process_index(), num_shards=jax.process_count())


@gin.configurable(module="terra.data")
def get_dataset(
    task: tasks.Provider,
    *,
    feature_lengths: Mapping[str, int],
    batch_size: int,
    split: str = "train",
    feature_converter: Optional[seqio.FeatureConverter] = None,
    shuffle: bool = True,
    seed: Optional[int] = 0,
    shard_info: Optional[seqio.ShardInfo] = None,
    num_epochs: Optional[int] = None,
    drop_remainder: bool = True,
) -> tf.data.Dataset:
    """Batches of model features for ``task``, a seqio Task or Mixture (``tasks.get_task`` gives
    terra's by name; ``tasks.resolve`` takes either).

    Args:
      feature_lengths: task feature lengths, e.g. ``{"inputs": 512, "targets": 114}``; longer
        features are truncated (EOS kept by the tasks' ``append_eos_after_trim``).
      batch_size: examples per batch *on this host*.
      feature_converter: default :func:`feature_converters.encoder_decoder_converter`.
      seed: fixes shuffling and every random preprocessor: the same seed gives the same stream.
      shard_info: default :func:`host_shard_info`.
      num_epochs: ``None`` repeats forever (training); ``1`` for one pass (evaluation).
    """
    if batch_size <= 0:
        raise ConfigError(f"batch_size must be positive, got {batch_size}.")
    tasks.check_task_data(task, split)
    missing = [k for k in ("inputs", "targets") if k not in feature_lengths]
    if missing:
        raise ConfigError(
            f"feature_lengths {dict(feature_lengths)} lacks {missing}; give e.g. {{'inputs': 512, 'targets': 114}}."
        )
    converter = feature_converter or feature_converters.encoder_decoder_converter()
    ds = graph_functions.build(
        lambda: converter(
            task.get_dataset(
                sequence_length=dict(feature_lengths),
                split=split,
                shuffle=shuffle,
                seed=seed,
                shard_info=shard_info or host_shard_info(),
                num_epochs=num_epochs,
                try_in_mem_cache=False,
            ),
            dict(feature_lengths),
        )
    )
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    options = tf.data.Options()
    options.deterministic = True
    # The JSON sources parse lines in tf.py_function; it holds no state, so the iterator may be
    # checkpointed regardless.
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def batch_iterator(provider: tasks.Provider, split: str, **get_dataset_kwargs) -> "BatchIterator":
    """:class:`BatchIterator` over :func:`get_dataset`'s batches of a seqio Task or Mixture, its
    errors naming the task, the split and the task's files, its skip counts those of the task's
    readers."""
    ds = get_dataset(provider, split=split, **get_dataset_kwargs)
    return BatchIterator(
        ds, description=f"task '{provider.name}', split '{split}',", **tasks.read_checks(provider, split)
    )


def _shown(files, limit: int = 5) -> str:
    more = f" and {len(files) - limit} more" if len(files) > limit else ""
    return ", ".join(files[:limit]) + more


def count_tokens(batch: Mapping[str, np.ndarray]) -> int:
    """Non-padding tokens of a batch's inputs and targets (throughput accounting)."""
    keys = ("encoder_input_tokens", "decoder_target_tokens")
    return int(sum(np.count_nonzero(batch[k]) for k in keys if k in batch))


class BatchIterator:
    """Numpy batches from a ``tf.data`` dataset, with a checkpointable position.

    ``save(path)`` writes the iterator state (position, shuffle buffers, random-generator
    states) next to a model checkpoint; ``restore(path)`` on a freshly built identical
    dataset continues exactly where the saved one stopped.

    A read failure is one :class:`~terra.errors.InputError` naming the file and line
    (:mod:`terra.data.json_lines`), and a stream that ends before its first batch is an
    ``InputError`` saying so, with the records skipped on the way, never a bare
    ``StopIteration``. ``description`` names the stream in that message; ``files`` are the
    local files it reads, searched for the damaged one when TensorFlow does not name it.
    """

    def __init__(self, dataset: tf.data.Dataset, *, description: str = "the input pipeline", files=(), readers=None):
        self.dataset = dataset
        self.description = description
        self.files = list(files)
        self.readers = readers
        self.batches_read = 0
        self._iterator = iter(dataset)
        self._checkpoint = tf.train.Checkpoint(iterator=self._iterator)

    def __iter__(self) -> Iterator[Mapping[str, np.ndarray]]:
        return self

    def __next__(self) -> Mapping[str, np.ndarray]:
        try:
            batch = next(self._iterator)
        except tf.errors.OpError as e:
            raise json_lines.as_input_error(e, files=self.files, readers=self.readers) from None
        except StopIteration:
            if self.batches_read == 0:
                raise self._empty_stream_error() from None
            raise
        self.batches_read += 1
        return jax.tree.map(lambda t: t.numpy(), batch)

    def _empty_stream_error(self) -> InputError:
        shapes = [spec.shape for spec in jax.tree.leaves(self.dataset.element_spec)]
        batch = shapes[0][0] if shapes and shapes[0].rank else None
        skipped = json_lines.skip_report(self.readers)
        return InputError(
            f"{self.description} gave no {'batch' if batch is None else f'full batch of {batch} examples'}: "
            + (" ".join(skipped) if skipped else "its files hold no usable records (empty files?).")
            + (f" Files: {_shown(self.files)}." if self.files else "")
        )

    def save(self, path: str) -> str:
        """Write the position under the prefix ``path`` (its directory is created)."""
        tf.io.gfile.makedirs(os.path.dirname(path) or ".")
        return self._checkpoint.write(path)

    def restore(self, path: str) -> None:
        if not tf.io.gfile.exists(path + ".index"):
            raise FileNotFoundError(f"no saved input-pipeline state at {path} (expected {path}.index).")
        self._checkpoint.read(path).assert_consumed()
