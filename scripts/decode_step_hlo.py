"""Writes the optimized HLO of each tiny model's decode step and prefill, one file per variant, and
compares a tree's programs with stored ones: a refactor of the decode path that should change no
computation (docs/contributing.md, "Refactoring the decode path") shows it changed none.

  python scripts/decode_step_hlo.py --out out/hlo_before          # before the change
  python scripts/decode_step_hlo.py --out out/hlo_after --compare out/hlo_before

The variants are the tiny configs of every decode family (dense, fully sparse with float32,
bfloat16 and int8 weights and float32 or int8 caches, MoE, Terraformer, Terraformer-LSH), built with
XLA's optimizations on (as terra-bench decode compiles them) and batch 2, on this machine's native
kernels. Source locations and metadata are stripped, so only the computation is compared.

The programs take and return the cache as a flat dictionary keyed by each array's path with the
cache's own field names normalised (``CACHE_NAMES``), so a change to how the cache is grouped or
named, which reorders and renames the compiled program's arguments, compares as the same program
when it computes the same.
"""

import argparse
import hashlib
import os
import re
import sys

import jax

VARIANTS = {
    "dense": ("models/tiny.gin", "float32", "float32"),
    "fully_sparse_f32": ("models/tiny_fully_sparse.gin", "float32", "float32"),
    "fully_sparse_bf16": ("models/tiny_fully_sparse.gin", "bfloat16", "float32"),
    "fully_sparse_int8": ("models/tiny_fully_sparse.gin", "int8", "float32"),
    "fully_sparse_f32_int8_cache": ("models/tiny_fully_sparse.gin", "float32", "int8"),
    "fully_sparse_int8_int8_cache": ("models/tiny_fully_sparse.gin", "int8", "int8"),
    "fully_sparse_bf16_bf16_cache": ("models/tiny_fully_sparse.gin", "bfloat16", "bfloat16"),
    "moe": ("models/tiny_moe_ff.gin", "float32", "float32"),
    "terraformer": ("models/tiny_terraformer.gin", "float32", "float32"),
    "terraformer_int8_int8_cache": ("models/tiny_terraformer.gin", "int8", "int8"),
    "terraformer_lsh": ("models/tiny_terraformer_lsh.gin", "float32", "float32"),
    "terraformer_lsh_int8_int8_cache": ("models/tiny_terraformer_lsh.gin", "int8", "int8"),
}
BATCH, INPUT_LENGTH, DECODE_LENGTH = 2, 12, 8
# A cache array's name, by its own name or field, and the names of the groups that hold them.
CACHE_NAMES = {
    "conv_rows": "rows",
    "position": "index",
    "cache_index": "index",
    "cached_key": "key",
    "cached_value": "value",
    "cached_key_scale": "key_scale",
    "cached_value_scale": "value_scale",
    "encoder_bias": "bias",
    "cached_buckets": "buckets",
}
CACHE_GROUPS = {"kv", "lsh", "conv_rows", "position", "carry"}


def _name(path) -> str:
    parts = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    parts = [p for p in parts[:-1] if p not in CACHE_GROUPS] + parts[-1:]
    return "/".join(parts[:-1] + [CACHE_NAMES.get(parts[-1], parts[-1])])


def flat(cache) -> dict:
    """``{normalised path: array}`` of a cache tree."""
    pairs = jax.tree_util.tree_flatten_with_path(cache)[0]
    named = {_name(path): leaf for path, leaf in pairs}
    assert len(named) == len(pairs), "two cache arrays normalise to one name"
    return named


def nested(named: dict, like):
    """The cache tree ``like`` (its structure) from ``flat(like)``-keyed arrays."""
    pairs, structure = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree.unflatten(structure, [named[_name(path)] for path, _ in pairs])


def _canonical(text: str) -> str:
    """The HLO text less what does not compute: metadata, source locations (the tables of file
    and function names and stack frames, and each instruction's frame), the module's name."""
    text = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(\d+ .*\n)*", "\n", text)
    text = re.sub(r",?\s*metadata=\{[^}]*\}", "", text)
    text = re.sub(r",?\s*stack_frame_id=\d+", "", text)
    # Names are the tracer's (its numbering follows trace order): each is renamed by its first
    # appearance, which keeps every operation, shape and edge.
    text = re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)
    names = {}
    rename = lambda m: names.setdefault(m.group(1), f"v{len(names)}")  # noqa: E731
    return re.sub(r"(?<![\w.])%?([A-Za-z_][\w\-]*(?:\.\d+)+)(?![\w])", rename, text)


def programs(name: str):
    """``{"prefill": hlo, "step": hlo}`` for one variant."""
    import jax.numpy as jnp

    from terra.gin_config import parsing
    from terra.quantization import quantize_params

    gin_file, weights_dtype, cache_dtype = VARIANTS[name]
    bindings = [f"TransformerConfig.cache_dtype = '{cache_dtype}'"] if cache_dtype != "float32" else []
    parsing.parse_gin([gin_file], bindings, finalize=False)
    model = parsing.build_model()
    params = quantize_params(model.init_params(jax.random.key(0)), weights_dtype)
    decoder = model.decoder(DECODE_LENGTH)
    tokens = jnp.ones((BATCH, INPUT_LENGTH), jnp.int32)
    like = jax.eval_shape(decoder.prefill_fn, params, tokens)

    def prefill(params, tokens):
        return flat(decoder.prefill_fn(params, tokens))

    def step(params, cache, token):
        logits, cache = decoder.step_fn(params, nested(cache, like), token)
        return logits, flat(cache)

    prefill = jax.jit(prefill).lower(params, tokens).compile()
    token = jnp.zeros((BATCH,), jnp.int32)
    step = jax.jit(step, donate_argnums=(1,)).lower(params, flat(like), token).compile()
    return {"prefill": _canonical(prefill.as_text()), "step": _canonical(step.as_text())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for <variant>.<program>.hlo")
    parser.add_argument("--compare", help="a folder this script wrote before: report every difference")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args(argv)
    jax.config.update("jax_disable_most_optimizations", False)  # as terra-bench decode compiles
    os.makedirs(args.out, exist_ok=True)
    differ = []
    for name in args.variants:
        for program, text in programs(name).items():
            path = os.path.join(args.out, f"{name}.{program}.hlo")
            with open(path, "w") as f:
                f.write(text)
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            verdict = ""
            if args.compare:
                with open(os.path.join(args.compare, os.path.basename(path))) as f:
                    same = _canonical(f.read()) == text  # canonical again: stays comparable as _canonical changes
                verdict = "identical" if same else "DIFFERS"
                if not same:
                    differ.append(path)
            print(f"{name:<34} {program:<8} {digest}  {verdict}", flush=True)
    if differ:
        print(f"{len(differ)} programs differ: diff them against {args.compare}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
