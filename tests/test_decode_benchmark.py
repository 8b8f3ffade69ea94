"""The decode-speed benchmark: the tiny preset end to end (schema, files) and its bytes/token
accounting against the closed form. Timings are printed, never asserted."""

import copy
import json
import os
import shutil

import pytest

from terra.benchmarks import decode_speed, presets, report
from terra.models import EncoderDecoderModel, EncoderDecoderTransformer

from helpers import is_png, tiny_config

# Timings are printed, never asserted: XLA's optimisations would only cost compile time here.
# The module shares a benchmark run: the slow tier.
pytestmark = [pytest.mark.usefixtures("fast_compile"), pytest.mark.slow]

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


@pytest.fixture(scope="module")
def tiny_preset_run(tmp_path_factory):
    """``(config, output folder, rows)`` of one run of the tiny preset, shared by the module (the
    plots test redraws from a copy of its folder)."""
    out = tmp_path_factory.mktemp("decode_speed")
    config = presets.tiny()
    config.tokens, config.warmup, config.bandwidth_buffer_mb = 4, 1, 16
    rows = decode_speed.run_preset(config, str(out), "smoke", log=lambda *a: None)
    return config, out, rows


@pytest.mark.slow
def test_tiny_preset_writes_the_table_json_and_plot(tiny_preset_run):
    config, out, rows = tiny_preset_run
    assert len(rows) == len(config.rows)
    saved = json.loads((out / "decode_speed.json").read_text())
    assert [r["name"] for r in saved] == [r.name for r in config.rows]
    for row in saved:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["seconds_per_token_min"] <= row["seconds_per_token_median"]
        assert row["bytes_per_token"] > 0 and row["bandwidth_gbps"] > 0 and row["params"] > 0
    assert saved[0]["speedup_vs_dense"] == pytest.approx(1.0)
    # A tiny model's in-loop time may be lost in the loop's jitter: then it is None, never a number.
    for row in saved:
        assert row["seconds_per_token_loop"] is None or row["seconds_per_token_loop"] > 0
    if saved[0]["seconds_per_token_loop"] is not None:
        assert saved[0]["speedup_vs_dense_loop"] == pytest.approx(1.0)
    else:
        assert saved[0]["speedup_vs_dense_loop"] is None and "In loop —" in (out / "decode_speed.md").read_text()
    assert saved[0]["bytes_per_token"] > saved[2]["bytes_per_token"]  # the fully sparse row reads less
    # Its int8 row stores every weight in one byte plus a scale per row; the caches stay float32.
    sparse, narrow = saved[2], saved[3]
    assert (narrow["weights_dtype"], sparse["weights_dtype"]) == ("int8", "float32")
    assert narrow["cache_bytes_per_token"] == sparse["cache_bytes_per_token"]
    assert narrow["weight_bytes_per_token"] == int(sparse["weight_bytes_per_token"] / 4 * (1 + 4 / 64))  # d_model 64
    table = (out / "decode_speed.md").read_text()
    assert "| baseline Transf. |" in table
    # Each per-call token is a DecodeSession call, and the table says so; a run stored before rows
    # named their protocol still reads as jitted step calls.
    assert {row["per_call"] for row in saved} == {"DecodeSession.step"}
    assert "Dec. time is one `DecodeSession.step` call per token" in table
    stored_before = {k: v for k, v in saved[0].items() if k != "per_call"}
    assert report.per_call_phrase([stored_before]) == "one jitted `step` call per token"
    assert os.path.getsize(out / "decode_speed.png") > 1000
    assert "bandwidth_gbps" in json.loads((out / "machine.json").read_text())


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
    from terra.gin_config import parsing

    for name, make in presets.PRESETS.items():
        for row in make().rows:
            for f in row.gin_files:
                assert os.path.exists(parsing.resolve_gin_file(f)), (name, f)


def test_an_in_loop_difference_lost_in_jitter_is_flagged_not_reported():
    # 10 steps apart: 5 ms a step stands out of 1 ms of jitter, and one slow repetition
    # (the last) does not move the median.
    long_s, short_s = [0.100, 0.101, 0.1005, 0.300], [0.050, 0.0505, 0.051, 0.050]
    assert decode_speed.measured_difference(long_s, short_s, 10) == pytest.approx(0.005, rel=0.02)
    assert decode_speed.measured_difference([0.050, 0.049], [0.051, 0.050], 4) is None  # not positive
    # Positive, but the repetitions scatter by more than half of it: noise, not a time.
    assert decode_speed.measured_difference([0.0102, 0.0099, 0.0110], [0.0100, 0.0101, 0.0100], 4) is None


def _row(name, step, loop, paper=0.0, baseline=""):
    return {
        "name": name,
        "baseline": baseline,
        "paper_seconds": paper,
        "block_mode": "divide",
        "seconds_per_token_median": step,
        "seconds_per_token_loop": loop,
    }


def test_speedups_are_against_each_rows_baseline_with_the_papers_beside():
    rows = [
        _row("dense", 0.040, 0.036, paper=0.160),
        _row("sparse", 0.020, 0.012, paper=0.061),
        _row("terraformer dense", 0.080, None, baseline="terraformer dense", paper=3.6),
        _row("terraformer sparse", 0.010, 0.008, baseline="terraformer dense", paper=0.18),
    ]
    report.add_speedups(rows, dense_row=0)
    assert [r["speedup_reference"] for r in rows] == ["dense", "dense", "terraformer dense", "terraformer dense"]
    assert rows[0]["speedup_vs_dense"] == 1.0 and rows[0]["speedup_vs_dense_loop"] == 1.0
    assert rows[1]["speedup_vs_dense"] == pytest.approx(2.0) and rows[1]["speedup_vs_dense_loop"] == pytest.approx(3.0)
    assert rows[1]["paper_speedup"] == pytest.approx(0.160 / 0.061)
    assert rows[3]["speedup_vs_dense"] == pytest.approx(8.0) and rows[3]["speedup_vs_dense_loop"] is None
    assert rows[3]["paper_speedup"] == pytest.approx(20.0)


def test_the_plots_draw_a_sweep_in_panels_and_bars_per_baseline_and_redraw_from_json(tiny_preset_run, tmp_path):
    _, measured, measured_rows = tiny_preset_run
    out = tmp_path / "run"
    shutil.copytree(measured, out)  # the preset's outputs, redrawn here without touching the shared run
    rows = copy.deepcopy(measured_rows)
    for i, r in enumerate(rows):  # a sweep of two series, from the rows just measured
        r["series"], r["sparsity"], r["paper_seconds"] = (
            ("ff_sparsity", 0, 0.16) if i < 2 else ("loss_sparsity", 1, 0.0)
        )
        r["sparsity"] = [0, 64, 1, 2, 4][i]
    report.plot(rows, str(out / "sweep.png"), "sweep")
    assert is_png(str(out / "sweep.png"))
    (out / "decode_speed.png").unlink()
    (out / "decode_speed.md").unlink()
    table = report.rerender(str(out))
    assert "| baseline Transf. |" in table and is_png(str(out / "decode_speed.png"))


def test_the_baseline_loop_is_timed_after_each_repetition_of_the_rows_own(dense_decode):
    model, decoder, _ = dense_decode
    params = decode_speed.random_params(model, seed=0)
    calls = []

    def beside(n):
        calls.append(n)
        return 0.5 * n  # seconds, as a loop over n steps would report

    timing = decode_speed.measure_decode(
        decoder, params, [[3, 4, 5, 6, 7]], n_tokens=6, n_skip=2, n_warmup=1, repeats=3, beside=beside
    )
    assert calls == [6, 2] * 3  # the same step counts as the row's loops, once per repetition
    assert timing.beside_loop_s == [(3.0, 1.0)] * 3
    assert timing.median_beside_loop_token_s == pytest.approx(0.5)
    assert len(timing.loop_s) == 3


@pytest.mark.slow
def test_a_preset_with_the_baseline_beside_times_the_dense_row_first_and_keeps_row_order():
    config = presets.tiny()
    config.rows = [config.rows[2], config.rows[0]]  # fully sparse, then dense
    config.dense_row, config.baseline_beside = 1, True
    config.tokens, config.warmup, config.bandwidth_buffer_mb = 6, 1, 16
    names = []
    rows = decode_speed.run_preset(config, None, "beside", log=lambda line: names.append(line.split()[0]))
    assert names[1:3] == ["baseline", "fully"]  # after the machine line: dense first, then the rest
    assert names[-2:] == ["###", "note:"]  # no out_dir: the table, and a note that nothing was written
    assert [r["name"] for r in rows] == ["fully sparse", "baseline Transf."]
    sparse, dense = rows
    assert dense["dense_loop_beside_seconds"] == dense["seconds_per_token_loop"]
    assert "dense_loop_beside_seconds" in sparse  # None only where the tiny loops' jitter hid it
    if sparse["dense_loop_beside_seconds"] and sparse["seconds_per_token_loop"]:
        expected = sparse["dense_loop_beside_seconds"] / sparse["seconds_per_token_loop"]
        assert sparse["speedup_vs_dense_loop_beside"] == pytest.approx(expected)
    else:
        assert sparse["speedup_vs_dense_loop_beside"] is None


def test_the_baseline_beside_is_refused_where_blocks_are_timed_as_differences():
    config = presets.paper_17b_block()
    config.baseline_beside = True
    with pytest.raises(ValueError, match="baseline_beside"):
        decode_speed.run_preset(config, None, "17b", log=lambda line: None)


def test_the_table_shows_the_speedup_beside_and_the_loop_over_its_floor_and_arithmetic():
    rows = [_row("dense", 0.040, 0.036), _row("sparse", 0.010, 0.006)]
    for r, floor, arithmetic, beside in zip(rows, (0.030, 0.002), (0.004, 0.002), (0.036, 0.045)):
        r.update(floor_seconds=floor, arithmetic_seconds=arithmetic, dense_loop_beside_seconds=beside)
    report.add_speedups(rows, dense_row=0)
    # The sparse row's loop beside a dense loop that ran slower in its minutes: 7.5x, not 6x.
    assert rows[1]["speedup_vs_dense_loop"] == pytest.approx(6.0)
    assert rows[1]["speedup_vs_dense_loop_beside"] == pytest.approx(7.5)
    assert rows[1]["loop_over_floor_and_arithmetic"] == pytest.approx(1.5)
    assert rows[0]["loop_over_floor_and_arithmetic"] == pytest.approx(36 / 34)
    for r in rows:
        r.update(params=1, seconds_per_block=0.001, bytes_per_token=1, achieved_gbps=1.0, fraction_of_bandwidth=0.1)
        r.update(flops_per_token=1.0, seconds_per_token_min=r["seconds_per_token_median"])
    machine = {"cpu": "x", "cores": 2, "xla_threads": 2, "bandwidth_after_gbps": 1.0, "product_gflops": 1.0}
    machine.update(jax="0", backend="cpu")
    table = report.markdown_table(rows, machine, 1.0, "t")
    assert "| Speedup beside |" in table and "| 7.50x |" in table and "| 1.50 |" in table


def test_selected_rows_keep_the_rows_they_are_measured_against_in_the_presets_order():
    config = presets.quantized_17b_block()
    picked = presets.select_rows(config, ["FULLY sparse (+ sparse enc-dec attn) · int8", "terraformer sparse"])
    assert [r.name for r in picked.rows] == [
        "baseline Transf. · float32",  # the dense row, which the fully sparse row is measured against
        "fully sparse (+ sparse enc-dec attn) · int8",
        "Terraformer dense · float32",  # the Terraformer rows' own baseline
        "Terraformer Sparse FF+QKV · float32",
        "Terraformer Sparse FF+QKV · bfloat16",
        "Terraformer Sparse FF+QKV · int8",
    ]
    assert picked.dense_row == 0 and picked.block_mode == config.block_mode and picked.repeats == config.repeats
    assert len(config.rows) == 12  # the preset itself is unchanged
    moved = presets.quantized_800m()
    moved.dense_row = 2  # dense int8 as the reference: it stays the reference after the selection
    assert presets.select_rows(moved, ["fully sparse · int8"]).dense_row == 0
    assert presets.select_rows(moved, []) is moved
    with pytest.raises(ValueError, match="no row's name contains any of"):
        presets.select_rows(moved, ["nosuch"])


# --- batched decoding (--config.batch_sizes, the batched_800m preset) -----------------------------


@pytest.mark.slow
def test_batched_rows_report_per_sequence_time_and_the_union_of_selected_rows(tmp_path):
    config = presets.tiny()
    sparse = next(row for row in config.rows if row.name == "+ Sparse FF")
    # One row at two batch sizes (speed-ups within a batch size have their own test below).
    config.rows, config.dense_row, config.batch_sizes = [sparse], 0, (1, 3)
    config.tokens, config.warmup, config.repeats, config.bandwidth_buffer_mb = 4, 1, 2, 16
    rows = decode_speed.run_preset(config, str(tmp_path), "batched", log=lambda *a: None)
    saved = json.loads((tmp_path / "decode_speed.json").read_text())
    assert [(r["name"], r["batch_size"]) for r in saved] == [("+ Sparse FF", 1), ("+ Sparse FF", 3)]
    one, three = rows
    for r in rows:
        step = r["seconds_per_token_loop"]
        assert r["seconds_per_step_loop"] == step and r["seconds_per_token_median"] > 0  # per call, B rows
        if step is None:  # lost in a tiny loop's jitter: no rate either, never a number
            assert r["seconds_per_sequence_loop"] is None and r["tokens_per_second"] is None
        else:
            assert r["seconds_per_sequence_loop"] == pytest.approx(step / r["batch_size"])
            assert r["tokens_per_second"] == pytest.approx(r["batch_size"] / step)
        assert r["floor_seconds"] == pytest.approx(r["bytes_per_token"] / (r["bandwidth_gbps"] * 1e9))
    # Three sequences read the union of the W1/W2 rows they select (more than one sequence's, less
    # than three times), and each its own caches (three times, less the counters they share).
    assert one["weight_bytes_per_token"] < three["weight_bytes_per_token"] < 3 * one["weight_bytes_per_token"]
    assert 2.9 * one["cache_bytes_per_token"] < three["cache_bytes_per_token"] <= 3 * one["cache_bytes_per_token"]
    assert three["flops_per_token"] > 2 * one["flops_per_token"]  # the step lowered at three rows
    table = (tmp_path / "decode_speed.md").read_text()
    assert "| row | batch | per call | in loop | per sequence | tokens/s |" in table and "| + Sparse FF | 3 |" in table
    assert is_png(str(tmp_path / "decode_speed.png"))


def test_batch_sizes_are_refused_beside_input_lengths_the_baseline_beside_and_block_differences():
    for preset, field, value in (
        (presets.long_document, "input_lengths", (16,)),
        (presets.quantized_800m, "baseline_beside", True),
        (presets.paper_17b_block, "block_mode", "difference"),
    ):
        config = preset()
        config.batch_sizes, config[field] = (1, 4), value
        # Refused before anything is measured or built.
        with pytest.raises(ValueError, match=f"batch_sizes .* cannot be combined with {field}"):
            decode_speed.run_preset(config, None, "refused", log=lambda line: None)
    config = presets.tiny()
    config.batch_sizes = (0,)
    with pytest.raises(ValueError, match="at least 1"):
        decode_speed.run_preset(config, None, "refused", log=lambda line: None)
    assert decode_speed.check_batch_sizes(presets.batched_800m()) == [1, 4, 16, 64]
    assert decode_speed.check_batch_sizes(presets.tiny()) == []  # batch 1, as every other preset


def test_batched_speedups_and_table_compare_rows_at_the_same_batch_size():
    rows = []
    for name, steps in (("dense", (0.040, 0.080)), ("sparse", (0.010, 0.040))):
        for batch, step in zip((1, 4), steps):
            r = _row(name, step, step)
            r.update(batch_size=batch, batched=True, floor_seconds=step / 2)
            r.update(decode_speed.batched_fields(r))
            r.update(weight_bytes_per_token=1e6, cache_bytes_per_token=1e5, seconds_per_token_min=step)
            rows.append(r)
    report.add_speedups(rows, dense_row=0)
    # Within each batch size, step against step: 4x at batch 1, 2x at batch 4 (not 1x against dense at 1).
    assert [r["speedup_vs_dense_loop"] for r in rows] == pytest.approx([1.0, 1.0, 4.0, 2.0])
    assert rows[3]["speedup_reference"] == "dense" and rows[3]["tokens_per_second"] == pytest.approx(100.0)
    machine = {"cpu": "x", "cores": 2, "xla_threads": 2, "bandwidth_after_gbps": 1.0, "product_gflops": 1.0}
    machine.update(jax="0", backend="cpu")
    table = report.markdown_table(rows, machine, 1.0, "t")
    assert "| sparse | 4 | 40.00 ms | 40.00 ms | 10.000 ms | 100 | 1.0 | 0.1 | 20.00 ms | 2.00 | 2.00x |" in table


def test_a_sparse_layer_reads_the_expected_union_of_the_rows_a_batch_selects():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from terra.layers.mixture_of_experts import MixtureOfExpertsFeedForward
    from terra.layers.sparse_feedforward import SparseFeedForward

    x = jnp.ones((1, 1, 32))
    ff = SparseFeedForward(d_model=32, d_ff=128, ff_sparsity=8)  # 16 blocks of N = 8 rows
    params = nn.unbox(jax.eval_shape(ff.init, jax.random.key(0), x))["params"]
    old = SparseFeedForward.params_read_per_token(params)  # batch 1: one row of W1 and W2 per block
    assert SparseFeedForward.params_read_per_token(params, batch=1) == old
    for batch in (2, 3, 64):
        union = 8 * (1 - (1 - 1 / 8) ** batch)  # distinct rows of a block among `batch` uniform choices
        assert SparseFeedForward.params_read_per_token(params, batch=batch) == round(old + 2 * 16 * (union - 1) * 32)
    moe = MixtureOfExpertsFeedForward(d_model=32, d_ff=128, n_experts=4)
    params = nn.unbox(jax.eval_shape(moe.init, jax.random.key(0), x))["params"]
    old = MixtureOfExpertsFeedForward.params_read_per_token(params)
    assert old == 4 * 32 + 2 * 32 * 32 + 32  # the router, one expert's W1 and W2 blocks, the bias
    experts = 4 * (1 - (3 / 4) ** 5)
    assert MixtureOfExpertsFeedForward.params_read_per_token(params, batch=5) == round(
        old + 2 * (experts - 1) * 32 * 32
    )


def test_a_dense_models_batched_step_reads_each_weight_once_and_each_sequences_token_row(dense_decode):
    model, decoder, (d, *_) = dense_decode
    one = model.params_read_per_token()
    assert model.params_read_per_token(batch=1) == one
    assert model.params_read_per_token(batch=4)["total"] == one["total"] + 3 * d  # three more embedding rows


def test_a_tables_cpu_line_names_the_vector_extensions_and_the_kernels_instruction_set():
    from terra.benchmarks import bandwidth

    flags = "fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni amx_tile amx_int8"
    assert bandwidth.vector_extensions(flags) == "avx2+avx512f+avx512_vnni+amx_int8"
    assert bandwidth.vector_extensions("fpu sse2") == ""
    machine = bandwidth.describe_machine()
    assert {"isa", "native_kernels"} <= set(machine)
    stored = {"cpu": "AMD EPYC", "cores": 2, "xla_threads": 2}  # a run stored before the ISA was recorded
    assert report.cpu_description(stored) == "AMD EPYC (2 cores, XLA threads 2)"
    stored.update(isa="avx2", native_kernels="avx2")
    assert report.cpu_description(stored) == "AMD EPYC (2 cores, avx2, native kernels avx2, XLA threads 2)"
