"""Converting the paper's own (Trax) checkpoints: the fixtures in tests/fixtures/trax were made
by running Trax (see their README); a converted run must give Trax's logits."""

import gzip
import io
import json
import os
import pickle
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import terra
from terra import gin_utils
from terra.cli import convert as convert_cli
from terra.convert import convert_trax_checkpoint
from terra.convert.trax_arguments import trax_gin
from terra.convert.trax_file import read_trax_weights
from terra.convert.trax_layout import to_terra_params, trax_leaves
from terra.errors import CheckpointError, ConfigError
from terra.training import checkpointing

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "trax")
MODELS = ("dense", "scaling_transformer", "terraformer")


def fixture(model: str, name: str) -> str:
    return os.path.join(FIXTURES, model, name)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each fixture converted once through the command line: ``{model: run directory}``."""
    root = tmp_path_factory.mktemp("converted")
    runs = {}
    for model in MODELS:
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


def _inputs(model):
    inputs = np.load(fixture(model, "inputs.npz"))
    return inputs["encoder_tokens"], inputs["decoder_tokens"], inputs["decoder_tokens_shifted"]


@pytest.mark.parametrize("model", MODELS)
def test_converted_checkpoint_gives_trax_eval_logits(converted, model):
    run = terra.load(converted[model])
    encoder_tokens, _, shifted = _inputs(model)
    logits = run.model.module.apply({"params": run.params}, jnp.asarray(encoder_tokens), jnp.asarray(shifted))
    expected = np.load(fixture(model, "eval_logits.npz"))["logits"]
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model", MODELS)
def test_converted_checkpoint_gives_trax_decode_logits_token_by_token(converted, model):
    run = terra.load(converted[model])
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


def test_converted_run_is_a_fine_tuning_starting_point(converted):
    """INIT_FROM reads the parameters with restore_params onto the configured model's tree."""
    run = terra.load(converted["scaling_transformer"])
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
    gin_utils.parse_gin(files, bindings, finalize=False)
    abstract = gin_utils.build_model().abstract_params()
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


def test_a_terra_gin_config_of_the_same_architecture_converts_alike(converted, tmp_path):
    files, bindings = trax_gin(*_arguments("terraformer"))
    out = convert_trax_checkpoint(
        fixture("terraformer", "model.pkl.gz"), str(tmp_path / "from_gin"), gin_files=files, gin_bindings=bindings
    )
    a, b = terra.load(out).params, terra.load(converted["terraformer"]).params
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
