"""Converting the paper's own (Trax) checkpoints: the fixtures in tests/fixtures/trax were made
by running Trax (see their README); a converted run must give Trax's logits."""

import functools
import gzip
import io
import json
import os
import pickle
import shutil
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

import terra
from terra.cli import convert as convert_cli
from terra.convert import convert_trax_checkpoint
from terra.convert.trax_arguments import trax_gin
from terra.convert.trax_file import read_trax_weights
from terra.convert.trax_layout import to_terra_params, trax_leaves
from terra.errors import CheckpointError, ConfigError
from terra.gin_config import parsing
from terra.layers.lsh_attention import LSHSelfAttention
from terra.training import checkpointing

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "trax")
MODELS = ("dense", "scaling_transformer", "terraformer")
LSH = "terraformer_lsh"  # its logits depend on Trax's hash rotations: checked with them replayed


def fixture(model: str, name: str) -> str:
    return os.path.join(FIXTURES, model, name)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each fixture converted once through the command line: ``{model: run directory}``."""
    root = tmp_path_factory.mktemp("converted")
    runs = {}
    for model in (*MODELS, LSH):
        out = str(root / model)
        status = convert_cli.call(
            [
                "trax",
                f"--checkpoint={fixture(model, 'model.pkl.gz')}",
                f"--trax_config={fixture(model, 'config.json')}",
                f"--out={out}",
            ]
        )
        assert status == 0
        runs[model] = out
    return runs


@pytest.fixture(scope="module")
def loaded(converted):
    """``loaded(model)``: the converted run opened with ``terra.load``, once per module (each open
    builds and checks the model and restores its parameters); the tests only read it."""
    runs = {}

    def load(model):
        if model not in runs:
            runs[model] = terra.load(converted[model])
        return runs[model]

    return load


def _inputs(model):
    inputs = np.load(fixture(model, "inputs.npz"))
    return inputs["encoder_tokens"], inputs["decoder_tokens"], inputs["decoder_tokens_shifted"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.slow
def test_converted_checkpoint_gives_trax_eval_logits(loaded, model):
    run = loaded(model)
    encoder_tokens, _, shifted = _inputs(model)
    # Jitted: one program, where op by op each of the model's operations compiles on its own.
    logits = jax.jit(run.model.module.apply)({"params": run.params}, jnp.asarray(encoder_tokens), jnp.asarray(shifted))
    expected = np.load(fixture(model, "eval_logits.npz"))["logits"]
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.slow
def test_converted_checkpoint_gives_trax_decode_logits_token_by_token(loaded, model):
    run = loaded(model)
    encoder_tokens, _, shifted = _inputs(model)
    expected = np.load(fixture(model, "decode_logits.npz"))
    np.testing.assert_array_equal(expected["decoder_tokens_fed"], shifted)
    decoder = run.model.decoder(shifted.shape[1])
    cache = decoder.prefill(run.params, jnp.asarray(encoder_tokens))  # row 1 has encoder padding
    steps = []
    for t in range(shifted.shape[1]):
        logits, cache = decoder.step(run.params, cache, jnp.asarray(shifted[:, t]))
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.stack(steps, axis=1), expected["logits"], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_converted_run_is_a_fine_tuning_starting_point(converted, loaded):
    """INIT_FROM reads the parameters with restore_params onto the configured model's tree."""
    run = loaded("scaling_transformer")
    params = checkpointing.restore_params(converted["scaling_transformer"], run.model.abstract_params())
    np.testing.assert_array_equal(
        np.asarray(params["decoder_0"]["feed_forward"]["wo"]), np.asarray(run.params["decoder_0"]["feed_forward"]["wo"])
    )
    with open(os.path.join(converted["scaling_transformer"], "config.gin")) as f:
        config = f.read()
    assert "SparseLossLogits.loss_sparsity = 4" in config and "Converted by terra.convert" in config


def test_sparse_ff_units_are_columns_of_w1_but_rows_of_w2_in_trax_order():
    """Unit (block b, element j) is w1[:, b, j] and w2[j, b, :] in Trax; terra's [d_ff/N, N, d]."""
    files, bindings = trax_gin(*_arguments("scaling_transformer"))
    parsing.parse_gin(files, bindings, finalize=False)
    abstract = parsing.build_model().abstract_params()
    leaves = trax_leaves(abstract)
    flat = [np.zeros(leaf.shape, np.float32) for leaf in leaves]
    w1_at = next(i for i, leaf in enumerate(leaves) if "w1" in leaf.describe)
    w2_at = next(i for i, leaf in enumerate(leaves) if "w2" in leaf.describe)
    d_model, blocks, n = leaves[w1_at].shape
    flat[w1_at] = np.arange(d_model * blocks * n, dtype=np.float32).reshape(d_model, blocks, n)
    flat[w2_at] = np.arange(n * blocks * d_model, dtype=np.float32).reshape(n, blocks, d_model)
    params = to_terra_params(flat, abstract)
    wi, wo = params["encoder_0"]["feed_forward"]["wi"], params["encoder_0"]["feed_forward"]["wo"]
    for b, j in [(0, 1), (3, 5), (blocks - 1, n - 1)]:
        np.testing.assert_array_equal(wi[b, j], flat[w1_at][:, b, j])
        np.testing.assert_array_equal(wo[b, j], flat[w2_at][j, b, :])


def test_a_terra_gin_config_of_the_same_architecture_converts_alike(loaded, tmp_path):
    files, bindings = trax_gin(*_arguments("terraformer"))
    out = convert_trax_checkpoint(
        fixture("terraformer", "model.pkl.gz"), str(tmp_path / "from_gin"), gin_files=files, gin_bindings=bindings
    )
    a, b = terra.load(out).params, loaded("terraformer").params
    np.testing.assert_array_equal(a["logits"]["multiplicative"]["gate"], b["logits"]["multiplicative"]["gate"])


def _arguments(model):
    with open(fixture(model, "config.json")) as f:
        content = json.load(f)
    return content["trax_constructor"].rsplit(".", 1)[-1], content["constructor_kwargs"]


def _write_weights(path, flat):
    with gzip.open(path, "wb") as f:
        pickle.dump({"flat_weights": flat, "flat_state": []}, f)


def _convert_with(tmp_path, flat, model="dense", **kwargs):
    checkpoint = str(tmp_path / "model.pkl.gz")
    _write_weights(checkpoint, flat)
    out = tmp_path / "run"
    with pytest.raises((CheckpointError, ConfigError)) as error:
        convert_trax_checkpoint(checkpoint, str(out), trax_config=fixture(model, "config.json"), **kwargs)
    assert not out.exists(), "nothing may be written on error"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pkl.gz"], "no staging directory may remain"
    return str(error.value)


def test_a_missing_array_is_named_and_nothing_is_written(tmp_path):
    flat = read_trax_weights(fixture("dense", "model.pkl.gz"))
    message = _convert_with(tmp_path, flat[:-1])
    assert "holds 92 arrays, the model expects 93" in message
    assert "[92] output layer Dense b [d_out] (64,) -> logits/dense/bias" in message


def test_an_extra_array_is_named_and_nothing_is_written(tmp_path):
    flat = read_trax_weights(fixture("dense", "model.pkl.gz"))
    message = _convert_with(tmp_path, flat + [np.zeros((3, 5), np.float32)])
    assert "extra [93] shape (3, 5)" in message


def test_a_misshaped_array_is_named_and_nothing_is_written(tmp_path):
    flat = read_trax_weights(fixture("scaling_transformer", "model.pkl.gz"))
    flat[18] = flat[18].reshape(16, 8, 64)  # w2 saved in terra's layout instead of Trax's
    message = _convert_with(tmp_path, flat, model="scaling_transformer")
    assert "array [18] has shape (16, 8, 64)" in message
    assert "encoder layer 0 SparseFF w2 [N, d_ff/N, d_model] (8, 16, 64) -> encoder_0/feed_forward/wo" in message


def test_arguments_of_another_architecture_are_refused_by_shape(tmp_path):
    flat = read_trax_weights(fixture("dense", "model.pkl.gz"))
    message = _convert_with(tmp_path, flat, model="scaling_transformer")
    assert "do not describe the model that wrote the file" in message


def test_an_existing_run_directory_is_not_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        convert_trax_checkpoint(fixture("dense", "model.pkl.gz"), str(out), trax_config=fixture("dense", "config.json"))
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "change, named",
    [
        ({"pos_type": "fixed-base"}, "pos_type='fixed-base'"),
        ({"ff_activation": {"trax_layer": "Gelu", "partial_kwargs": {}}}, "ff_activation=Gelu"),
        ({"loss_sparsity_type": "lowrank"}, "loss_sparsity_type='lowrank'"),
        ({"n_hidden_layers": 3}, "no argument(s) ['n_hidden_layers']"),
        ({"output_vocab_size": 100}, "output_vocab_size=100"),
    ],
)
def test_trax_arguments_terra_does_not_implement_are_named(change, named):
    constructor, kwargs = _arguments("scaling_transformer")
    with pytest.raises(ConfigError) as error:
        trax_gin(constructor, {**kwargs, **change})
    assert named in str(error.value)


def test_omitted_arguments_take_traxs_defaults():
    files, bindings = trax_gin("ConfigurableTransformer", {"input_vocab_size": 100})
    assert files == ["models/dense_800m.gin"]
    assert "TransformerConfig.d_model = 512" in bindings and "TransformerConfig.dropout = 0.1" in bindings


def test_training_only_arguments_map_onto_terra_bindings():
    """ff_chunk_size and dropout mask sharing change training, not outputs: they carry over."""
    constructor, kwargs = _arguments("scaling_transformer")
    _, bindings = trax_gin(constructor, {**kwargs, "ff_chunk_size": 512, "dropout_shared_axes": [-2]})
    assert "SparseFeedForward.ff_chunk_size = 512" in bindings
    assert "TransformerConfig.share_dropout_over_length = True" in bindings
    _, bindings = trax_gin(constructor, kwargs)
    assert "TransformerConfig.share_dropout_over_length = False" in bindings
    _, bindings = trax_gin(*_arguments("terraformer"))
    assert "TransformerConfig.share_dropout_over_length = True" in bindings
    assert "Terraformer.attention_output_dropout = False" in bindings
    with pytest.raises(ConfigError, match="dropout_shared_axes"):
        trax_gin(constructor, {**kwargs, "dropout_shared_axes": [0]})


def test_weights_in_a_separate_npy_file_are_read_like_inline_ones(tmp_path):
    """The 2021+ training-checkpoint form: 'flat_weights' is the gzip level, the arrays are
    np.save records in <name>.weights.npy.gz, bfloat16 as uint16 bit patterns."""
    flat = read_trax_weights(fixture("dense", "model.pkl.gz"))
    checkpoint = tmp_path / "model.pkl.gz"
    with gzip.open(checkpoint, "wb") as f:
        pickle.dump({"flat_weights": 2, "flat_state": 2, "step": 100}, f)
    bf16_bits = (flat[0].view(np.uint32) >> 16).astype(np.uint16)  # truncated to bfloat16
    with gzip.open(tmp_path / "model.weights.npy.gz", "wb") as f:
        buffer = io.BytesIO()
        np.save(buffer, bf16_bits)
        for array in flat[1:]:
            np.save(buffer, array)
        f.write(buffer.getvalue())
    read = read_trax_weights(str(checkpoint))
    assert len(read) == len(flat)
    np.testing.assert_array_equal(read[0], (bf16_bits.astype(np.uint32) << 16).view(np.float32))
    assert np.abs(read[0] - flat[0]).max() <= np.abs(flat[0]).max() * 2**-7
    for got, want in zip(read[1:], flat[1:]):
        np.testing.assert_array_equal(got, want)


def test_a_checkpoint_without_its_weights_file_names_the_missing_file(tmp_path):
    checkpoint = tmp_path / "model.pkl.gz"
    with gzip.open(checkpoint, "wb") as f:
        pickle.dump({"flat_weights": 2}, f)
    with pytest.raises(CheckpointError, match=r"model\.weights\.npy\.gz does not exist"):
        read_trax_weights(str(checkpoint))


class _Exploit:
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent-terra-test",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    checkpoint = tmp_path / "model.pkl.gz"
    _write_weights(checkpoint, [_Exploit()])
    with pytest.raises(CheckpointError, match="asks to import shutil.rmtree"):
        read_trax_weights(str(checkpoint))


def test_a_file_that_is_not_a_trax_checkpoint_is_named(tmp_path):
    bad = tmp_path / "model.pkl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(CheckpointError, match="is not a Trax weight file"):
        read_trax_weights(str(bad))
    with pytest.raises(CheckpointError, match="does not exist"):
        read_trax_weights(str(tmp_path / "missing.pkl.gz"))


def test_the_command_line_reports_bad_input_with_exit_status_2(tmp_path, capsys):
    status = convert_cli.main(
        [
            "trax",
            f"--checkpoint={tmp_path / 'missing.pkl.gz'}",
            "--trax_config",
            fixture("dense", "config.json"),
            f"--out={tmp_path / 'run'}",
        ]
    )
    assert status == 2
    assert "missing.pkl.gz does not exist" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ----- files as Trax writes them under JAX ------------------------------------------------------


class _ShapeDtype:
    """Pickles as trax.shapes.ShapeDtype does (a __slots__ record of shape and dtype)."""

    __slots__ = ["shape", "dtype"]

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


_ShapeDtype.__module__, _ShapeDtype.__qualname__, _ShapeDtype.__name__ = "trax.shapes", "ShapeDtype", "ShapeDtype"


@pytest.fixture
def trax_shapes_module(monkeypatch):
    """A stand-in `trax.shapes` module so the test pickles name the class Trax's files name."""
    import types

    trax_module, shapes = types.ModuleType("trax"), types.ModuleType("trax.shapes")
    shapes.ShapeDtype = _ShapeDtype
    trax_module.shapes = shapes
    monkeypatch.setitem(sys.modules, "trax", trax_module)
    monkeypatch.setitem(sys.modules, "trax.shapes", shapes)


def _signature():
    return (_ShapeDtype((2, 12), np.dtype("int32")), _ShapeDtype((2, 8), np.int32))


def _jax_state():
    import jax

    return [jax.random.PRNGKey(0), jnp.zeros((), jnp.int32), jnp.ones((3,), jnp.float32)]


def _save_to_file(path, flat, dtype=jnp.float32):
    """``Layer.save_to_file`` under JAX: jax arrays, pickle.HIGHEST_PROTOCOL, gzip level 2."""
    content = {
        "flat_weights": [jnp.asarray(w, dtype) for w in flat],
        "flat_state": _jax_state(),
        "input_signature": _signature(),
    }
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=2) as f:
        pickle.dump(content, f, protocol=pickle.HIGHEST_PROTOCOL)


def _history():
    import collections

    values = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    values["train"]["metrics/loss"] += [(1, jnp.float32(4.2)), (100, np.float64(3.1))]
    values["eval"]["metrics/Accuracy"] += [(100, 0.25)]
    return {"_values": values}


def _loop_checkpoint_2021(stem, flat, dtype=jnp.float32):
    """``Loop.save_checkpoint`` (version 'Mar-10-2021'): weights and optimizer slots as np.save
    records beside the pickle (bfloat16 as uint16 bits, Trax's _to_bits); state, history and
    the input signature in the pickle."""

    def to_bits(arrays):
        bits = []
        for w in arrays:
            w = jnp.asarray(w, dtype)
            if w.dtype == jnp.bfloat16:
                bits.append(np.asarray(jax.lax.bitcast_convert_type(w, np.uint16)))
            else:
                bits.append(np.asarray(w))
        return bits

    import jax

    for name, arrays in (("weights", flat), ("opt_slots0", [w for w in flat for _ in range(2)])):
        with open(f"{stem}.{name}.npy.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=2) as f:
            for array in to_bits(arrays):
                np.save(f, array, allow_pickle=False)
    content = {
        "step": 100,
        "flat_weights": 2,
        "flat_state": _jax_state(),
        "flat_eval_state": _jax_state(),
        "history": _history(),
        "slots_per_task": 2,
        "input_signature": _signature(),
        "version_timestamp": "Mar-10-2021",
    }
    with open(f"{stem}.pkl.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=2) as f:
        pickle.dump(content, f)
    return f"{stem}.pkl.gz"


def _loop_checkpoint_2020(path, flat):
    """``Loop.save_checkpoint`` (version 'Aug-21-2020'): everything inline, Adam's two slots per
    weight as jax arrays."""
    weights = [jnp.asarray(w) for w in flat]
    content = {
        "step": 10,
        "flat_weights": weights,
        "flat_state": _jax_state(),
        # jax arrays made from host ones: jnp.zeros_like would compile a program per shape.
        "slots_per_task": (tuple((jnp.asarray(np.zeros_like(w)), jnp.asarray(np.ones_like(w))) for w in flat),),
        "input_signature": _signature(),
        "version_timestamp": "Aug-21-2020",
    }
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=2) as f:
        pickle.dump(content, f)
    return str(path)


@pytest.mark.usefixtures("trax_shapes_module")
@pytest.mark.parametrize("form", ["save_to_file", "loop_2021", "loop_2020"])
def test_files_trax_writes_under_jax_read_as_the_same_arrays(tmp_path, form):
    flat = read_trax_weights(fixture("terraformer", "model.pkl.gz"))
    if form == "save_to_file":
        path = tmp_path / "model.pkl.gz"
        _save_to_file(path, flat)
    elif form == "loop_2021":
        path = _loop_checkpoint_2021(str(tmp_path / "model_100"), flat)
    else:
        path = _loop_checkpoint_2020(tmp_path / "model.pkl.gz", flat)
    read = read_trax_weights(str(path))
    assert len(read) == len(flat)
    for got, want in zip(read, flat):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)


@pytest.mark.usefixtures("trax_shapes_module")
@pytest.mark.parametrize("form", ["save_to_file", "loop_2021"])
def test_bfloat16_files_widen_to_the_exact_bfloat16_values(tmp_path, form):
    flat = read_trax_weights(fixture("dense", "model.pkl.gz"))
    if form == "save_to_file":
        path = tmp_path / "model.pkl.gz"
        _save_to_file(path, flat, jnp.bfloat16)
    else:
        path = _loop_checkpoint_2021(str(tmp_path / "model"), flat, jnp.bfloat16)
    read = read_trax_weights(str(path))
    for got, want in zip(read, flat):
        np.testing.assert_array_equal(got, np.asarray(jnp.asarray(want, jnp.bfloat16).astype(jnp.float32)))
        assert np.abs(got - want).max() <= np.abs(want).max() * 2**-8


@pytest.mark.usefixtures("trax_shapes_module")
@pytest.mark.slow
def test_a_loop_checkpoint_saved_under_jax_converts_to_traxs_logits(tmp_path, capsys):
    """The 2021 Loop form end to end through the command line (the fixture's weights)."""
    flat = read_trax_weights(fixture("scaling_transformer", "model.pkl.gz"))
    checkpoint = _loop_checkpoint_2021(str(tmp_path / "model_200000"), flat)
    out = tmp_path / "run"
    status = convert_cli.main(
        [
            "trax",
            f"--checkpoint={checkpoint}",
            f"--trax_config={fixture('scaling_transformer', 'config.json')}",
            f"--out={out}",
        ]
    )
    assert status == 0, capsys.readouterr().err
    run = terra.load(str(out))
    encoder_tokens, _, shifted = _inputs("scaling_transformer")
    # Jitted, as in test_converted_checkpoint_gives_trax_eval_logits (the same program).
    logits = jax.jit(run.model.module.apply)({"params": run.params}, jnp.asarray(encoder_tokens), jnp.asarray(shifted))
    expected = np.load(fixture("scaling_transformer", "eval_logits.npz"))["logits"]
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=0)


# ----- Trax's constructor arguments, exactly -----------------------------------------------------


def test_sparse_qkv_sparsity_defaults_to_n_heads_as_in_trax():
    constructor, kwargs = _arguments("scaling_transformer")
    attention = dict(kwargs["encoder_decoder_attention_type"])
    attention["partial_kwargs"] = {k: v for k, v in attention["partial_kwargs"].items() if k != "sparsity"}
    _, bindings = trax_gin(constructor, {**kwargs, "encoder_decoder_attention_type": attention})
    assert f"SparseQKVAttention.attention_sparsity = {kwargs['n_heads']}" in bindings


def test_an_omitted_terraformer_ff_dropout_is_the_dropout():
    constructor, kwargs = _arguments("terraformer")
    kwargs = {k: v for k, v in kwargs.items() if k != "ff_dropout"}
    _, bindings = trax_gin(constructor, {**kwargs, "dropout": 0.05})
    assert "TransformerConfig.ff_dropout = 0.05" in bindings
    _, bindings = trax_gin("ConfigurableTransformer", {"input_vocab_size": 100, "dropout": 0.05})
    assert "TransformerConfig.ff_dropout = 0.1" in bindings  # ConfigurableTransformer's own default


@pytest.mark.parametrize(
    "model, change, named",
    [
        ("scaling_transformer", {"pos_start_from_zero_prob": 0.5}, "no argument(s) ['pos_start_from_zero_prob']"),
        ("scaling_transformer", {"pos_max_offset_to_add": 8}, "no argument(s) ['pos_max_offset_to_add']"),
        ("scaling_transformer", {"ff_sparsity": [8, 16, 0.1]}, "ff_sparsity=[8, 16, 0.1]"),
        ("scaling_transformer", {"ff_sparsity": "8 x"}, "ff_sparsity=['8 x']"),
        ("scaling_transformer", {"n_encoder_layers": "2\nTransformerConfig.d_model = 7"}, "n_encoder_layers="),
        ("scaling_transformer", {"dropout": 2.0}, "dropout=2.0"),
        ("terraformer", {"center_layernorm": "no"}, "center_layernorm='no'"),
        ("terraformer", {"reversible": True}, "no argument(s) ['reversible']"),
    ],
)
def test_arguments_trax_does_not_take_are_refused_by_name(model, change, named):
    constructor, kwargs = _arguments(model)
    with pytest.raises(ConfigError) as error:
        trax_gin(constructor, {**kwargs, **change})
    assert named in str(error.value)


def test_ff_sparsity_takes_traxs_two_and_four_element_and_string_forms():
    constructor, kwargs = _arguments("scaling_transformer")
    _, pair = trax_gin(constructor, {**kwargs, "ff_sparsity": [8, 4]})
    assert "SparseFeedForward.d_lowrank = 4" in pair and "SparseFeedForward.temperature = 0.1" in pair
    _, four = trax_gin(constructor, {**kwargs, "ff_sparsity": "8 4 0.5 0.2"})
    assert "SparseFeedForward.temperature = 0.5" in four and "SparseFeedForward.quant_prob = 0.2" in four
    _, single = trax_gin(constructor, kwargs)
    assert "SparseFeedForward.d_lowrank = None" in single and "SparseFeedForward.quant_prob = 0.3" in single


def test_center_layernorm_false_converts_with_traxs_norm_choices(tmp_path):
    """Trax keeps an unused bias in every RMS-style LayerNorm (read and dropped); its final norm and
    the norm after a non-reversible encoder are centred whatever the flag; the SRU branch's norm
    follows it."""
    constructor, kwargs = _arguments("terraformer")
    kwargs = {**kwargs, "center_layernorm": False, "reversible_encoder": False}
    files, bindings = trax_gin(constructor, kwargs)
    parsing.parse_gin(files, bindings, finalize=False)
    abstract = parsing.build_model().abstract_params()
    assert "bias" in abstract["decoder_norm"] and "bias" in abstract["encoder_norm"]
    half = abstract["decoder_stack"]["layer_2"]["layer"]  # the decoder's first feed-forward half
    assert "bias" not in half["norm"] and "bias" not in half["sru"]["norm"]
    assert "bias" not in abstract["decoder_stack"]["layer_0"]["norm"]
    leaves = trax_leaves(abstract)
    dropped = [leaf for leaf in leaves if not leaf.path]
    assert dropped and all("unused without centring" in leaf.describe for leaf in dropped)
    rng = np.random.default_rng(0)
    flat = [rng.normal(size=leaf.shape).astype(np.float32) for leaf in leaves]
    params = to_terra_params(flat, abstract)
    kept = [(leaf, array) for leaf, array in zip(leaves, flat) if leaf.path]
    for leaf, array in kept:
        if leaf.path[-1] == "scale":
            np.testing.assert_array_equal(params_at(params, leaf.path), array)
    arguments = tmp_path / "args.json"
    arguments.write_text(json.dumps({"trax_constructor": constructor, "constructor_kwargs": kwargs}))
    checkpoint = tmp_path / "model.pkl.gz"
    _write_weights(checkpoint, flat)
    run = terra.load(convert_trax_checkpoint(str(checkpoint), str(tmp_path / "run"), trax_config=str(arguments)))
    np.testing.assert_array_equal(run.params["decoder_norm"]["bias"], params["decoder_norm"]["bias"])


def params_at(params, path):
    for key in path:
        params = params[key]
    return params


def test_a_checkpoint_name_cannot_add_lines_to_config_gin(tmp_path):
    named = tmp_path / "model\nTransformerConfig.d_model = 7\n.pkl.gz"
    shutil.copyfile(fixture("dense", "model.pkl.gz"), named)
    out = convert_trax_checkpoint(str(named), str(tmp_path / "run"), trax_config=fixture("dense", "config.json"))
    with open(os.path.join(out, "config.gin")) as f:
        config = f.read()
    assert "\nTransformerConfig.d_model = 7" not in config
    assert terra.load(out).model.config.d_model == 64


def test_a_symlinked_out_is_one_error_and_nothing_is_written(tmp_path, capsys):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "nowhere")
    status = convert_cli.main(
        [
            "trax",
            f"--checkpoint={fixture('dense', 'model.pkl.gz')}",
            f"--trax_config={fixture('dense', 'config.json')}",
            f"--out={link}",
        ]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(err) == 1 and "is a symbolic link" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not (tmp_path / "nowhere").exists()


# ----- LSH attention (the long-document Terraformer) ---------------------------------------------


def _trax_lsh_hash_keys():
    """Each Trax LSHSelfAttention's hash keys as saved in model.pkl.gz's state, in tree order (the
    encoder's layers, then the decoder's): ``[batch * heads, 2]`` uint32, row example·heads + head.
    terra's reader drops the state; this fixture is ours, so plain pickle reads it."""
    with gzip.open(fixture(LSH, "model.pkl.gz")) as f:
        state = pickle.load(f)["flat_state"]
    return [np.asarray(s) for s in state if np.asarray(s).dtype == np.uint32]


class _TraxHashing:
    """Hashes each terra LSHSelfAttention call as the Trax layer in its place did in the eval
    call that made the fixture (an interceptor for ``nn.intercept_methods``).

    Trax's eval-mode LSHSelfAttention (trax/layers/research/efficient_attention.py,
    ``forward_unbatched`` and ``hash_vecs``) hashes example b, head h with rotations
    ``R = normal(split(k)[1], [d_head, n_hashes, n_buckets / 2])`` from the key k its state holds
    for (b, h), and ``bucket = argmax([qR, -qR])`` of the unnormalised shared-QK projection q.
    terra draws its own rotations (per head, from a seed), so the converted model is compared
    with Trax's at Trax's hashing decisions, passed in through ``buckets=``.

    ``buckets`` holds each call's buckets as traced; ``computed()`` their values once the calls
    have run: a reversible stack traces its layers inside a ``custom_vjp``, whose tracers cannot
    leave it under ``jit``, so the values come back by a callback.
    """

    def __init__(self, keys, n_buckets: int, hash_decoder: bool = True):
        self.keys = {False: keys[:2], True: keys[2:]}  # by causal: encoder layers, decoder layers
        self.n_buckets, self.hash_decoder = n_buckets, hash_decoder
        self.buckets = {False: [], True: []}
        self._values = {}

    def computed(self):
        """Every call's buckets (the encoder's layers, then the decoder's), as computed."""
        jax.effects_barrier()
        calls = [(causal, i) for causal in (False, True) for i in range(len(self.buckets[causal]))]
        return [self._values[call] for call in calls]

    def _record(self, call, buckets):
        self._values[call] = np.asarray(buckets)

    def __call__(self, next_fun, args, kwargs, context):
        module = context.module
        lsh_call = isinstance(module, LSHSelfAttention) and context.method_name == "__call__"
        if not lsh_call or (module.causal and not self.hash_decoder):
            return next_fun(*args, **kwargs)
        kernel = meta.unbox(module.variables["params"]["qv"]["kernel"])  # [heads, (q, v), d_head, d_model]
        q = jnp.einsum("bld,hkd->bhlk", args[0], kernel[:, 0])
        layer_keys = self.keys[module.causal][len(self.buckets[module.causal])]
        batch, heads, _, d_head = q.shape
        shape = (d_head, module.n_hashes, self.n_buckets // 2)
        rotations = jax.vmap(lambda k: jax.random.normal(jax.random.split(k)[1], shape))(jnp.asarray(layer_keys))
        rotated = jnp.einsum("bhld,bhdrk->bhrlk", q, rotations.reshape(batch, heads, *shape))
        buckets = jnp.argmax(jnp.concatenate([rotated, -rotated], axis=-1), axis=-1)
        jax.debug.callback(functools.partial(self._record, (module.causal, len(self.buckets[module.causal]))), buckets)
        self.buckets[module.causal].append(buckets)
        return next_fun(*args, **{**kwargs, "buckets": buckets})


def _n_buckets():
    return _arguments(LSH)[1]["encoder_attention_type"]["partial_kwargs"]["n_buckets"]


@pytest.mark.slow
def test_converted_lsh_terraformer_gives_trax_eval_logits_at_traxs_hashing(loaded):
    """Trax's buckets recomputed from the hash keys in its file equal the ones it used
    (lsh_buckets.npz); given them, terra's LSH layers compute what Trax's do."""
    run = loaded(LSH)
    encoder_tokens, _, shifted = _inputs(LSH)

    hashing = _TraxHashing(_trax_lsh_hash_keys(), _n_buckets())

    @jax.jit  # one program, where op by op each operation (and each hash draw) compiles on its own
    def forward(params, encoder_tokens, shifted):
        with nn.intercept_methods(hashing):
            logits = run.model.module.apply({"params": params}, encoder_tokens, shifted)
        return logits

    logits = forward(run.params, jnp.asarray(encoder_tokens), jnp.asarray(shifted))
    replayed = hashing.computed()
    recorded = np.load(fixture(LSH, "lsh_buckets.npz"))
    assert len(replayed) == len(recorded.files) == 6
    real = np.asarray(encoder_tokens != 0)[:, None, None, :]
    for i, buckets in enumerate(replayed):
        buckets = np.asarray(buckets)
        if i < 2:  # the encoder's padding goes to the extra bucket n_buckets, in Trax as in terra
            buckets = np.where(real, buckets, _n_buckets())
        np.testing.assert_array_equal(buckets, recorded[f"layer_{i}"])
    expected = np.load(fixture(LSH, "eval_logits.npz"))["logits"]
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_converted_lsh_terraformer_decodes_token_by_token_as_trax_predicts(loaded):
    """The fixture's decoder LSH holds its sequence in one chunk, so which keys a step sees does
    not depend on the hash; the encoder is hashed as Trax's was. Row 1 (padded encoder input) is
    compared with Trax's eval logits: Trax's first predict call concatenates [real encoder
    vectors, decoder token 0, the encoder's outputs at padding positions, a zero] and its LSH
    layers mask none of those slots (config.json "decode"; the README shows terra reproducing
    that too), while terra's decoding masks them as eval never has them."""
    run = loaded(LSH)
    encoder_tokens, _, shifted = _inputs(LSH)
    predicted = np.load(fixture(LSH, "decode_logits.npz"))
    teacher_forced = np.load(fixture(LSH, "eval_logits.npz"))["logits"]
    np.testing.assert_array_equal(predicted["decoder_tokens_fed"], shifted)
    assert np.abs(predicted["logits"][1] - teacher_forced[1]).max() > 1e-2  # Trax's unmasked padding
    hashing = _TraxHashing(_trax_lsh_hash_keys(), _n_buckets(), hash_decoder=False)
    decoder = run.model.decoder(shifted.shape[1])
    with nn.intercept_methods(hashing):
        cache = decoder.prefill(run.params, jnp.asarray(encoder_tokens))
        steps = []
        for t in range(shifted.shape[1]):
            logits, cache = decoder.step(run.params, cache, jnp.asarray(shifted[:, t]))
            steps.append(np.asarray(logits))
    assert len(hashing.buckets[False]) == 2, "the prefill's encoder ran outside the interceptor"
    decoded = np.stack(steps, axis=1)
    np.testing.assert_allclose(decoded[0], predicted["logits"][0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(decoded[1], teacher_forced[1], atol=1e-5, rtol=0)


def test_lsh_arguments_map_onto_scoped_terra_bindings():
    """Every LSHSelfAttention argument that decides what it computes is bound per side; the ones
    the Terraformer passes itself (causal, both dropouts) follow Trax's blocks, not the partial."""
    constructor, kwargs = _arguments(LSH)
    _, bindings = trax_gin(constructor, kwargs)
    for binding in (
        "Terraformer.encoder_attention = @encoder/LSHSelfAttention",
        "Terraformer.decoder_attention = @decoder/LSHSelfAttention",
        "encoder/LSHSelfAttention.causal = False",
        "encoder/LSHSelfAttention.chunk_len = 4",
        "encoder/LSHSelfAttention.n_chunks_after = 1",
        "encoder/LSHSelfAttention.n_hashes = 2",
        "decoder/LSHSelfAttention.causal = True",
        "decoder/LSHSelfAttention.chunk_len = 20",
        "decoder/LSHSelfAttention.n_hashes = 1",
        "decoder/LSHSelfAttention.n_buckets = 4",
        "decoder/LSHSelfAttention.use_bias = False",
        "Terraformer.attention_output_dropout = True",  # Trax's LSHSelfAttention drops its output
    ):
        assert binding in bindings
    encoder = {"trax_layer": "LSHSelfAttention", "partial_kwargs": {"causal": True, "attention_dropout": 0.5}}
    _, bindings = trax_gin(constructor, {**kwargs, "encoder_attention_type": encoder, "dropout": 0.1})
    assert "encoder/LSHSelfAttention.causal = False" in bindings
    assert "encoder/LSHSelfAttention.attention_dropout = 0.1" in bindings
    assert "encoder/LSHSelfAttention.n_hashes = 1" in bindings  # Trax's defaults for what is omitted
    assert "encoder/LSHSelfAttention.chunk_len = 128" in bindings
    assert "encoder/LSHSelfAttention.n_buckets = None" in bindings
    factorised = {"trax_layer": "LSHSelfAttention", "partial_kwargs": {"n_buckets": [4, 8]}}
    _, bindings = trax_gin(constructor, {**kwargs, "encoder_attention_type": factorised})
    assert "encoder/LSHSelfAttention.n_buckets = [4, 8]" in bindings


def _lsh(**options):
    return {"trax_layer": "LSHSelfAttention", "partial_kwargs": options}


@pytest.mark.parametrize(
    "change, named",
    [
        ({"encoder_attention_type": _lsh(bias=True)}, "LSHSelfAttention, bias=True): not supported"),
        ({"encoder_attention_type": _lsh(n_buckets=3)}, "n_buckets=3) must be None, an even positive integer"),
        ({"encoder_attention_type": _lsh(n_buckets=[2, 3])}, "n_buckets=[2, 3]) must be None"),
        ({"encoder_attention_type": _lsh(chunk_len=0)}, "encoder_attention_type chunk_len=0) must be a positive"),
        ({"encoder_attention_type": _lsh(n_hashes_typo=2)}, "LSHSelfAttention options ['n_hashes_typo']"),
        (
            {"encoder_attention_type": {"trax_layer": "PureLSHSelfAttention", "partial_kwargs": {}}},
            "encoder_attention_type=PureLSHSelfAttention): not supported; terra converts Attention or "
            "LSHSelfAttention here",
        ),
        (
            {"encoder_attention_type": {"trax_layer": "Attention", "partial_kwargs": {}}, "dropout": 0.1},
            "with LSHSelfAttention on one side only: not supported",
        ),
    ],
)
def test_lsh_arguments_terra_does_not_implement_are_named(change, named):
    constructor, kwargs = _arguments(LSH)
    with pytest.raises(ConfigError) as error:
        trax_gin(constructor, {**kwargs, **change})
    assert named in str(error.value)


def test_lsh_projections_are_per_head_in_trax_and_fused_in_terra():
    """Trax's w_q, w_v [heads, d_model, d_head] fill terra's qv [heads, 2, d_head, d_model];
    w_o [heads, d_head, d_model] is out [d_model, heads, d_head]."""
    files, bindings = trax_gin(*_arguments(LSH))
    parsing.parse_gin(files, bindings, finalize=False)
    abstract = parsing.build_model().abstract_params()
    leaves = trax_leaves(abstract)
    flat = [np.arange(np.prod(leaf.shape), dtype=np.float32).reshape(leaf.shape) for leaf in leaves]
    at = {name: next(i for i, leaf in enumerate(leaves) if f"LSH {name}" in leaf.describe) for name in ("w_q", "w_v")}
    at["w_o"] = next(i for i, leaf in enumerate(leaves) if "LSH w_o" in leaf.describe)
    params = to_terra_params(flat, abstract)
    layer = params["encoder_stack"]["layer_0"]["layer"]
    assert set(layer) == {"qv", "out"} and set(layer["qv"]) == {"kernel"}  # Trax's LSH has no biases
    w_q, w_v, w_o = flat[at["w_q"]], flat[at["w_v"]], flat[at["w_o"]]
    for h, k, d in [(0, 1, 2), (3, 15, 63)]:
        assert layer["qv"]["kernel"][h, 0, k, d] == w_q[h, d, k]
        assert layer["qv"]["kernel"][h, 1, k, d] == w_v[h, d, k]
        assert layer["out"]["kernel"][d, h, k] == w_o[h, k, d]


def test_a_terra_lsh_layer_with_biases_is_refused_by_the_layout():
    """A terra config of the same architecture but LSHSelfAttention.use_bias = True (the 800M
    encoder's) has an output bias no Trax LSHSelfAttention stores."""
    files, bindings = trax_gin(*_arguments(LSH))
    parsing.parse_gin(files, [*bindings, "encoder/LSHSelfAttention.use_bias = True"], finalize=False)
    with pytest.raises(CheckpointError, match="LSHSelfAttention with use_bias=True: not supported"):
        trax_leaves(parsing.build_model().abstract_params())


# ----- what terra does not convert: one line saying so, and what it does convert -----------------


@pytest.mark.parametrize(
    "arguments, named",
    [
        (
            {"trax_constructor": "trax.models.ConfigurableTransformerLM", "constructor_kwargs": {"vocab_size": 64}},
            "the Trax model ConfigurableTransformerLM is not supported: terra converts "
            "trax.models.ConfigurableTransformer (encoder-decoder) and trax.models.ConfigurableTerraformer",
        ),
        (
            {
                "trax_constructor": "trax.models.ConfigurableTerraformer",
                "constructor_kwargs": {
                    **_arguments(LSH)[1],
                    "encoder_decoder_attention_type": [
                        {"trax_layer": "LSHSelfAttention", "partial_kwargs": {}},
                        {"trax_layer": "MultiplicativeConvCausalAttention", "partial_kwargs": {}},
                    ],
                },
            },
            "ConfigurableTerraformer(encoder_decoder_attention_type=[LSHSelfAttention, "
            "MultiplicativeConvCausalAttention]): a per-layer list of layer types is not supported; terra converts "
            "one type for every layer: CausalAttention, MultiplicativeConvCausalAttention, LSHSelfAttention",
        ),
        (
            {
                "trax_constructor": "trax.models.ConfigurableTransformer",
                "constructor_kwargs": {"input_vocab_size": 64, "encoder_attention_type": _lsh()},
            },
            "ConfigurableTransformer(encoder_attention_type=LSHSelfAttention): not supported; terra converts "
            "Attention here",
        ),
    ],
)
def test_models_terra_does_not_convert_are_refused_as_not_supported(tmp_path, capsys, arguments, named):
    config = tmp_path / "args.json"
    config.write_text(json.dumps(arguments))
    out = tmp_path / "run"
    status = convert_cli.main(
        ["trax", f"--checkpoint={fixture('dense', 'model.pkl.gz')}", f"--trax_config={config}", f"--out={out}"]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert named in err[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["args.json"]
