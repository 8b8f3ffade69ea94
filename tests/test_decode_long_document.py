"""The decode benchmark at long inputs (the ``long_document`` preset's path, issue 40): every row at
each input length with its prefill, cache reads, floors and peak memory; rows that cannot run are
skipped with the reason; the decoder cache sized from the tokens decoded, not the input; the
cache bytes an LSH step really reads. Tiny models only; timings are printed, never asserted."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from terra import errors
from terra.backends.decode_state import KVCache, LSHCache
from terra.benchmarks import decode_speed, presets, report
from terra.decoding.decode_step import IncrementalDecoder
from terra.gin_config import parsing

from helpers import is_png

pytestmark = pytest.mark.usefixtures("fast_compile", "clean_gin")

LONG_KEYS = {
    "input_length",
    "prefill_seconds",
    "seconds_per_token_loop",
    "weight_bytes_per_token",
    "cache_bytes_per_token",
    "cache_bytes_stored",
    "floor_seconds",
    "weight_floor_seconds",
    "cache_floor_seconds",
    "peak_resident_bytes",
    "peak_resident_source",
    "resident_before_bytes",
    "estimated_memory_bytes",
    "params_and_caches_bytes",
    "cache_dtype",
}


# One encoder and one decoder layer instead of the tiny configs' two: what these tests check (the
# rows and lengths run, their keys, which cache bytes grow with the input, the LSH step's kept rows,
# skips, the cache's length) is per layer, and each (row, length) traces and compiles its model
# several times (build, memory estimate, prefill, loops, cache reads).
ONE_LAYER = ["TransformerConfig.n_encoder_layers = 1", "TransformerConfig.n_decoder_layers = 1"]


def _long_config(rows, lengths, **overrides):
    config = presets.tiny()
    config.common_bindings = list(ONE_LAYER)
    config.rows = rows
    config.input_lengths = tuple(lengths)
    config.tokens, config.warmup, config.repeats, config.bandwidth_buffer_mb = 4, 1, 1, 16
    config.time_calls = False
    config.update(overrides)
    return config


@pytest.mark.slow
def test_the_long_document_path_times_each_row_at_each_length(tmp_path):
    dense = presets.tiny().rows[0]
    lsh = presets.make_row("Terraformer LSH · int8", "models/tiny_terraformer_lsh.gin", weights_dtype="int8")
    # 80 input positions: more than the 63 rows an LSH step keeps (2 hashes x chunks of 16 x 2 - 1).
    narrow = presets.make_row("baseline Transf. · int8 cache", "models/tiny.gin", cache_dtype="int8")
    config = _long_config([dense, lsh, narrow], (8, 80))
    rows = decode_speed.run_preset(config, str(tmp_path), "long", log=lambda *a: None)
    assert [(r["name"], r["input_length"]) for r in rows] == [
        ("baseline Transf.", 8),
        ("baseline Transf.", 80),
        ("Terraformer LSH · int8", 8),
        ("Terraformer LSH · int8", 80),
        ("baseline Transf. · int8 cache", 8),
        ("baseline Transf. · int8 cache", 80),
    ]
    for r in rows:
        assert LONG_KEYS <= set(r), LONG_KEYS - set(r)
        assert not r.get("skipped") and r["long_document"] and r["timed_tokens"] == 0  # no step calls
        assert r["prefill_seconds"] > 0 and r["peak_resident_bytes"] >= r["resident_before_bytes"] > 0
        assert r["floor_seconds"] == pytest.approx(r["weight_floor_seconds"] + r["cache_floor_seconds"])
        assert r["seconds_per_token_loop"] is None or r["seconds_per_token_loop"] > 0
    short_dense, long_dense, short_lsh, long_lsh, _, long_narrow = rows
    # An int8 cache: a byte per value and a float32 scale per row of d_head (16) values.
    assert long_narrow["cache_dtype"] == "int8" and "TransformerConfig.cache_dtype = 'int8'" in long_narrow["bindings"]
    assert long_narrow["cache_bytes_per_token"] < long_dense["cache_bytes_per_token"] / 2
    # An encoder-decoder's step reads every cache whole; its encoder keys/values grow with the input.
    assert long_dense["cache_bytes_per_token"] == long_dense["cache_bytes_stored"]
    assert long_dense["cache_bytes_per_token"] > short_dense["cache_bytes_per_token"]
    assert long_dense["weight_bytes_per_token"] == short_dense["weight_bytes_per_token"]
    # The LSH step reads only its kept rows of the longer cache.
    assert short_lsh["cache_bytes_per_token"] == short_lsh["cache_bytes_stored"]
    assert long_lsh["cache_bytes_per_token"] < long_lsh["cache_bytes_stored"]
    assert short_lsh["speedup_reference"] == "baseline Transf."  # the dense row of the same length
    table = (tmp_path / "decode_speed.md").read_text()
    assert "| row | input length | prefill | in loop | weights MB / token | caches MB / token |" in table
    assert "| Terraformer LSH · int8 | 80 |" in table and ("VmHWM" in table or "ru_maxrss" in table)
    # What each row added to the process, and as a multiple of its weights plus caches.
    assert "| peak GB | added GB (x weights + caches) |" in table and table.count("x) |") == len(rows)
    assert is_png(str(tmp_path / "decode_speed.png"))
    assert json.loads((tmp_path / "decode_speed.json").read_text())[3]["input_length"] == 80
    assert not (tmp_path / decode_speed.PARTIAL).exists()  # kept only while the run goes on


@pytest.mark.slow
def test_a_row_that_does_not_fit_the_memory_is_skipped_with_the_reason_and_the_run_goes_on(tmp_path, monkeypatch):
    # The rows' model, as _long_config binds it and the benchmark builds it (no data layer).
    parsing.parse_gin(["models/tiny.gin"], ONE_LAYER, finalize=False)
    model = parsing.build_model()
    decoder = IncrementalDecoder(model.module, 6)
    small, large = (decode_speed.estimate_memory(model, decoder, n)["total"] for n in (8, 200))
    assert small < large
    first, second = presets.tiny().rows[0], presets.make_row("dense again", "models/tiny.gin")
    # Room for the 8-token rows, not for the 200-token ones.
    config = _long_config([first, second], (200, 8), memory_limit_gb=(small + large) / 2 / 1e9)
    real, calls = decode_speed.measure_decode, []

    def exhausted_once(*args, **kwargs):  # the first row to run runs out of memory
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes.\nmore")
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_speed, "measure_decode", exhausted_once)
    lines = []
    rows = decode_speed.run_preset(config, str(tmp_path), "skips", log=lines.append)
    assert [(r["name"], r["input_length"], bool(r.get("skipped"))) for r in rows] == [
        ("baseline Transf.", 200, True),
        ("baseline Transf.", 8, True),
        ("dense again", 200, True),
        ("dense again", 8, False),
    ]
    assert rows[0]["skipped"].startswith("estimated ") and "exceeds --config.memory_limit_gb" in rows[0]["skipped"]
    assert rows[1]["skipped"] == "out of memory: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes."
    assert rows[3]["seconds_per_token_loop"] is None or rows[3]["seconds_per_token_loop"] > 0
    assert rows[3]["speedup_vs_dense_loop"] is None  # its length's dense row did not run
    assert any("skipped: estimated" in line for line in lines)
    table = (tmp_path / "decode_speed.md").read_text()
    assert "| baseline Transf. | 200 | skipped: estimated " in table and "| dense again | 8 | " in table
    assert is_png(str(tmp_path / "decode_speed.png"))  # the plot leaves the skipped rows out
    assert report.rerender(str(tmp_path)) == table  # and redraws from the JSON


def test_other_errors_of_a_row_are_not_taken_for_running_out_of_memory():
    assert decode_speed.is_out_of_memory(MemoryError())
    assert decode_speed.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating"))
    assert not decode_speed.is_out_of_memory(ValueError("shapes do not match"))


@pytest.mark.slow
def test_an_input_longer_than_twice_the_decoder_table_decodes_and_one_longer_than_the_table_is_one_error():
    # Issue 40: the decoder cache was sized max(2 * input_length, tokens), 48 rows past a 32-row
    # table here; now 32, the reference's (decoder_cache_length).
    config = presets.tiny()
    config.rows = [config.rows[0]]
    config.common_bindings = ["TransformerConfig.max_len = 32", *ONE_LAYER]
    config.input_length, config.tokens, config.warmup, config.repeats, config.bandwidth_buffer_mb = 24, 4, 1, 1, 16
    (row,) = decode_speed.run_preset(config, None, "bug", log=lambda *a: None)
    assert row["input_length"] == 24 and row["seconds_per_token_median"] > 0
    config.input_length = 40
    with pytest.raises(errors.ConfigError, match=r"input of 40 positions .*TransformerConfig.max_len=32\)"):
        decode_speed.run_preset(config, None, "bug", log=lambda *a: None)


def test_the_decoder_cache_holds_the_tokens_decoded_not_the_input():
    config = presets.tiny()
    config.input_length, config.tokens, config.warmup = 4096, 12, 4
    assert decode_speed.decoder_cache_length(config) == 32  # the reference's slots, whatever the input
    config.tokens = 256
    assert decode_speed.decoder_cache_length(config) == 256
    config.time_calls = False  # the two loops of a repetition continue one cache
    assert decode_speed.decoder_cache_length(config) == 258
    assert decode_speed.decoder_cache_length(presets.long_document()) == 258


def test_a_narrow_cache_row_is_its_gin_binding_and_float32_adds_none():
    config = presets.tiny()
    plain = presets.make_row("a", "models/tiny.gin")
    narrow = presets.make_row("b", "models/tiny.gin", weights_dtype="int8", cache_dtype="int8")
    assert decode_speed.row_bindings(plain, config) == ([], "float32", "float32")
    assert decode_speed.row_bindings(narrow, config) == (["TransformerConfig.cache_dtype = 'int8'"], "int8", "int8")
    config.cache_dtype = "bfloat16"
    assert decode_speed.row_bindings(plain, config)[0] == ["TransformerConfig.cache_dtype = 'bfloat16'"]


def _s(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_cache_reads_count_an_lsh_layers_kept_rows_and_narrow_caches_at_their_itemsize():
    heads, rows, d, hashes = 2, 100, 8, 2
    lsh = LSHCache(
        bucket_counts=None,
        bucket_positions=None,
        index=_s((), jnp.int32),
        buckets=_s((1, heads, hashes, rows), jnp.int32),
        key=_s((1, heads, rows, d), jnp.int8),
        key_scale=_s((1, heads, rows)),
        value=_s((1, heads, rows, d), jnp.int8),
        value_scale=_s((1, heads, rows)),
        recent_counts=None,
        recent_positions=None,
        rotations=_s((heads, d, hashes, 4)),
    )
    dense = {"kv": KVCache(_s((1, heads, rows, d), jnp.bfloat16), None, _s((0,)), None, index=_s((), jnp.int32))}
    cache = {"decoder": {"lsh_0": {"lsh": lsh}, "attention_0": dense}, "position": _s((), jnp.int32)}
    settings = {("decoder", "lsh_0"): {"n_hashes": hashes, "chunk_len": 4, "n_chunks_before": 1, "std_length": None}}
    kept = hashes * 4 * 2 - 1  # 15 of the 100 rows
    assert decode_speed.lsh_kept_rows(settings[("decoder", "lsh_0")], rows) == kept
    reads = decode_speed.cache_reads_per_token(cache, settings)
    kept_rows = 2 * (heads * kept * d * 1 + heads * kept * 4)  # int8 keys and values, float32 scales
    lsh_read = kept_rows + heads * hashes * rows * 4 + heads * d * hashes * 4 * 4 + 4  # + buckets, rotations, index
    dense_read = heads * rows * d * 2 + 4
    assert reads["lsh"] == lsh_read
    assert reads["total"] == lsh_read + dense_read + 4
    assert reads["stored"] == sum(decode_speed._nbytes(x) for x in jax.tree.leaves(cache))
    # Unnamed LSH layers are counted whole (an upper bound); std_length keeps every row.
    assert decode_speed.cache_reads_per_token(cache)["total"] == reads["stored"]
    whole = {**settings[("decoder", "lsh_0")], "std_length": 128}
    assert decode_speed.cache_reads_per_token(cache, {("decoder", "lsh_0"): whole})["total"] == reads["stored"]
    # With bucket lists: the token's own list per round, and the buckets of the candidates.
    lists = {"bucket_positions": _s((1, heads, hashes, 8, kept), jnp.int32)}
    lists["bucket_counts"] = _s((1, heads, hashes, 8), jnp.int32)
    listed = {"lsh": dataclasses.replace(lsh, **lists)}
    reads = decode_speed.cache_reads_per_token({"lsh_0": listed}, {("lsh_0",): settings[("decoder", "lsh_0")]})
    candidates = min(rows, (hashes + 1) * kept)
    expected = lsh_read - heads * hashes * rows * 4 + heads * hashes * candidates * 4
    assert reads["total"] == expected + heads * hashes * kept * 4 + heads * hashes * 4


def test_the_lsh_layers_a_step_runs_are_found_with_their_settings():
    parsing.parse_gin(["models/tiny_terraformer_lsh.gin"], [], finalize=False)  # as the benchmark builds it
    model = parsing.build_model()
    decoder = IncrementalDecoder(model.module, 6)
    params = model.abstract_params()
    cache = jax.eval_shape(decoder.prefill, params, _s((1, 100), jnp.int32))
    found = decode_speed.lsh_layers(decoder, params, cache)
    assert len(found) == 2 * model.config.n_decoder_layers  # two decoder attentions per layer
    for path, settings in found.items():
        assert (settings["n_hashes"], settings["chunk_len"], settings["n_chunks_before"]) == (2, 16, 1)
        node = cache
        for name in path:
            node = node[name]
        assert node["lsh"].buckets.shape[-1] == 106  # the input and the decoded tokens
    reads = decode_speed.cache_reads_per_token(cache, found)
    assert 0 < reads["lsh"] < reads["total"] < reads["stored"]


def test_the_long_document_preset_has_every_model_at_each_store_and_length():
    config = presets.long_document()
    assert config.input_lengths == (1024, 4096, 15360) and config.tokens == 256 and not config.time_calls
    assert len(config.rows) == 12 and config.repeats <= 2
    assert {row.gin_files[0] for row in config.rows} == {
        f"models/{m}_800m.gin" for m in ("dense", "fully_sparse", "terraformer", "terraformer_lsh")
    }
    assert sum(row.cache_dtype == "int8" for row in config.rows) == 4
    assert [r.name for r in presets.select_rows(config, ["float32"]).rows] == [
        "baseline Transf. · float32",
        "fully sparse · float32",
        "Terraformer · float32",
        "Terraformer LSH · float32",
    ]
