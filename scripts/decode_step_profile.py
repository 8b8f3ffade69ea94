"""Where a decode step's time goes: profiles the jitted generation loop of one model at each batch
size and sums the traced time of each kind of operation per step (a native kernel by its FFI
target, an XLA fusion by its kind and backend, a copy, ...), beside the untraced in-loop step.

  python scripts/decode_step_profile.py --gin_file=models/fully_sparse_800m.gin --weights=int8 \\
      --batch_sizes=1,16

The model is built as ``terra-bench decode`` builds it (random weights stored as ``--weights``,
the 2+24-layer timing shape unless ``--bindings`` says otherwise, a 32-slot decoder cache, inputs
of 16 tokens). XLA:CPU runs independent operations at once (at larger batches a fusion beside a
native kernel), so the kinds' sums can exceed the step: each is the time that kind of operation
ran, not its share of the step. Reads the trace with TensorFlow's XPlane protocol buffer.
"""

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
from typing import Dict, Tuple

# Operations whose traced time contains other operations' (a loop's body, a called computation).
CONTAINERS = ("while", "conditional", "call")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?\b([a-z][a-z\-]*)\(")


def operation_kinds(hlo_text: str) -> Dict[str, str]:
    """``{instruction name: kind}`` for an optimized HLO module's text: a custom call's target
    (``terra_sparse_feed_forward_int8``), a fusion's kind with its backend's fusion kind where it has
    one (``fusion kLoop``, ``fusion kCustom __ynn_fusion``), else the opcode (``copy``)."""
    kinds = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, opcode = match.groups()
        if opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            kinds[name] = target.group(1) if target else opcode
        elif opcode == "fusion":
            kind = re.search(r"kind=(k\w+)", line)
            backend = re.search(r'"fusion_config":\{"kind":"([^"]+)"', line)
            kinds[name] = " ".join(["fusion"] + [m.group(1) for m in (kind, backend) if m])
        else:
            kinds[name] = opcode
    return kinds


def traced_kinds(xplane_path: str, kinds: Dict[str, str], steps: int) -> Dict[str, Tuple[float, float]]:
    """``{kind: (milliseconds per step, operations per step)}`` from a trace's events named as
    ``kinds``' instructions (the executor's; Python's and containers' events are left out)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(xplane_path, "rb") as f:
        space.ParseFromString(f.read())
    milliseconds, counts = collections.Counter(), collections.Counter()
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                kind = kinds.get(names.get(event.metadata_id, ""))
                if kind is None or kind in CONTAINERS:
                    continue
                milliseconds[kind] += event.duration_ps / 1e9
                counts[kind] += 1
    return {kind: (milliseconds[kind] / steps, counts[kind] / steps) for kind in milliseconds}


def profile(decoder, params, inputs, steps: int = 12, repeats: int = 5):
    """``(untraced in-loop seconds per step, traced_kinds of one loop of `steps` steps)``. The step
    is the difference of two loops' times; where it is lost in their jitter (a tiny model) it is
    ``None``, never a number (as ``terra-bench decode``'s in-loop column)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from terra.benchmarks import decode_speed

    loop = decode_speed.generation_loop(decoder, params, inputs)
    loop(2)
    step = float(np.median([(loop(steps + 2) - loop(2)) / steps for _ in range(repeats)]))
    step = step if step > 0 else None
    batch = inputs.shape[0]
    cache = jax.eval_shape(decoder.prefill, params, jnp.asarray(inputs, jnp.int32))
    scalars = (jnp.int32(steps), jnp.float32(0.0), jnp.int32(-1), jnp.int32(0), jnp.int32(0), jnp.float32(1.0))
    start = jax.ShapeDtypeStruct((batch,), jnp.int32)
    lowered = decoder._generate_tokens_jit.lower(params, cache, start, jax.random.key(0), *scalars)
    kinds = operation_kinds(lowered.compile().as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            loop(steps)
        (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        return step, traced_kinds(path, kinds, steps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gin_file", default="models/fully_sparse_800m.gin")
    parser.add_argument("--weights", default="int8", choices=("float32", "bfloat16", "int8"))
    parser.add_argument("--batch_sizes", default="1,16")
    parser.add_argument("--bindings", action="append", help="gin bindings (default: the 2+24-layer timing shape)")
    parser.add_argument("--top", type=int, default=12, help="kinds listed per batch size")
    args = parser.parse_args(argv)

    import numpy as np

    from terra.benchmarks import decode_speed, presets
    from terra.benchmarks.bandwidth import describe_machine
    from terra.decoding.decode_step import IncrementalDecoder
    from terra.gin_config import parsing

    bindings = list(presets.TIMING_SHAPE_800M) if args.bindings is None else args.bindings
    model = parsing.parse_model([args.gin_file], bindings)
    decoder = IncrementalDecoder(model.module, 32)
    params = decode_speed.random_params(model, 0, args.weights)
    machine = describe_machine()
    print(
        f"{args.gin_file}, {args.weights} weights: {machine['cpu']} ({machine['cores']} cores, {machine['isa']}, "
        f"native kernels {machine['native_kernels']})"
    )
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        inputs = np.random.default_rng(0).integers(2, model.config.vocab_size, size=(batch, 16))
        step, kinds = profile(decoder, params, inputs)
        untraced = f"{step * 1e3:.2f} ms" if step is not None else "lost in the loop's jitter"
        print(f"\nbatch {batch}: in-loop step {untraced} untraced; traced per step:")
        print("| operation | ms per step | per step |\n|---|---|---|")
        for kind, (ms, count) in sorted(kinds.items(), key=lambda item: -item[1][0])[: args.top]:
            print(f"| {kind} | {ms:.3f} | {count:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
