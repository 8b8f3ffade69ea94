"""Every shipped gin file instantiates; bad bindings and configs fail with a clear message."""

import glob
import os
import subprocess
import sys

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.gin_config import parsing
from terra.models import ConfigError, TransformerConfig

from cheap_init_prng import init_key
from helpers import REPO_ROOT

# Instantiating every config compiles each model's loss: XLA's optimisations only cost time here.
pytestmark = pytest.mark.usefixtures("fast_compile")

GIN_FILES = sorted(
    os.path.relpath(p, parsing.CONFIGS_DIR)
    for p in glob.glob(os.path.join(parsing.CONFIGS_DIR, "**", "*.gin"), recursive=True)
)
MODEL_FILES = [f for f in GIN_FILES if f.startswith("models/")]
# Smaller than sizes/tiny.gin, so that instantiating every config stays fast; the sparsity
# knobs keep the 800M configs' values where they divide these sizes.
TEST_SIZES = [
    "TransformerConfig.vocab_size = 64",
    "TransformerConfig.d_model = 32",
    "TransformerConfig.d_ff = 128",
    "TransformerConfig.n_heads = 4",
    "TransformerConfig.n_encoder_layers = 1",
    "TransformerConfig.n_decoder_layers = 1",
    "TransformerConfig.max_len = 32",
]


def test_the_shipped_configs_include_the_paper_baseline_and_tiny():
    assert {"models/dense_800m.gin", "models/tiny.gin"} <= set(GIN_FILES)


def test_the_shipped_configs_are_the_package_terra_configs_from_the_top_level_configs_folder():
    import terra.configs

    top = os.path.join(REPO_ROOT, "configs")
    assert parsing.CONFIGS_DIR == top == os.path.dirname(os.path.abspath(terra.configs.__file__))
    assert not os.path.exists(os.path.join(REPO_ROOT, "terra", "configs"))
    # gin finds an include's package path (terra/configs/models/tiny.gin) as a package resource.
    assert all(os.path.isfile(os.path.join(top, folder, "__init__.py")) for folder in parsing.CONFIG_FOLDERS)
    assert parsing.resolve_gin_file("terra/configs/models/tiny.gin") == os.path.join(top, "models", "tiny.gin")
    assert parsing.shown_name(os.path.join(top, "models", "tiny.gin")) == "terra/configs/models/tiny.gin"


@pytest.mark.slow
def test_a_shipped_configs_package_path_resolves_in_a_checkout_on_sys_path_without_an_install(tmp_path):
    # python -S: no site hooks, so no editable finder maps terra.configs to configs/.
    import site

    code = (
        "import sys; sys.path[:0] = sys.argv[1:]\n"
        "import importlib.util, gin\n"
        "from terra.gin_config import parsing\n"
        "assert importlib.util.find_spec('terra.configs') is None\n"
        # Under test is where the includes resolve, not what they import: their imports
        # (terra.data.tasks, terra.training) are refused, skip_unknown passes over an import that
        # fails, and the process costs no TensorFlow or JAX (8 of its 9 CPU-s).
        "sys.modules.update(tensorflow=None, jax=None)\n"
        "gin.parse_config_file('terra/configs/experiments/quickstart.gin', skip_unknown=True)\n"
        "print(parsing.CONFIGS_DIR, gin.query_parameter('%TASK'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code, REPO_ROOT, *site.getsitepackages()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [os.path.join(REPO_ROOT, "configs"), "embedded_span_corruption"]


def test_every_gin_file_belongs_to_a_family_whose_files_are_all_instantiated():
    # models/ and sizes/ are instantiated here, tasks/ in test_data_pipeline.py, experiments/
    # (which include runs/) in test_trainer.py.
    assert all(f.startswith(("models/", "sizes/", "tasks/", "runs/", "experiments/")) for f in GIN_FILES), GIN_FILES


def _is_size_overlay(gin_file: str) -> bool:
    """``models/tiny_X.gin`` is ``models/X_800m.gin`` plus ``sizes/tiny.gin`` (or ``tiny.gin``, the
    dense one): the same layers with other widths and sparsity knobs."""
    return os.path.basename(gin_file).startswith("tiny")


@pytest.mark.parametrize("gin_file", MODEL_FILES)
@pytest.mark.slow
def test_every_model_gin_file_instantiates_at_tiny_size(gin_file):
    parsing.parse_gin([gin_file], TEST_SIZES)
    model = parsing.build_model()
    assert model.config.d_model == 32
    batch = {
        "encoder_input_tokens": jnp.ones((2, 5), jnp.int32),
        "decoder_target_tokens": jnp.ones((2, 4), jnp.int32),
    }
    if _is_size_overlay(gin_file):
        # Its 800M file runs below with the same layers; tracing checks this file's knobs fit
        # together (every shape and divisibility check) without compiling the model again. The
        # build traced the initializer with one layer per stack and copied that layer's subtree
        # to the others: the whole initializer's trace (every layer) gives the same tree, boxes
        # and logical axes included.
        assert jax.eval_shape(model.init_variables, jax.random.key(0)) == model.abstract_variables()
        loss, _ = jax.eval_shape(model.loss_fn, model.abstract_params(), batch)
        assert loss.shape == () and loss.dtype == jnp.float32
        return
    # The initialiser runs op by op: its operations (random draws of these few shapes) compile
    # once for all the model files, where jitted each file's initialiser compiles as a program of
    # its own (2-5 CPU-s each at this size, the loss's a fraction of that). The same function
    # init_params jits, so every layer's initialiser still runs and feeds the loss. A finite
    # loss holds for any draws of those initialisers: init_key's draws compile in less time.
    variables = model.init_variables(init_key(0))
    assert jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), variables) == model.abstract_variables()
    params = nn.unbox(variables)["params"]
    loss, _ = jax.jit(model.loss_fn)(params, batch)
    assert np.isfinite(float(loss))


@pytest.fixture(scope="module")
def built_models():
    """``build()``: the model of the parsed config, built once per config (gin's config_str,
    every binding) for the module's tests that parse the same one."""
    built = {}

    def build():
        config = gin.config_str()
        if config not in built:
            built[config] = parsing.build_model()  # validates every layer abstractly
        return built[config]

    return build


@pytest.mark.parametrize("size_file", [f for f in GIN_FILES if f.startswith("sizes/")])
@pytest.mark.slow
def test_size_overlays_apply_to_every_model_config(size_file, built_models):
    # models/tiny_X.gin is models/X_800m.gin plus sizes/tiny.gin: with the overlay on top, the two
    # parse to the same config, which is built once.
    for model_file in MODEL_FILES:
        parsing.parse_gin([model_file, size_file])
        assert built_models().config.d_model < 1024, model_file


def test_a_tiny_terraformer_initialises_the_tiny_lsh_terraformer_as_journey_2_does(built_models):
    """The README's fine-tuning journey shrunk with sizes/tiny.gin: the LSH model's parameters
    (after the fine-tuning experiment's param_map) have the shapes of the pretrained model's."""
    from terra.models import shared_qk_from_dense_attention

    def shapes(files):
        parsing.parse_gin([*files, "sizes/tiny.gin"], finalize=False)
        return built_models().abstract_params()

    pretrained = shapes(["models/terraformer_800m.gin"])
    lsh = shapes(["models/terraformer_lsh_800m.gin"])
    mapped = jax.eval_shape(shared_qk_from_dense_attention, pretrained)
    assert jax.tree.map(lambda x: x.shape, mapped) == jax.tree.map(lambda x: x.shape, lsh)


def test_files_parse_in_order_and_later_bindings_win():
    parsing.parse_gin(["models/dense_800m.gin", "models/tiny.gin"], ["TransformerConfig.d_model = 128"])
    model = parsing.build_model()
    assert model.config.d_model == 128 and model.config.n_encoder_layers == 2


def test_gin_flags_are_rewritten_into_bindings():
    from terra.cli import app
    from terra.errors import UsageError

    rewritten = app.rewrite_gin_args(["--gin.TransformerConfig.d_ff=96", "--seed", "3"])
    assert rewritten == ["--gin_bindings=TransformerConfig.d_ff = 96", "--seed", "3"]
    with pytest.raises(UsageError, match="--gin.NAME=VALUE"):
        app.rewrite_gin_args(["--gin.TransformerConfig.d_ff"])


def test_a_misspelled_binding_names_the_closest_parameter():
    with pytest.raises(parsing.GinConfigError) as info:
        parsing.parse_gin(["models/tiny.gin"], ["TransformerConfig.d_modle = 64"])
    assert "d_modle" in str(info.value) and "Did you mean 'd_model'" in str(info.value)


def test_gin_files_that_include_each_other_are_one_error_naming_both(tmp_path):
    a, b = tmp_path / "a.gin", tmp_path / "b.gin"
    a.write_text(f"include '{b}'\n")
    b.write_text(f"include '{a}'\n")
    with pytest.raises(parsing.GinConfigError, match="includes form a loop") as info:
        parsing.parse_gin([str(a)])
    assert str(a) in str(info.value) and str(b) in str(info.value) and "\n" not in str(info.value)


def test_a_misspelled_layer_reference_names_the_closest_configurable():
    with pytest.raises(parsing.GinConfigError, match="Did you mean 'FeedForward'"):
        parsing.parse_gin(["models/tiny.gin"], ["EncoderDecoderTransformer.feed_forward = @FeedForwrd"])


@pytest.mark.parametrize(
    "binding, message",
    [
        (
            "TransformerConfig.d_model = '64'",
            "'64' is a str, but it is bound to TransformerConfig.d_model, which takes an int",
        ),
        (
            "TransformerConfig.dropout = 'none'",
            "'none' is a str, but it is bound to TransformerConfig.dropout, which takes a float",
        ),
        (
            "terra.training.CheckpointSettings.every = 1.5",
            "1.5 is a float, but it is bound to CheckpointSettings.every",
        ),
        ("MODEL_DIR = 5", "5 is an int, but MODEL_DIR is passed to Trainer.model_dir, which takes a str"),
        (
            "SparseFeedForward.ff_sparsity = '16'",
            "'16' is a str, but it is bound to SparseFeedForward.ff_sparsity, which takes an int",
        ),
    ],
    ids=[
        "str for int",
        "str for float",
        "float for int",
        "a macro, through the parameter it is bound to",
        "a registered layer's parameter",
    ],
)
def test_a_wrong_typed_binding_names_the_parameter_and_its_type_before_the_library_runs(binding, message):
    with pytest.raises(parsing.GinConfigError) as info:
        parsing.parse_gin(["experiments/quickstart.gin"], [binding], finalize=False)
    assert message in str(info.value) and binding in str(info.value)


def test_bindings_of_a_compatible_type_pass_the_type_check():
    parsing.parse_gin(
        ["experiments/quickstart.gin"],
        [
            "TransformerConfig.dropout = 0",  # an int is a float
            "terra.training.ParallelSettings.num_devices = None",  # Optional[int]
            "terra.training.ParallelSettings.mesh_shape = {'data': 1}",  # a Mapping: not checked
            "MODEL_DIR = 'runs/x'",
            "TRAIN_STEPS = 10",
        ],
    )


def test_the_cli_reports_a_wrong_typed_parameter_with_exit_status_2(capsys):
    from terra.cli import params

    assert params.main(["--gin_file=models/tiny.gin", "--gin.TransformerConfig.n_heads='4'"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Invalid gin configuration") and "which takes an int" in err and "Traceback" not in err


def test_a_missing_gin_file_lists_the_available_configs():
    with pytest.raises(parsing.GinConfigError, match="tiny.gin"):
        parsing.parse_gin(["models/no_such_model.gin"])


def test_d_model_not_divisible_by_heads_is_a_config_error_with_the_fix():
    with pytest.raises(ConfigError, match="d_model=100 is not divisible by n_heads=16"):
        TransformerConfig(d_model=100, n_heads=16)
    parsing.parse_gin(["models/tiny.gin"], ["TransformerConfig.n_heads = 5"])
    with pytest.raises(parsing.GinConfigError, match="choose n_heads from"):
        parsing.build_model()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dropout": 1.5}, "dropout"),
        ({"n_decoder_layers": 0}, "at least one decoder layer"),
        ({"dtype": "float16"}, "bfloat16"),
        ({"vocab_size": 0}, "positive integer"),
    ],
)
def test_invalid_sizes_are_rejected_on_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TransformerConfig(**kwargs)


@pytest.mark.slow
def test_the_cli_reports_a_bad_config_in_one_line_without_a_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "terra.cli.params", "--gin_file=models/tiny.gin", "--gin.TransformerConfig.n_heads=5"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: Invalid gin configuration") and "n_heads=5" in result.stderr


def test_a_runs_directory_in_the_working_directory_does_not_break_includes(tmp_path, monkeypatch):
    # Users keep MODEL_DIRs under ./runs; gin must still find terra/configs/runs/train.gin.
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    parsing.parse_gin(["experiments/quickstart.gin"], ["MODEL_DIR = 'runs/q'"])
    assert gin.query_parameter("%TASK") == "embedded_span_corruption"


# --- every experiment fits its task --------------------------------------------------------------

EXPERIMENT_FILES = [f for f in GIN_FILES if f.startswith("experiments/")]


@pytest.fixture(scope="module")
def paper_vocabulary(tmp_path_factory):
    """A SentencePiece model of the paper's size (T5's cc_all.32000: 32,000 pieces), which the
    C4 and arXiv experiments are meant to be run with (``--vocabulary``)."""
    from terra.data import fixtures

    return fixtures.write_sentencepiece_model(str(tmp_path_factory.mktemp("vocab") / "c4-32k.model"), 32000)


def _uses_the_paper_vocabulary(gin_file: str) -> bool:
    """Whether an experiment's own command line (its header comment) passes ``--vocabulary``."""
    with open(os.path.join(parsing.CONFIGS_DIR, gin_file), encoding="utf-8") as f:
        return "--vocabulary=" in f.read()


def _mismatches(gin_files, bindings) -> list:
    """What keeps the experiment's model from training on its task, with the task's own
    vocabulary: a model that does not build (e.g. a vocabulary the loss sparsity does not divide),
    a vocabulary size other than the task's, or a training or evaluation length beyond max_len.
    The model is built abstractly (nothing is allocated), so the 800M configs cost no memory."""
    from terra.data import tasks

    parsing.parse_gin(gin_files, ["MODEL_DIR = '/unused'", "INIT_FROM = '/unused'", *bindings])
    try:
        model = parsing.build_model()
    except (ConfigError, parsing.GinConfigError) as error:
        return [f"the model does not build: {error}"]
    task = tasks.get_task(gin.query_parameter("%TASK"))
    converter = parsing.build_macro("FEATURE_CONVERTER", "building the feature converter")
    problems = []
    for lengths in (
        gin.query_parameter("%TASK_FEATURE_LENGTHS"),
        parsing.bound_value("%EVAL_FEATURE_LENGTHS"),
    ):
        try:
            if lengths:
                tasks.check_vocabulary_and_lengths(
                    task,
                    lengths,
                    vocab_size=model.config.vocab_size,
                    max_len=model.config.max_len,
                    feature_converter=converter,
                )
        except ConfigError as error:
            problems.append(str(error))
    task_vocab_size = task.output_features["targets"].vocabulary.vocab_size
    if model.config.vocab_size != task_vocab_size:
        problems.append(f"the model has {model.config.vocab_size} ids, the task's vocabulary {task_vocab_size}")
    return problems


@pytest.mark.parametrize("gin_file", EXPERIMENT_FILES)
@pytest.mark.slow
def test_every_experiment_binds_the_run_and_fits_the_vocabulary_and_lengths_of_its_task(gin_file, paper_vocabulary):
    bindings = []
    if _uses_the_paper_vocabulary(gin_file):
        bindings.append(f"terra.data.text_vocabulary.spm_path = {paper_vocabulary!r}")
    assert _mismatches([gin_file], bindings) == []  # the model builds (sizes checked abstractly) and fits the task
    # What the trainer is given: that model (the MODEL macro), a batch size and a number of steps.
    assert gin.query_parameter("terra.training.Trainer.model").scoped_selector == "MODEL/gin.macro"
    assert gin.query_parameter("%BATCH_SIZE") > 0 and gin.query_parameter("%TRAIN_STEPS") > 0


# What the pairings below get wrong (vocabulary sizes, the loss sparsity's divisor, max_len) is the
# same in every layer: one encoder and one decoder layer at the 800M widths show it, where the 800M
# configs' 24 + 24 layers cost seconds of tracing each. The experiments are built at full depth above.
ONE_LAYER_EACH = ["TransformerConfig.n_encoder_layers = 1", "TransformerConfig.n_decoder_layers = 1"]


@pytest.mark.slow
def test_the_c4_experiments_train_on_the_papers_32000_ids(paper_vocabulary):
    # The reference's layout (tasks/c4_span_corruption_paper.gin): sentinels at the top of the
    # 32,000 pieces, none added; every loss sparsity of the paper divides 32,000.
    from terra.data import tasks

    # At one layer each (ONE_LAYER_EACH): the loss sparsity's divisor, the vocabulary and
    # every width are the 800M files', and no check depends on the depth.
    bindings = [f"terra.data.text_vocabulary.spm_path = {paper_vocabulary!r}", *ONE_LAYER_EACH]
    for sparse_loss in ("models/sparse_loss2_800m.gin", "models/sparse_loss4_800m.gin", "models/sparse_loss8_800m.gin"):
        assert _mismatches(["experiments/pretrain_c4_dense_800m.gin", sparse_loss], bindings) == [], sparse_loss
    assert tasks.get_task("c4_span_corruption_paper").output_features["targets"].vocabulary.vocab_size == 32000


@pytest.mark.parametrize(
    "files, bindings, problem",
    [
        # T5's layout adds 100 sentinel ids: 32,100 is not divisible by loss sparsity 8.
        (
            ["experiments/pretrain_c4_dense_800m.gin", "models/sparse_loss8_800m.gin", "tasks/c4_span_corruption.gin"],
            ["TransformerConfig.vocab_size = 32100", *ONE_LAYER_EACH],
            "not divisible by loss_sparsity=8",
        ),
        # The task has more ids than the model.
        (
            ["experiments/pretrain_c4_dense_800m.gin", "tasks/c4_span_corruption.gin"],
            ONE_LAYER_EACH,
            "vocabulary has 32100 ids but the model's vocab_size is 32000",
        ),
        # The model has more ids than the task: trainable, but not the pairing an experiment means.
        (
            ["experiments/pretrain_c4_dense_800m.gin"],
            ["TransformerConfig.vocab_size = 32128", *ONE_LAYER_EACH],
            "model has 32128 ids",
        ),
        (
            ["experiments/pretrain_c4_dense_800m.gin"],
            ["TransformerConfig.max_len = 256", *ONE_LAYER_EACH],
            "model's max_len=256",
        ),
        # The language-model form's decoder holds inputs + targets (518 for addition's eval split).
        (
            ["experiments/synthetic_addition_digits_transformer.gin"],
            ["TransformerConfig.max_len = 512"],
            "LanguageModelFeatureConverter makes model sequences {'decoder_input_tokens': 518}",
        ),
    ],
    ids=["loss sparsity 8 on 32,100 ids", "task vocabulary larger", "model vocabulary larger", "max_len", "LM max_len"],
)
@pytest.mark.slow
def test_the_experiment_check_catches_an_incompatible_pairing(files, bindings, problem, paper_vocabulary):
    problems = _mismatches(files, [f"terra.data.text_vocabulary.spm_path = {paper_vocabulary!r}", *bindings])
    assert any(problem in p for p in problems), problems
