"""Decode-speed results as the paper's table (Markdown), JSON rows and a PNG plot.

Each row's speed-up is against its ``baseline`` row (the preset's dense row unless the row
names another), in the table and in the plot: a plot has one panel per baseline. The paper's
seconds, where the paper has a figure for the row, appear beside ours as a speed-up (the paper's
CPU is not this one, so only ratios compare). An in-loop time the generation loop's jitter hid
(``None``) is shown as such, never as a number.

Rows timed at several input lengths (``long_document``, ``--config.input_lengths``) have their own
table (row, input length, prefill, in-loop ms per token, weights and caches MB per token, the
floor, peak memory), speed-ups within each length and a plot against the length; a row that was
``skipped`` shows its reason in the table and is left out of the plot.

Rows timed at several batch sizes (``batched_800m``, ``--config.batch_sizes``) have theirs too
(row, batch size, per-call and in-loop ms per step, ms per sequence, tokens per second, weights
and caches MB per step, the floor, in loop over the floor), speed-ups within each batch size and
a plot of ms per sequence against the batch size.
"""

import json
import math
import os
from typing import Dict, List, Optional, Sequence


def _millions(n: int) -> str:
    return f"{n / 1e6:,.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def milliseconds(seconds: Optional[float], digits: int = 3) -> str:
    """``12.345 ms``, or ``—`` for a time lost in noise."""
    return "—" if seconds is None else f"{seconds * 1e3:.{digits}f} ms"


def timing_keys(per_block: bool):
    """The row fields a table compares: ``(step time, in-loop time)`` per decoder block in the
    'difference' block mode, per token otherwise."""
    if per_block:
        return "seconds_per_block", "seconds_per_block_loop"
    return "seconds_per_token_median", "seconds_per_token_loop"


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    if not numerator or not denominator:
        return None
    return numerator / denominator


def is_long_document(rows: Sequence[dict]) -> bool:
    """Whether ``rows`` were timed at several input lengths (``long_document``)."""
    return any(r.get("long_document") for r in rows)


def is_batched(rows: Sequence[dict]) -> bool:
    """Whether ``rows`` were timed at several batch sizes (``--config.batch_sizes``)."""
    return any(r.get("batched") for r in rows)


def add_speedups(rows: List[dict], dense_row: int = 0) -> None:
    """Sets each row's ``speedup_reference`` (its ``baseline`` row's name, else row
    ``dense_row``'s), ``speedup_vs_dense`` and ``speedup_vs_dense_loop`` (the reference's time
    over the row's; None where either in-loop time is None), ``speedup_vs_dense_loop_beside``
    (against the dense row's loop timed right after the row's own, ``baseline_beside``; None
    where it was not), ``loop_over_floor_and_arithmetic`` (the in-loop time over floor plus
    arith.) and ``paper_speedup`` (the same ratio of the paper's seconds, where the paper has
    both). Rows timed at several input lengths are compared within each length, rows timed at
    several batch sizes within each batch size, step against step (``dense_row`` indexes the
    rows of one length or size); a skipped row's ratios are None."""
    grouped_by = "input_length" if is_long_document(rows) else "batch_size" if is_batched(rows) else None
    if grouped_by:
        groups: Dict[int, List[dict]] = {}
        for r in rows:
            groups.setdefault(r.get(grouped_by), []).append(r)
        for group in groups.values():
            _add_speedups(group, dense_row if dense_row < len(group) else 0)
        return
    _add_speedups(rows, dense_row)


def _add_speedups(rows: List[dict], dense_row: int) -> None:
    by_name = {r["name"]: r for r in rows}
    default = rows[dense_row]["name"] if rows else ""
    key, loop_key = timing_keys(bool(rows) and rows[0].get("block_mode") == "difference")
    for r in rows:
        reference = by_name.get(r.get("baseline") or default, by_name.get(default, {}))
        r["speedup_reference"] = reference.get("name", default)
        r["speedup_vs_dense"] = _ratio(reference.get(key), r.get(key))
        r["speedup_vs_dense_loop"] = _ratio(reference.get(loop_key), r.get(loop_key))
        # The dense row's loop timed in the same minutes as this row's (baseline_beside).
        beside = r.get("dense_loop_beside_seconds") if r["speedup_reference"] == default else None
        r["speedup_vs_dense_loop_beside"] = _ratio(beside, r.get(loop_key))
        # How far the generation loop is from what the step's bytes and arithmetic need at the
        # least: 1.0 would overlap nothing and still reach the floor (docs/decode_speed.md sets
        # 1.5 as the quantized rows' target).
        floor_and_arithmetic = r.get("floor_seconds", 0.0) + r.get("arithmetic_seconds", 0.0)
        r["loop_over_floor_and_arithmetic"] = _ratio(r.get(loop_key), floor_and_arithmetic)
        r["paper_speedup"] = _ratio(reference.get("paper_seconds"), r.get("paper_seconds"))


def _ratio_cell(value: Optional[float], unit: str = "x") -> str:
    return "—" if value is None else f"{value:.2f}{unit}"


def _paper(row: dict) -> str:
    if not row.get("paper_seconds"):
        return "—"
    ratio = f" ({row['paper_speedup']:.2f}x)" if row.get("paper_speedup") else ""
    return f"{row['paper_seconds']:.3f} s{ratio}"


def cpu_description(machine: dict) -> str:
    """``AMD EPYC (2 cores, avx2, native kernels avx2, XLA threads 2)``: the CPU a table's figures
    come from and the instruction sets they ran with (runs stored before the machine recorded
    them omit them)."""
    parts = [f"{machine['cores']} cores"]
    if machine.get("isa"):
        parts.append(machine["isa"])
    if machine.get("native_kernels"):
        parts.append(f"native kernels {machine['native_kernels']}")
    parts.append(f"XLA threads {machine['xla_threads']}")
    return f"{machine['cpu']} ({', '.join(parts)})"


def _header(machine: dict, bandwidth_gbps: float, title: str) -> List[str]:
    return [
        f"### {title}",
        "",
        f"CPU: {cpu_description(machine)}; "
        f"measured read bandwidth {bandwidth_gbps:.1f} GB/s before the rows, "
        f"{machine['bandwidth_after_gbps']:.1f} GB/s after; small products {machine['product_gflops']:.0f} GFLOP/s"
        f"; jax {machine['jax']} ({machine['backend']}).",
    ]


def _megabytes(n: Optional[float]) -> str:
    return "—" if n is None else f"{n / 1e6:,.1f}"


def long_document_table(rows: Sequence[dict], machine: dict, bandwidth_gbps: float, title: str) -> str:
    """The table of rows timed at several input lengths: row, input length, prefill seconds,
    in-loop ms per token, weights and caches MB read per token, the floor they set at the
    bandwidth measured before the rows (total, and weights + caches), peak resident GB. A
    skipped row shows its reason."""
    lines = _header(machine, bandwidth_gbps, title) + [
        "",
        "Each row at each input length: the prefill of the input (median), then greedy decoding "
        "inside one jitted `while_loop` (in loop: per token, the loop over all the tokens minus the "
        "loop over the first few). MB per token: the weights the step reads, and the caches it reads "
        "(an LSH layer only its kept rows and bucket bookkeeping; narrow caches at their itemsize); "
        "floor: those bytes at the measured bandwidth, weights + caches. Peak: the process's peak "
        "resident memory over the row; added: the peak less the process's resident memory as the row "
        "started (its libraries, earlier rows' programs), and that as a multiple of the row's stored "
        "weights plus filled caches.",
        "",
        "| row | input length | prefill | in loop | weights MB / token | caches MB / token | floor "
        "(weights + caches) | peak GB | added GB (x weights + caches) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['name']} | {r['input_length']:,} | skipped: {r['skipped']} | — | — | — | — | — | — |")
            continue
        peak = r.get("peak_resident_bytes")
        added = "—"
        if peak is not None and r.get("resident_before_bytes") is not None:
            grown = peak - r["resident_before_bytes"]
            held = r.get("params_and_caches_bytes")
            added = f"{grown / 1e9:.2f}" + (f" ({grown / held:.2f}x)" if held else "")
        floor = (
            f"{r['floor_seconds'] * 1e3:.2f} ms ({r.get('weight_floor_seconds', 0) * 1e3:.2f} + "
            f"{r.get('cache_floor_seconds', 0) * 1e3:.2f})"
        )
        lines.append(
            f"| {r['name']} | {r['input_length']:,} | {r['prefill_seconds']:.3f} s | "
            f"{milliseconds(r.get('seconds_per_token_loop'), 2)} | {_megabytes(r.get('weight_bytes_per_token'))} | "
            f"{_megabytes(r.get('cache_bytes_per_token'))} | {floor} | "
            f"{'—' if peak is None else f'{peak / 1e9:.2f}'} | {added} |"
        )
    sources = sorted({r["peak_resident_source"] for r in rows if r.get("peak_resident_source")})
    if sources:
        lines += ["", f"Peak: {'; '.join(sources)}."]
    if any(not r.get("skipped") and r.get("seconds_per_token_loop") is None for r in rows):
        lines += ["", "In loop —: the generation loop's jitter was larger than the time it measures."]
    return "\n".join(lines) + "\n"


def batched_table(rows: Sequence[dict], machine: dict, bandwidth_gbps: float, title: str) -> str:
    """The table of rows timed at several batch sizes B: row, B, the step of B sequences per
    jitted call and in the loop, the loop's step per sequence, tokens per second, weights and
    caches MB one step reads, their floor at the bandwidth measured before the rows, in loop
    over the floor, and the in-loop speed-up against the reference row at the same B."""
    references = sorted({r["speedup_reference"] for r in rows if r.get("speedup_reference")})
    lines = _header(machine, bandwidth_gbps, title) + [
        "",
        f"Each row decoding B sequences at once. Per call: {per_call_phrase(rows)}, for the B sequences; in "
        "loop: the same step inside one jitted `while_loop` (the loop over all the tokens minus the "
        "loop over the first few); per sequence: in loop / B; tokens/s: B / in loop. MB per step: "
        "the weights one step reads (each once; of the rows a sparse layer selects per sequence, "
        "their expected union over the B sequences) and the caches (each sequence its own); floor: "
        "those bytes at the measured bandwidth. Speed-ups (in loop, per step) are against "
        + (" or ".join(references) if references else "the dense row")
        + " at the same batch size.",
        "",
        "| row | batch | per call | in loop | per sequence | tokens/s | weights MB / step | caches MB / step "
        "| floor | ÷ floor | speedup in loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rate = r.get("tokens_per_second")
        lines.append(
            f"| {r['name']} | {r['batch_size']} | {milliseconds(r.get('seconds_per_token_median'), 2)} | "
            f"{milliseconds(r.get('seconds_per_step_loop'), 2)} | {milliseconds(r.get('seconds_per_sequence_loop'))} | "
            f"{'—' if rate is None else f'{rate:,.0f}'} | {_megabytes(r.get('weight_bytes_per_token'))} | "
            f"{_megabytes(r.get('cache_bytes_per_token'))} | {r['floor_seconds'] * 1e3:.2f} ms | "
            f"{_ratio_cell(_ratio(r.get('seconds_per_step_loop'), r['floor_seconds']), unit='')} | "
            f"{_ratio_cell(r.get('speedup_vs_dense_loop'))} |"
        )
    if any(r.get("seconds_per_step_loop") is None for r in rows):
        lines += ["", "In loop —: the generation loop's jitter was larger than the time it measures."]
    return "\n".join(lines) + "\n"


def markdown_table(rows: Sequence[dict], machine: dict, bandwidth_gbps: float, title: str) -> str:
    if is_long_document(rows):
        return long_document_table(rows, machine, bandwidth_gbps, title)
    if is_batched(rows):
        return batched_table(rows, machine, bandwidth_gbps, title)
    block_mode = bool(rows) and rows[0].get("block_mode") == "difference"
    references = sorted({r["speedup_reference"] for r in rows})
    beside = any(r.get("speedup_vs_dense_loop_beside") is not None for r in rows)
    lines = [
        f"### {title}",
        "",
        f"CPU: {cpu_description(machine)}; "
        f"measured read bandwidth {bandwidth_gbps:.1f} GB/s before the rows, "
        f"{machine['bandwidth_after_gbps']:.1f} GB/s after; small products {machine['product_gflops']:.0f} GFLOP/s"
        f"; jax {machine['jax']} ({machine['backend']}). Floor = MB per token / bandwidth before; "
        "arith. = the step's FLOPs (XLA's count) at the small-product rate.",
        "",
        (
            "Slices of 1 and 2 decoder blocks are timed; Dec. time is the 2-block slice, per block is the "
            "difference, and MB, GB/s, % and floor are per block."
            if block_mode
            else "GB/s, % of bandwidth and floor are per token."
        )
        + f" Dec. time is {per_call_phrase(rows)}, the reference's protocol; in loop is the "
        "same step inside one jitted `while_loop`, as generation runs it. Speed-ups are against "
        + (" or ".join(references) if len(references) > 1 else references[0])
        + " (each row's own baseline); paper: the paper's seconds on its CPU, and its speed-up. "
        "÷ (floor + arith.): in loop over the floor plus the arithmetic, what a step that overlapped "
        "nothing would need."
        + (
            " Speedup beside: against the dense row's generation loop timed again right after each "
            "repetition of the row's own, the same minutes of the machine."
            if beside
            else ""
        ),
        "",
        "| model | Params | Dec. time | Dec. time per block | Speedup | in loop | Speedup in loop "
        + ("| Speedup beside " if beside else "")
        + f"| MB / {'block' if block_mode else 'token'} | GB/s | % of bandwidth | floor | MFLOP | arith. "
        "| ÷ (floor + arith.) | paper |",
        "|---|---|---|---|---|---|---|" + ("---|" if beside else "") + "---|---|---|---|---|---|---|---|",
    ]
    _, loop_key = timing_keys(block_mode)
    for r in rows:
        step = (
            "—"
            if r.get("seconds_per_token_median") is None
            else f"{r['seconds_per_token_median'] * 1e3:.2f} ms (min {r['seconds_per_token_min'] * 1e3:.2f})"
        )
        fraction = r.get("fraction_of_bandwidth")
        lines.append(
            f"| {r['name']} | {_millions(r['params'])} | {step} | {milliseconds(r.get('seconds_per_block'))} | "
            f"{_ratio_cell(r['speedup_vs_dense'])} | {milliseconds(r[loop_key])} | "
            f"{_ratio_cell(r['speedup_vs_dense_loop'])} | "
            + (f"{_ratio_cell(r.get('speedup_vs_dense_loop_beside'))} | " if beside else "")
            + f"{r.get('bytes_per_block', r['bytes_per_token']) / 1e6:,.1f} | "
            + ("— | — | " if fraction is None else f"{r['achieved_gbps']:.1f} | {100 * fraction:.0f}% | ")
            + f"{r['floor_seconds'] * 1e3:.2f} ms | "
            f"{r.get('flops_per_block', r['flops_per_token']) / 1e6:,.1f} | {r['arithmetic_seconds'] * 1e3:.2f} ms | "
            f"{_ratio_cell(r.get('loop_over_floor_and_arithmetic'), unit='')} | {_paper(r)} |"
        )
    if any(r[loop_key] is None for r in rows):
        lines += [
            "",
            "In loop —: the generation loop's jitter was larger than the time it measures; the row's step time stands.",
        ]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ms(value: Optional[float]) -> float:
    return math.nan if value is None else value * 1e3


SERIES_AXES = {
    "ff_sparsity": ("feed-forward sparsity N (units per block; paper Table 2)", "dense"),
    "loss_sparsity": ("loss sparsity S (modules; paper Table 7)", "dense"),
}


def per_call_phrase(rows: List[dict]) -> str:
    """How the rows' per-call times were taken: ``DecodeSession.step`` calls (the host picks each
    token of a running generation loop), or, in runs stored before rows said, jitted ``step``
    calls."""
    if any(r.get("per_call") == "DecodeSession.step" for r in rows):
        return "one `DecodeSession.step` call per token (the host picks each token of a running loop)"
    return "one jitted `step` call per token"


LEGEND = {
    "loop": "in the generation loop",
    "step": "one call per token",
    "floor": "byte floor (measured bandwidth)",
    "arith": "byte floor + arithmetic",
    "paper": "paper, its CPU (right axis, scaled to our dense point)",
}


def _plot_series(rows: Sequence[dict], title: str):
    """One panel per series (FF sparsity N, loss sparsity S): ms per token against sparsity,
    in the loop and per step call, with the byte floor and the floor plus arithmetic, and the
    paper's figures on a right axis scaled so its dense point sits on ours."""
    plt = pyplot()
    series = list(dict.fromkeys(r["series"] for r in rows))
    fig, axes = plt.subplots(1, len(series), figsize=(5.2 * len(series), 4.4), squeeze=False)
    handles = {}
    for ax, name in zip(axes[0], series):
        members = sorted((r for r in rows if r["series"] == name), key=lambda r: r["sparsity"])
        x = list(range(len(members)))
        xlabel, dense_label = SERIES_AXES.get(name, (name, "dense"))
        labels = [dense_label if r["sparsity"] in (0, 1) else f"{r['sparsity']:g}" for r in members]
        loop = [_ms(r["seconds_per_token_loop"]) for r in members]
        floor = [r["floor_seconds"] * 1e3 for r in members]
        handles["loop"] = ax.plot(x, loop, "o-", color="tab:blue", linewidth=2)[0]
        handles["step"] = ax.plot(x, [_ms(r["seconds_per_token_median"]) for r in members], "o:", color="grey")[0]
        handles["floor"] = ax.plot(x, floor, "--", color="tab:red")[0]
        with_arith = [f + r["arithmetic_seconds"] * 1e3 for f, r in zip(floor, members)]
        handles["arith"] = ax.plot(x, with_arith, "--", color="tab:orange")[0]
        ax.set_xticks(x, labels)
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.15 * max(v for v in loop + with_arith + floor if not math.isnan(v)))
        ax.grid(alpha=0.3)
        paper = [(i, r["paper_seconds"]) for i, r in enumerate(members) if r.get("paper_seconds")]
        ours_dense = loop[0] if not math.isnan(loop[0]) else _ms(members[0]["seconds_per_token_median"])
        if paper and members[0].get("paper_seconds"):
            twin = ax.twinx()
            scale = members[0]["paper_seconds"] / ours_dense  # paper seconds per our ms
            handles["paper"] = twin.plot(
                [i for i, _ in paper], [p for _, p in paper], "s", color="tab:green", markersize=7
            )[0]
            low, high = ax.get_ylim()
            twin.set_ylim(low * scale, high * scale)
            twin.set_ylabel("paper: seconds per token", color="tab:green")
    axes[0][0].set_ylabel("ms per token (batch 1)")
    order = [k for k in LEGEND if k in handles]
    fig.legend([handles[k] for k in order], [LEGEND[k] for k in order], loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def _plot_bars(rows: Sequence[dict], title: str):
    """One panel per baseline: the in-loop time of each row as a bar, the step-call time, the
    byte floor and the floor plus arithmetic as marks, and the speed-up (ours, the paper's)."""
    plt = pyplot()
    per_block = rows[0].get("block_mode") == "difference"
    step_key, loop_key = timing_keys(per_block)
    groups: Dict[str, List[dict]] = {}
    for r in rows:
        groups.setdefault(r["speedup_reference"], []).append(r)
    fig, axes = plt.subplots(
        len(groups),
        1,
        figsize=(9, 1.2 + 0.42 * len(rows) + 0.9 * len(groups)),
        squeeze=False,
        gridspec_kw={"height_ratios": [len(g) for g in groups.values()]},
    )
    unit = "ms per decoder block (batch 1)" if per_block else "ms per token (batch 1)"
    right = max(
        max(
            _ms(r[step_key]) if r[step_key] else 0,
            _ms(r[loop_key]) if r[loop_key] else 0,
            (r["floor_seconds"] + r["arithmetic_seconds"]) * 1e3,
        )
        for r in rows
    )
    handles = {}
    for ax, (reference, members) in zip(axes[:, 0], groups.items()):
        y = list(range(len(members)))
        handles["loop"] = ax.barh(y, [_ms(r[loop_key]) for r in members], color="tab:blue", height=0.6)
        handles["step"] = ax.scatter([_ms(r[step_key]) for r in members], y, color="black", s=16, zorder=3)
        floors = [r["floor_seconds"] * 1e3 for r in members]
        handles["floor"] = ax.scatter(floors, y, color="tab:red", marker="|", s=300, zorder=3)
        arith = [f + r["arithmetic_seconds"] * 1e3 for f, r in zip(floors, members)]
        handles["arith"] = ax.scatter(arith, y, color="tab:orange", marker="|", s=300, zorder=3)
        for i, r in enumerate(members):
            if r["speedup_vs_dense_loop"] is not None:
                text = f"{r['speedup_vs_dense_loop']:.1f}x"
            elif r["speedup_vs_dense"] is not None:  # an in-loop time lost in jitter: the step-call one
                text = f"{r['speedup_vs_dense']:.1f}x per step call (in loop: noise)"
            else:
                text = "in loop: noise"
            if r.get("paper_speedup") and r["name"] != reference:
                text += f"  (paper {r['paper_speedup']:.1f}x)"
            ax.text(right * 1.03, i, text, va="center", fontsize=8)
        notes = sorted({r["paper_note"] for r in members if r.get("paper_speedup") and r.get("paper_note")})
        ax.set_yticks(y, [r["name"] for r in members], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, right * 1.35)
        sources = f"; paper: {', '.join(notes)}" if notes else ""
        ax.set_title(f"speed-ups in the loop against {reference}{sources}", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel(unit)
    labels = {**LEGEND, "step": "one call per token", "loop": "in the generation loop (bar)"}
    order = ["loop", "step", "floor", "arith"]
    fig.legend([handles[k] for k in order], [labels[k] for k in order], loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def _plot_each_row(ax, rows: Sequence[dict], x_key: str, measured_ms, floor_ms) -> List[str]:
    """One colour per row name: its ``measured_ms(result)`` against ``result[x_key]`` (solid) and
    its ``floor_ms(result)`` (dashed). Returns the names, in the rows' order."""
    colours = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(r["name"] for r in rows))
    for i, name in enumerate(names):
        points = sorted((r for r in rows if r["name"] == name), key=lambda r: r[x_key])
        x = [r[x_key] for r in points]
        colour = colours[i % len(colours)]
        ax.plot(x, [measured_ms(r) for r in points], "o-", color=colour, label=name)
        ax.plot(x, [floor_ms(r) for r in points], "--", color=colour, alpha=0.6)
    return names


def _plot_lengths(rows: Sequence[dict], title: str):
    """Rows timed at several input lengths: the in-loop ms per token of each row against the
    input length (solid), with its byte floor (dashed, same colour); skipped rows are left out."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    measured = [r for r in rows if not r.get("skipped")]
    names = _plot_each_row(
        ax, measured, "input_length", lambda r: _ms(r.get("seconds_per_token_loop")), lambda r: r["floor_seconds"] * 1e3
    )
    ax.set_xscale("log")
    lengths = sorted({r["input_length"] for r in rows})
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
    ax.set_xlabel("input tokens (encoder)")
    ax.set_ylabel("ms per generated token in the loop (batch 1); dashed: byte floor")
    ax.grid(alpha=0.3)
    if names:
        ax.legend(fontsize=7, ncol=2)
    skipped = sum(1 for r in rows if r.get("skipped"))
    ax.set_title(title + (f" ({skipped} skipped, see the table)" if skipped else ""), fontsize=9)
    fig.tight_layout()
    return fig


def _plot_batches(rows: Sequence[dict], title: str):
    """Rows timed at several batch sizes: the in-loop ms per sequence of each row against the
    batch size (solid), with its floor per sequence (dashed, same colour), log-log."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    names = _plot_each_row(
        ax,
        rows,
        "batch_size",
        lambda r: _ms(r.get("seconds_per_sequence_loop")),
        lambda r: r["floor_seconds"] * 1e3 / r["batch_size"],
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    sizes = sorted({r["batch_size"] for r in rows})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.tick_params(axis="x", which="minor", labelbottom=False)  # only the sizes timed
    ax.set_xlabel("batch size (sequences decoded at once)")
    ax.set_ylabel("ms per sequence per step in the loop; dashed: byte floor / batch")
    ax.grid(alpha=0.3, which="both")
    if names:
        ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot(rows: Sequence[dict], path: str, title: str) -> None:
    """A sparsity sweep (rows with a ``series``) as curves, rows at several input lengths against
    the length, rows at several batch sizes against the size, anything else as bars per
    baseline."""
    plt = pyplot()
    if is_long_document(rows):
        fig = _plot_lengths(rows, title)
    elif is_batched(rows):
        fig = _plot_batches(rows, title)
    elif all(r.get("series") for r in rows):
        fig = _plot_series(rows, title)
    else:
        fig = _plot_bars(rows, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out_dir: str, rows: List[dict], machine: dict, bandwidth_gbps: float, title: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode_speed.json"), "w") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(out_dir, "machine.json"), "w") as f:
        json.dump({**machine, "bandwidth_gbps": bandwidth_gbps, "title": title}, f, indent=2)
    table = markdown_table(rows, machine, bandwidth_gbps, title)
    with open(os.path.join(out_dir, "decode_speed.md"), "w") as f:
        f.write(table)
    plot(rows, os.path.join(out_dir, "decode_speed.png"), title)
    return table


def rerender(out_dir: str, title: Optional[str] = None) -> str:
    """Writes ``decode_speed.{md,png}`` again from an earlier run's ``decode_speed.json`` and
    ``machine.json`` in ``out_dir`` (nothing is timed); returns the table."""
    with open(os.path.join(out_dir, "decode_speed.json")) as f:
        rows = json.load(f)
    with open(os.path.join(out_dir, "machine.json")) as f:
        machine = json.load(f)
    title = title or machine.get("title") or os.path.basename(os.path.normpath(out_dir))
    add_speedups(rows)
    return write_outputs(out_dir, rows, machine, machine["bandwidth_gbps"], title)


def write_rows(out_dir: str, stem: str, rows: List[dict], note: str, table: str) -> None:
    """``<stem>.json`` (rows and note) and ``<stem>.md`` (the table) in ``out_dir``, and the table
    on standard output: the outputs of the throughput benchmarks."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump({"rows": rows, "note": note}, f, indent=2)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(table)
    print(table)
