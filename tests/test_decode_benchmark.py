"""The decode-speed benchmark: the tiny preset end to end (schema, files) and its bytes/token
accounting against the closed form. Timings are printed, never asserted."""

import json
import os

import pytest

from terra.benchmarks import decode_speed, presets
from terra.models import EncoderDecoderModel, EncoderDecoderTransformer

from conftest import tiny_config

# Timings are printed, never asserted: XLA's optimisations would only cost compile time here.
pytestmark = pytest.mark.usefixtures("fast_compile")

ROW_KEYS = {
    "name",
    "params",
    "seconds_per_token_median",
    "seconds_per_token_min",
    "seconds_per_block",
    "bytes_per_token",
    "achieved_gbps",
    "bandwidth_gbps",
    "speedup_vs_dense",
    "seconds_per_token_loop",
    "speedup_vs_dense_loop",
    "flops_per_token",
    "arithmetic_seconds",
}


def test_tiny_preset_writes_the_table_json_and_plot(tmp_path):
    config = presets.tiny()
    config.tokens, config.warmup, config.bandwidth_buffer_mb = 4, 1, 16
    rows = decode_speed.run_preset(config, str(tmp_path), "smoke", log=lambda *a: None)
    assert len(rows) == len(config.rows)
    saved = json.loads((tmp_path / "decode_speed.json").read_text())
    assert [r["name"] for r in saved] == [r.name for r in config.rows]
    for row in saved:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["seconds_per_token_min"] <= row["seconds_per_token_median"]
        assert row["bytes_per_token"] > 0 and row["bandwidth_gbps"] > 0 and row["params"] > 0
    assert saved[0]["speedup_vs_dense"] == pytest.approx(1.0)
    assert saved[0]["speedup_vs_dense_loop"] == pytest.approx(1.0)
    assert saved[0]["bytes_per_token"] > saved[2]["bytes_per_token"]  # the fully sparse row reads less
    assert "| baseline Transf. |" in (tmp_path / "decode_speed.md").read_text()
    assert os.path.getsize(tmp_path / "decode_speed.png") > 1000
    assert "bandwidth_gbps" in json.loads((tmp_path / "machine.json").read_text())


@pytest.fixture(scope="module")
def dense_decode():
    """A tiny dense model, its decoder for 7 tokens and its sizes, for the closed-form counts."""
    cfg = tiny_config()
    model = EncoderDecoderModel(EncoderDecoderTransformer(cfg))
    sizes = (cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_heads, cfg.n_decoder_layers)
    return model, model.decoder(7), sizes


def test_bytes_per_token_match_the_closed_form_for_a_dense_model(dense_decode):
    model, decoder, (d, f, v, h, layers) = dense_decode
    input_length = 5
    reads = decode_speed.decode_cost_per_token(model, decoder, input_length)
    per_layer = 4 * (d * d + d) + 2 * (d * d + d) + (2 * d * f + f + d) + 3 * 2 * d  # self QKVO, cross Q+O, FF, 3 LN
    weights = layers * per_layer + 2 * d + (v * d + v) + 2 * d  # + final LN, logits, embedding and position rows
    self_kv = 2 * h * 7 * (d // h) + 1  # K and V slots of the cache, plus its index
    cross_kv = 2 * input_length * d + input_length  # cached encoder keys/values and padding bias
    caches = layers * (self_kv + cross_kv) + 1  # + the position counter
    assert reads["weights"] == 4 * weights
    assert reads["caches"] == 4 * caches
    assert reads["total"] == 4 * (weights + caches)


def test_flops_per_token_count_every_product_of_a_dense_model(dense_decode):
    model, decoder, (d, f, v, _, layers) = dense_decode
    input_length = 5
    flops = decode_speed.decode_cost_per_token(model, decoder, input_length)["flops"]
    # Multiply-adds of one token: self Q, K, V, O; cross Q, O; the FF; attention over the 7 cache
    # slots and the 5 encoder positions (scores and weighted values); the logits.
    products = layers * (4 * d * d + 2 * d * d + 2 * d * f + 2 * 7 * d + 2 * input_length * d) + d * v
    assert 2 * products <= flops
    # What remains is elementwise (norms, softmax, residuals, biases): a few dozen per activation.
    assert flops - 2 * products < 48 * d * (layers + 1)


def test_every_preset_names_existing_configs():
    from terra import gin_utils

    for name, make in presets.PRESETS.items():
        for row in make().rows:
            for f in row.gin_files:
                assert os.path.exists(gin_utils.resolve_gin_file(f)), (name, f)
