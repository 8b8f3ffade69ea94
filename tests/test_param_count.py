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
