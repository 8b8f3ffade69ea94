"""Flags several commands share: gin files and bindings, data locations, and a preset's
``ml_collections`` config.

- gin (the T5X form): ``--gin_file`` (repeatable), ``--gin_bindings``/``--gin.NAME=VALUE``,
  ``--gin_search_paths`` for the user's own config folders;
- data: ``--tfds_data_dir``, ``--c4_json``, ``--arxiv_cohan`` and ``--vocabulary``, each turned
  into the gin bindings of the sources it locates (:func:`data_bindings`);
- config: a preset (a ``ConfigDict``) whose fields ``--config.FIELD=VALUE`` overrides, through
  ``ml_collections.config_flags``.
"""

import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from absl import flags

from terra import errors, run_config


def define_gin_flags(flag_values: flags.FlagValues, *, files_help: str = "") -> None:
    flags.DEFINE_multi_string(
        "gin_file",
        [],
        files_help
        or "gin file to parse (later files override earlier ones); a relative "
        "name is looked up in the working directory, then --gin_search_paths, then terra's shipped configs "
        "(e.g. experiments/quickstart.gin)",
        flag_values=flag_values,
    )
    flags.DEFINE_multi_string(
        "gin_bindings",
        [],
        "a gin binding 'NAME = VALUE'; --gin.NAME=VALUE is the short form, "
        "applied after the files; strings need quotes: --gin.MODEL_DIR=\"'runs/x'\"",
        flag_values=flag_values,
    )
    flags.DEFINE_multi_string(
        "gin_search_paths",
        [],
        "folder where --gin_file names and gin includes are also looked up",
        flag_values=flag_values,
    )


def gin_arguments(flag_values: flags.FlagValues) -> Dict[str, List[str]]:
    """``{"gin_files", "gin_bindings", "search_paths"}`` as given on the command line."""
    return {
        "gin_files": list(flag_values.gin_file),
        "gin_bindings": list(flag_values.gin_bindings),
        "search_paths": list(flag_values.gin_search_paths),
    }


# flag -> (help, the gin parameters it binds)
DATA_FLAGS: Dict[str, tuple] = {
    "tfds_data_dir": (
        "directory of prepared TFDS datasets (c4/en/3.1.0, scientific_papers/arxiv/1.1.1)",
        ("terra.data.c4_source.tfds_data_dir", "terra.data.arxiv_source.tfds_data_dir"),
    ),
    "c4_json": (
        "C4-style JSON lines (field text; allenai/c4, OLMo, Dolma): a folder, a glob, or a pattern with {split}",
        ("terra.data.c4_source.json_path",),
    ),
    "c4_validation_json": (
        "C4-style JSON lines to evaluate on, where --c4_json's folder has no validation files: a folder, glob or file",
        ("terra.data.c4_source.validation_json_path",),
    ),
    "arxiv_cohan": (
        "directory of the extracted arxiv-dataset/{train,val,test}.txt",
        ("terra.data.arxiv_source.cohan_path",),
    ),
    "vocabulary": (
        "SentencePiece model for the text tasks (default: one trained on the embedded corpus)",
        ("terra.data.text_vocabulary.spm_path",),
    ),
}


def define_data_flags(flag_values: flags.FlagValues) -> None:
    for name, (help_text, _) in DATA_FLAGS.items():
        flags.DEFINE_string(name, None, help_text, flag_values=flag_values)


def data_bindings(values) -> List[str]:
    """Gin bindings for the data flags given: ``values`` is parsed flags or a mapping."""
    get = values.get if isinstance(values, Mapping) else (lambda name: getattr(values, name, None))
    bindings = []
    for name, (_, targets) in DATA_FLAGS.items():
        value = get(name)
        if value is not None:
            bindings += [f"{target} = {value!r}" for target in targets]
    return bindings


def run_config_files(checkpoint: str) -> List[str]:
    """``[<checkpoint>/config.gin]`` where that is a local file, else ``[]``: what a command given
    ``--checkpoint`` parses first, known before the library is imported (the early check of
    ``--gin`` overrides reads it; a URL is read when the run is loaded). The file is checked as
    data first (:mod:`terra.run_config`), so a config a run may not hold is refused here, before
    anything heavy is imported."""
    config = os.path.join(checkpoint, run_config.CONFIG_FILE)
    if not os.path.lexists(config):
        return []
    return [run_config.read_run_config(os.path.abspath(config)).path]


def given_data_flags(flag_values: flags.FlagValues) -> List[str]:
    return [f"--{name}" for name in DATA_FLAGS if flag_values[name].present]


# --- presets: ml_collections configs overridden field by field ------------------------------------


def peek_flag(argv: Sequence[str], name: str, default: Optional[str]) -> Optional[str]:
    """The value of ``--name`` in ``argv`` before the command's flags exist (a preset decides
    which config, and so which ``--config.*`` fields, the command defines)."""
    probe = flags.FlagValues()
    flags.DEFINE_string(name, default, "", flag_values=probe)
    try:
        probe(["peek", *argv], known_only=True)
    except flags.Error as e:
        raise errors.UsageError(str(e)) from None
    return probe[name].value


def define_preset_flags(
    flag_values: flags.FlagValues, argv: Sequence[str], presets: Mapping[str, Callable], default: str, what: str
) -> None:
    """``--preset NAME`` (one of ``presets``) and ``--config.FIELD=VALUE`` over that preset's
    ``ConfigDict``."""
    name = peek_flag(argv, "preset", default)
    if name not in presets:
        raise errors.UsageError(f"unknown preset '{name}' for {what}; choose from: {', '.join(presets)}.")
    flags.DEFINE_enum("preset", default, list(presets), f"the {what} preset", flag_values=flag_values)
    define_config_flag(flag_values, presets[name](), argv, f"the {what} settings of the chosen --preset")


def define_config_flag(flag_values: flags.FlagValues, config, argv: Sequence[str], help_text: str) -> None:
    from ml_collections import config_flags

    config_flags.DEFINE_config_dict("config", config, help_text, flag_values=flag_values, sys_argv=["terra", *argv])


# terra.quantization.WEIGHTS_DTYPES, spelled out here so that flag parsing imports no JAX
# (tests/test_cli.py checks they agree).
WEIGHTS_DTYPES = ("float32", "bfloat16", "int8")


def define_weights_dtype_flag(flag_values: flags.FlagValues, default: Optional[str] = "float32") -> None:
    """``--weights_dtype``: how the decode step stores the weights it reads."""
    flags.DEFINE_enum(
        "weights_dtype",
        default,
        list(WEIGHTS_DTYPES),
        "weights as stored for decoding: int8 (per-row scales) or bfloat16 read a quarter or half of float32's "
        "bytes; activations and caches stay float32 (docs/decode_speed.md, 'Quantized decoding')",
        flag_values=flag_values,
    )


# terra.backends.decode_state.CACHE_DTYPES, spelled out for the same reason (tests/test_cli.py checks).
CACHE_DTYPES = ("float32", "bfloat16", "int8")


def define_cache_dtype_flag(flag_values: flags.FlagValues, default: Optional[str] = "float32") -> None:
    """``--cache_dtype``: how the decode step stores the attention caches it reads (the binding
    ``TransformerConfig.cache_dtype``, see :func:`cache_dtype`)."""
    flags.DEFINE_enum(
        "cache_dtype",
        default,
        list(CACHE_DTYPES),
        "attention caches as stored for decoding (the decoder's keys/values and the encoder's): bfloat16 or int8 "
        "(per-row scales) read a half or a quarter of float32's bytes, which at long inputs are most of a step's "
        "reads; binds TransformerConfig.cache_dtype",
        flag_values=flag_values,
    )


def cache_dtype(flag_values: flags.FlagValues) -> Optional[str]:
    """``--cache_dtype`` where it was given, else None: the config's own (float32 unless it binds
    ``TransformerConfig.cache_dtype``)."""
    return flag_values.cache_dtype if flag_values["cache_dtype"].present else None
