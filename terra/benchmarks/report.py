"""Decode-speed results as the paper's table (Markdown), JSON rows and a PNG plot."""

import json
import os
from typing import List, Sequence


def _millions(n: int) -> str:
    return f"{n / 1e6:,.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def timing_keys(per_block: bool):
    """The row fields a table compares: ``(step time, in-loop time)`` per decoder block in the
    'difference' block mode, per token otherwise."""
    if per_block:
        return "seconds_per_block", "seconds_per_block_loop"
    return "seconds_per_token_median", "seconds_per_token_loop"


def markdown_table(rows: Sequence[dict], machine: dict, bandwidth_gbps: float, title: str) -> str:
    block_mode = bool(rows) and rows[0].get("block_mode") == "difference"
    lines = [
        f"### {title}",
        "",
        f"CPU: {machine['cpu']} ({machine['cores']} cores, XLA threads {machine['xla_threads']}); "
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
        + " Dec. time is one jitted `step` call per token (the reference's protocol); in loop is the "
        "same step inside one jitted `while_loop`, as generation runs it.",
        "",
        f"| model | Params | Dec. time | Dec. time per block | Speedup | in loop | Speedup in loop "
        f"| MB / {'block' if block_mode else 'token'} | GB/s | % of bandwidth | floor | MFLOP | arith. |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    _, loop_key = timing_keys(block_mode)
    for r in rows:
        lines.append(
            f"| {r['name']} | {_millions(r['params'])} | {r['seconds_per_token_median'] * 1e3:.2f} ms "
            f"(min {r['seconds_per_token_min'] * 1e3:.2f}) | {r['seconds_per_block'] * 1e3:.3f} ms | "
            f"{r['speedup_vs_dense']:.2f}x | {r[loop_key] * 1e3:.3f} ms | {r['speedup_vs_dense_loop']:.2f}x | "
            f"{r.get('bytes_per_block', r['bytes_per_token']) / 1e6:,.1f} | {r['achieved_gbps']:.1f} | "
            f"{100 * r['fraction_of_bandwidth']:.0f}% | {r['floor_seconds'] * 1e3:.2f} ms | "
            f"{r.get('flops_per_block', r['flops_per_token']) / 1e6:,.1f} | {r['arithmetic_seconds'] * 1e3:.2f} ms |"
        )
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(rows: Sequence[dict], path: str, title: str) -> None:
    plt = pyplot()

    series = sorted({r["series"] for r in rows if r.get("series")})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if len(series) and all(r.get("series") for r in rows):
        for name in series:
            points = sorted((r["sparsity"], r["seconds_per_token_median"] * 1e3) for r in rows if r["series"] == name)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xlabel("sparsity (FF: N units per block, 0 = dense; loss: S modules, 1 = dense)")
        ax.set_ylabel("ms per token (median)")
        ax.legend()
    else:
        names = [r["name"] for r in rows]
        per_block = rows[0].get("block_mode") == "difference"
        step_key, loop_key = timing_keys(per_block)
        floors = [r["floor_seconds"] * 1e3 for r in rows]
        y = list(range(len(rows)))
        ax.barh(y, [r[step_key] * 1e3 for r in rows], color="tab:blue", label="measured (a step call per token)")
        ax.scatter(
            [r[loop_key] * 1e3 for r in rows], y, color="black", marker="o", s=18, label="in one while_loop", zorder=3
        )
        ax.scatter(floors, y, color="tab:red", marker="|", s=300, label="bandwidth floor", zorder=3)
        with_arithmetic = [f + r["arithmetic_seconds"] * 1e3 for f, r in zip(floors, rows)]
        ax.scatter(
            with_arithmetic, y, color="tab:orange", marker="|", s=300, label="floor + arithmetic (no overlap)", zorder=3
        )
        ax.set_yticks(y, names, fontsize=8)
        ax.invert_yaxis()
        unit = "ms per decoder block" if per_block else "ms per token"
        ax.set_xlabel(f"{unit} (batch 1)")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out_dir: str, rows: List[dict], machine: dict, bandwidth_gbps: float, title: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode_speed.json"), "w") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(out_dir, "machine.json"), "w") as f:
        json.dump({**machine, "bandwidth_gbps": bandwidth_gbps}, f, indent=2)
    table = markdown_table(rows, machine, bandwidth_gbps, title)
    with open(os.path.join(out_dir, "decode_speed.md"), "w") as f:
        f.write(table)
    plot(rows, os.path.join(out_dir, "decode_speed.png"), title)
    return table


def write_rows(out_dir: str, stem: str, rows: List[dict], note: str, table: str) -> None:
    """``<stem>.json`` (rows and note) and ``<stem>.md`` (the table) in ``out_dir``, and the table
    on standard output: the outputs of the throughput benchmarks."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump({"rows": rows, "note": note}, f, indent=2)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(table)
    print(table)
