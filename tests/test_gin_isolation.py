"""A built model keeps the gin configuration it was built with.

The injected layers (``EncoderDecoderTransformer.feed_forward = @SparseFeedForward``) are
constructed by Flax when the model is initialised, applied or traced, long after the model was
built; gin's configurable classes read their bindings at that moment. The model building
freezes them with the bindings of the config (and scope) the model was built under, so
parsing another config (``terra.build`` / ``terra.load`` of another model) changes nothing
in a model already built, and scoped bindings (``MODEL/SparseFeedForward.x``) reach the
layers when they are applied, not only when the model is checked at build time.
"""

import dataclasses
import pickle
from typing import Any, Optional

import gin
import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

import terra
from terra.gin_config import frozen, parsing
from terra.layers import SparseFeedForward

from helpers import TINY_COPY_MODEL

pytestmark = pytest.mark.usefixtures("fast_compile")

SPARSE_FF = ["models/tiny_sparse_ff.gin"]
# One encoder and one decoder layer of d_model 32, d_ff 64: ff_sparsity 8, 16 and 32 all divide d_ff.
TINY = TINY_COPY_MODEL + ["TransformerConfig.max_len = 16"]
BATCH = {
    "encoder_input_tokens": np.array([[5, 6, 7, 8, 9, 10, 1, 0], [11, 12, 13, 1, 0, 0, 0, 0]], np.int32),
    "decoder_target_tokens": np.array([[7, 8, 9, 10, 1, 0, 0, 0], [14, 15, 16, 17, 18, 1, 0, 0]], np.int32),
}


def ff_shapes(params) -> dict:
    """``{'wi': (blocks, N, d_model), ...}`` of the encoder's sparse feed-forward layer."""
    return {"/".join(k): np.shape(v) for k, v in flatten_dict(params["encoder_0"]["feed_forward"]).items()}


def outputs(run) -> dict:
    """What a model computes with its own parameters: teacher-forced logits, a training-mode
    loss (dropout and the sparse layers' noise on, from a fixed key), greedy tokens, and the
    shapes a fresh initialisation draws."""
    loss, _ = run.model.loss_fn(run.params, BATCH, jax.random.key(7))
    return {
        "logits": np.asarray(run.model.logits(run.params, BATCH)),
        "train_loss": float(loss),
        "generated": np.asarray(run.generate(BATCH["encoder_input_tokens"], max_new_tokens=4)),
        "init_ff_shapes": ff_shapes(jax.eval_shape(run.model.init_params, jax.random.key(0))),
    }


def assert_same_outputs(before: dict, after: dict) -> None:
    np.testing.assert_array_equal(after["logits"], before["logits"])
    assert after["train_loss"] == before["train_loss"]
    np.testing.assert_array_equal(after["generated"], before["generated"])
    assert after["init_ff_shapes"] == before["init_ff_shapes"]


def build(bindings, seed=0):
    """``terra.build`` of the tiny sparse model with ``bindings``, as a user calls it. Its weights are
    random (``random_weights``: drawn leaf by leaf from the built model's abstract tree, compiling
    nothing, where the model's own initialiser compiles for seconds): what these tests compare is
    what a built model computes with the parameters it holds, before and after another config is
    built, whatever their values; ``outputs`` still traces a fresh initialisation each time. (A test
    that compares the parameters with the build's abstract tree uses the model's own initialiser.)"""
    return terra.build(SPARSE_FF, TINY + bindings, seed=seed, random_weights=True)


def build_model(bindings):
    """Another model, as ``terra.build`` and ``terra.load`` make it before its parameters."""
    parsing.parse_gin(SPARSE_FF, TINY + bindings, finalize=False)
    return parsing.build_model()


@pytest.mark.slow
def test_a_model_keeps_its_layer_sizes_when_another_config_is_built():
    a = build(["SparseFeedForward.ff_sparsity = 8"], seed=1)
    before = outputs(a)
    assert before["init_ff_shapes"] == ff_shapes(a.params)
    b = build(["SparseFeedForward.ff_sparsity = 16"], seed=1)
    assert ff_shapes(b.params) != ff_shapes(a.params)  # the two configs do build different layers
    assert_same_outputs(before, outputs(a))  # not a shape error: a's layers keep ff_sparsity 8


@pytest.mark.slow
def test_a_model_keeps_its_behaviour_settings_when_another_config_is_built():
    # temperature and quant_prob change no shape, only what a training step computes: the
    # other model's settings would be used silently.
    a = build(["SparseFeedForward.temperature = 0.0", "SparseFeedForward.quant_prob = 1.0"])
    before = outputs(a)
    b = build_model(["SparseFeedForward.temperature = 5.0", "SparseFeedForward.quant_prob = 0.0"])
    b_loss, _ = b.loss_fn(a.params, BATCH, jax.random.key(7))
    assert float(b_loss) != before["train_loss"]  # the settings do matter for these parameters
    assert_same_outputs(before, outputs(a))


@pytest.mark.slow
def test_scoped_model_bindings_reach_the_layers_when_they_are_applied():
    # The model is built in gin's scope MODEL; a binding scoped to it overrides the unscoped
    # one for the model's checks and for its layers alike, whatever is parsed later.
    # The model's own initialiser (not random weights): its parameters are the layers applied
    # outside the scope the model was built in, compared with the build's own check.
    a = terra.build(SPARSE_FF, TINY + ["SparseFeedForward.ff_sparsity = 16", "MODEL/SparseFeedForward.ff_sparsity = 8"])
    by_scope = ff_shapes(a.params)
    assert by_scope == ff_shapes(a.model.abstract_params())
    assert by_scope["controller_up"] == (8, 8, 8)  # d_ff / N blocks of N units: N = 8, not 16
    before = outputs(a)
    build_model(["MODEL/SparseFeedForward.ff_sparsity = 32"])
    assert_same_outputs(before, outputs(a))


@pytest.mark.slow
def test_a_scoped_reference_keeps_its_scope_and_bindings():
    # ``@ff/SparseFeedForward`` constructs the layer in scope ``ff`` (gin's scoped reference):
    # its ``ff/`` bindings apply, then the unscoped ones, whatever is parsed later.
    scoped = ["EncoderDecoderTransformer.feed_forward = @ff/SparseFeedForward", "ff/SparseFeedForward.quant_prob = 1.0"]
    a = terra.build(  # the model's own initialiser, as in the test above
        SPARSE_FF, TINY + scoped + ["ff/SparseFeedForward.ff_sparsity = 8", "SparseFeedForward.temperature = 0.0"]
    )
    assert ff_shapes(a.params)["controller_up"] == (8, 8, 8)
    assert ff_shapes(a.params) == ff_shapes(a.model.abstract_params())
    before = outputs(a)
    build_model(scoped + ["ff/SparseFeedForward.ff_sparsity = 16", "SparseFeedForward.temperature = 5.0"])
    assert_same_outputs(before, outputs(a))


def test_frozen_layers_stand_where_the_gin_classes_stood():
    a = build(["SparseFeedForward.ff_sparsity = 8"])
    factory = a.model.module.feed_forward
    assert factory.__name__ == "SparseFeedForward" and "ff_sparsity=8" in repr(factory)
    assert factory.params_read_per_token is SparseFeedForward.params_read_per_token
    assert isinstance(factory(d_model=32, d_ff=64, name="ff"), SparseFeedForward)
    assert factory(d_model=32, d_ff=64, ff_sparsity=32).ff_sparsity == 32  # the caller still has the last word
    # The same config gives equal networks (jit caches and hashing see one model), and a
    # network pickles with its frozen layers.
    again = build_model(["SparseFeedForward.ff_sparsity = 8"])
    assert a.model.module == again.module and hash(a.model.module) == hash(again.module)
    assert pickle.loads(pickle.dumps(a.model.module)) == a.model.module
    assert a.model.module != build_model(["SparseFeedForward.ff_sparsity = 16"]).module


# ---- the mechanism on configurables of its own: references inside references, macros --------


@dataclasses.dataclass(frozen=True)
class Leaf:
    size: int = 1
    label: str = "default"


@dataclasses.dataclass(frozen=True)
class Branch:
    leaf_factory: Any = None
    leaf: Optional[Leaf] = None
    width: int = 0


@dataclasses.dataclass(frozen=True)
class Tree:
    branch_factory: Any = None
    more: tuple = ()


gin.register(Leaf, module="tests.gin_isolation")
gin.register(Branch, module="tests.gin_isolation")
gin.register(Tree, module="tests.gin_isolation")


@gin.configurable(module="tests.gin_isolation")
@dataclasses.dataclass(frozen=True)
class DecoratedInPlace:
    size: int = 1


def test_a_class_decorated_in_place_is_refused_with_the_fix():
    # Calling such a class reads gin whatever is passed to it: nothing could stand for it.
    gin.parse_config("tests.gin_isolation.Tree.branch_factory = @tests.gin_isolation.DecoratedInPlace")
    with pytest.raises(TypeError, match="DecoratedInPlace is decorated with @gin.configurable.*gin.register"):
        frozen.freeze_configurables(gin.get_configurable(Tree)())
    with pytest.raises(TypeError, match="register it with gin.register"):
        frozen.freeze_configurables(Tree(branch_factory=DecoratedInPlace))


def test_references_inside_the_bindings_are_frozen_too():
    gin.parse_config(
        """
        WIDTH = 3
        tests.gin_isolation.Tree.branch_factory = @tests.gin_isolation.Branch
        tests.gin_isolation.Tree.more = [@outer/tests.gin_isolation.Leaf, @tests.gin_isolation.Leaf()]
        tests.gin_isolation.Branch.leaf_factory = @tests.gin_isolation.Leaf
        tests.gin_isolation.Branch.leaf = @tests.gin_isolation.Leaf()
        tests.gin_isolation.Branch.width = %WIDTH
        tests.gin_isolation.Leaf.size = 2
        MODEL/tests.gin_isolation.Leaf.label = 'model'
        outer/tests.gin_isolation.Leaf.label = 'outer'
        """
    )
    with gin.config_scope("MODEL"):
        tree = frozen.freeze_configurables(gin.get_configurable(Tree)())

    gin.clear_config()
    gin.parse_config("tests.gin_isolation.Leaf.size = 99\ntests.gin_isolation.Branch.width = 99")
    branch = tree.branch_factory()
    assert isinstance(branch, Branch) and branch.width == 3
    assert branch.leaf == Leaf(2, "model")  # ``@Leaf()`` in a bound value: evaluated under the frozen config
    assert branch.leaf_factory() == Leaf(2, "model") and branch.leaf_factory(size=5) == Leaf(5, "model")
    assert tree.more[0]() == Leaf(2, "outer")  # a scoped reference keeps its own scope
    assert tree.more[1] == Leaf(2, "model")  # already a value
    assert frozen.freeze_configurables(tree) is tree  # nothing left to freeze
