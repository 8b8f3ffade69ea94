"""``tf.data`` functions traced as they are written, without AutoGraph.

Each ``Dataset.map`` and ``filter`` traces its Python function into a graph when the pipeline is
built. By default TensorFlow first rewrites the function's source with AutoGraph (Python control
flow on tensors becomes graph control flow). That rewrite is most of a pipeline's build time
(docs/data.md, "Building a pipeline"), and no function terra or seqio maps needs it: their
data-dependent choices are graph ops already (``tf.where``, ``tf.cond``, ``tf.while_loop``). A
function that does need it (a user's preprocessor branching on a tensor with ``if``) fails when
it is traced, with a ``TypeError``; :func:`build` then builds the pipeline again with AutoGraph.
Either way the batches are the same.
"""

import contextlib
from typing import Callable, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def without_autograph():
    """Datasets built inside the block trace their map and filter functions without AutoGraph."""
    try:
        # TensorFlow's own switch for "convert or not" (what ``tf.autograph.experimental.
        # do_not_convert`` sets for one function), set here for every function in the block.
        from tensorflow.python.autograph.core import ag_ctx
    except ImportError:  # a TensorFlow that moved it: convert, as TensorFlow does by default
        yield
        return
    with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.DISABLED):
        yield


def build(build_pipeline: Callable[[], T]) -> T:
    """``build_pipeline()`` without AutoGraph, or with it where a function needs it (a tensor
    used as a Python bool raises ``TypeError``, ``OperatorNotAllowedInGraphError`` among them)."""
    try:
        with without_autograph():
            return build_pipeline()
    except TypeError:
        pass  # built again below, outside this handler: an error of its own is reported alone
    return build_pipeline()
