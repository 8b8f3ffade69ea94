"""``tf.data`` functions traced as they are written, without AutoGraph.

Each ``Dataset.map`` and ``filter`` traces its Python function into a graph when the pipeline is
built. By default TensorFlow first rewrites the function's source with AutoGraph (Python control
flow on tensors becomes graph control flow). That rewrite is most of a pipeline's build time
(docs/data.md, "Building a pipeline"), and no function terra or seqio maps needs it: their
data-dependent choices are graph ops already (``tf.where``, ``tf.cond``, ``tf.while_loop``). A
function that did need it fails when the pipeline is built (a tensor used as a Python bool), so
turning AutoGraph off can stop a build but never change a batch.
"""

import contextlib


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
