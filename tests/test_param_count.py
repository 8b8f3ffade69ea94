"""The paper's 800M baseline: parameter count from abstract shapes equals the closed form."""

import os
import subprocess
import sys

import pytest

from terra.gin_config import parsing
from terra.models.param_count import closed_form_param_count

from helpers import REPO_ROOT, tiny_config


def test_800m_parameter_count_from_abstract_shapes_matches_the_closed_form():
    parsing.parse_gin(["models/dense_800m.gin"])
    model = parsing.build_model()
    counts = model.param_count()  # from eval_shape: nothing allocated
    assert counts["total"] == closed_form_param_count(model.config)
    assert 700e6 < counts["total"] < 850e6  # the paper's "800M" class (T5-large shapes)
    cfg = model.config
    assert (cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.vocab_size) == (
        24,
        24,
        1024,
        4096,
        16,
        32000,
    )


def test_closed_form_tracks_every_size():
    from terra.models import EncoderDecoderModel, EncoderDecoderTransformer

    for overrides in ({}, {"n_encoder_layers": 0}, {"d_ff": 48, "vocab_size": 33}, {"max_len": 7}):
        cfg = tiny_config(**overrides)
        counts = EncoderDecoderModel(EncoderDecoderTransformer(cfg)).param_count()
        assert counts["total"] == closed_form_param_count(cfg), overrides


@pytest.mark.slow
def test_the_terra_params_command_prints_the_800m_count():
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "terra-params"), "--gin_file=models/dense_800m.gin"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "775,195,904" in result.stdout and "matches" in result.stdout


@pytest.mark.parametrize("experiment", ["experiments/quickstart.gin", "experiments/synthetic_copy_terraformer.gin"])
def test_an_experiments_model_is_counted_past_its_task_as_the_full_parse_builds_it(experiment):
    from terra.benchmarks import param_count

    # The full parse: the data layer registered, the task config's imports run.
    parsing.parse_gin([experiment], finalize=False, data_layer=True)
    model = parsing.build_model()
    counts = param_count.model_counts([experiment])  # parsed without the data layer
    assert counts["params"] == model.param_count()
    assert counts["read_per_token"] == model.params_read_per_token()


def test_a_file_that_imports_the_data_layer_parses_without_running_the_import_when_asked(tmp_path, monkeypatch):
    # A data-layer module not imported yet (taken out of sys.modules here) stays unimported: the
    # import is refused and passed over, the model bindings kept.
    monkeypatch.delitem(sys.modules, "terra.data.fixtures", raising=False)
    config = tmp_path / "with_import.gin"
    config.write_text("import terra.data.fixtures\ninclude 'models/tiny.gin'\nTransformerConfig.d_model = 48\n")
    parsing.parse_gin([str(config)], finalize=False, data_layer=False)
    assert parsing.build_model().config.d_model == 48 and "terra.data.fixtures" not in sys.modules
    # With the data layer a module that is not there is an error naming the file, as before.
    config.write_text("import terra.evaluation.nowhere\ninclude 'models/tiny.gin'\n")
    with pytest.raises(parsing.GinConfigError, match="with_import.gin"):
        parsing.parse_gin([str(config)], finalize=False, data_layer=True)
