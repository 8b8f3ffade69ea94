"""Parameter counts and the weights one decoded token reads, from abstract shapes.

Nothing is allocated (``jax.eval_shape``). "Read per token" is what a batch-1 decode step must
stream from memory (``Model.params_read_per_token``): the decoder's weights, minus what the
injected layers skip (sparse feed-forward reads one row per block, encoder-decoder keys/values
are cached), plus one embedding row and one positional row. ``terra-params`` prints them.
"""

from typing import Dict, List, Sequence

from terra.gin_config import parsing
from terra.models.param_count import closed_form_param_count


def model_counts(gin_files: Sequence[str], bindings: Sequence[str] = (), search_paths: Sequence[str] = ()) -> Dict:
    """``{"params": {group: count, "total"}, "read_per_token": {part: count, "total"},
    "closed_form": the dense closed form of the same sizes}`` of the model the files build."""
    model = parsing.parse_model(gin_files, bindings, search_paths=search_paths)
    return {
        "params": model.param_count(),
        "read_per_token": model.params_read_per_token(),
        "closed_form": closed_form_param_count(model.config),
    }


def all_model_counts(bindings: Sequence[str] = ()) -> List[Dict]:
    """One row per shipped model config: ``{"config", "params", "read_per_token"}`` (totals)."""
    rows = []
    for name in parsing.shipped_configs("models"):
        counts = model_counts([name], bindings)
        rows.append(
            {"config": name, "params": counts["params"]["total"], "read_per_token": counts["read_per_token"]["total"]}
        )
    return rows
