"""A run directory opens from anywhere: paths resolved when a config is parsed, the vocabulary kept
in the run (and a different one refused), and runs under URLs read through etils.epath."""

import contextlib
import os
import shutil
import types

import gin
import pytest
from etils import epath
from etils.epath import gpath

from terra import run_config
from terra.errors import ConfigError
from terra.gin_config import parsing
from terra.training import run_directory


def test_relative_data_paths_become_absolute_when_a_config_is_parsed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parsing.parse_gin(
        ["models/tiny.gin"],
        [
            "terra.data.text_vocabulary.spm_path = 'vocab/c4.model'",
            "terra.data.c4_source.json_path = ['c4/*.json.gz', 'gs://bucket/c4/x.json']",
            "terra.data.arxiv_source.cohan_path = 'gs://bucket/arxiv'",
            "terra.data.arxiv_source.tfds_data_dir = '~/tfds'",
            "MODEL_DIR = 'runs/r'",
        ],
        finalize=False,
    )
    assert gin.query_parameter("terra.data.text_vocabulary.spm_path") == str(tmp_path / "vocab" / "c4.model")
    assert gin.query_parameter("terra.data.c4_source.json_path") == [
        str(tmp_path / "c4" / "*.json.gz"),
        "gs://bucket/c4/x.json",  # URLs stay as they are
    ]
    assert gin.query_parameter("terra.data.arxiv_source.cohan_path") == "gs://bucket/arxiv"
    assert gin.query_parameter("terra.data.arxiv_source.tfds_data_dir") == os.path.expanduser("~/tfds")
    assert gin.query_parameter("%MODEL_DIR") == str(tmp_path / "runs" / "r")
    # The operative config a run writes names them so.
    assert f"'{tmp_path}/vocab/c4.model'" in gin.config_str()


def _vocabulary(path, data: bytes):
    path.write_bytes(data)
    return types.SimpleNamespace(sentencepiece_model_file=str(path))


def test_a_run_keeps_a_copy_of_its_vocabulary_and_refuses_a_different_one(tmp_path):
    run = tmp_path / "run"
    first = _vocabulary(tmp_path / "a.model", b"model a")
    copy = run_directory.save_vocabulary(str(run), first)
    assert copy == str(run / "vocabulary" / "sentencepiece.model") and open(copy, "rb").read() == b"model a"
    assert run_directory.save_vocabulary(str(run), first) == copy  # resuming with the same file
    with pytest.raises(ConfigError, match="would change its token ids"):
        run_directory.save_vocabulary(str(run), _vocabulary(tmp_path / "b.model", b"model b"))
    assert open(copy, "rb").read() == b"model a" and os.listdir(run / "vocabulary") == ["sentencepiece.model"]
    # Bytes and digits need no file: nothing is written.
    assert run_directory.save_vocabulary(str(tmp_path / "bytes"), object()) is None
    assert not (tmp_path / "bytes").exists()


def test_a_moved_run_opens_from_another_folder_with_its_own_vocabulary(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "r"
    run_directory.write_config(str(run), "TASK = 'x'\n")
    run_directory.save_vocabulary(str(run), _vocabulary(tmp_path / "a.model", b"model a"))
    shutil.move(str(run), str(tmp_path / "moved"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert run_directory.config_path("../moved") == str(tmp_path / "moved" / "config.gin")
    assert run_directory.load_bindings("../moved") == [
        f"MODEL_DIR = {str(tmp_path / 'moved')!r}",
        f"terra.data.text_vocabulary.spm_path = {str(tmp_path / 'moved' / 'vocabulary' / 'sentencepiece.model')!r}",
    ]
    with pytest.raises(ConfigError, match=f"{tmp_path}/elsewhere/r/config.gin does not exist"):
        run_directory.config_path("r")


@contextlib.contextmanager
def _mock_epath(**fns):
    """etils.epath's own test hooks. They replace epath's backends, which epath bypasses for
    TensorFlow's file system where TensorFlow is installed: tell it TensorFlow is not."""
    with pytest.MonkeyPatch.context() as patch, epath.testing.mock_epath(**fns):
        patch.setattr(gpath, "_is_tf_installed", lambda: False)
        yield


@contextlib.contextmanager
def _bucket(root):
    """``gs://bucket/...`` served from the local folder ``root``."""

    def local(path):
        return str(path).replace("gs://bucket", str(root))

    with _mock_epath(
        exists=lambda fn, path: os.path.exists(local(path)),
        isdir=lambda fn, path: os.path.isdir(local(path)),
        open=lambda fn, path, *args, **kwargs: open(local(path), *args, **kwargs),
        stat=lambda fn, path: fn(local(path)),
    ):
        yield


def test_a_run_under_a_url_is_read_through_epath_with_its_url_intact(tmp_path):
    run_directory.write_config(str(tmp_path / "run"), "TASK_FEATURE_LENGTHS = {'inputs': 7}\n")
    (tmp_path / "run" / "vocabulary").mkdir()
    (tmp_path / "run" / "vocabulary" / "sentencepiece.model").write_bytes(b"model")
    with _bucket(tmp_path):
        config = run_directory.config_path("gs://bucket/run")
        assert config == "gs://bucket/run/config.gin"  # not <cwd>/gs:/bucket/run
        assert run_directory.load_bindings("gs://bucket/run") == [
            "MODEL_DIR = 'gs://bucket/run'",
            "terra.data.text_vocabulary.spm_path = 'gs://bucket/run/vocabulary/sentencepiece.model'",
        ]
        parsing.parse_gin([config], [], finalize=False)
        assert gin.query_parameter("%TASK_FEATURE_LENGTHS") == {"inputs": 7}
        with pytest.raises(ConfigError, match="gs://bucket/other/config.gin does not exist"):
            run_directory.config_path("gs://bucket/other")


def test_a_file_system_error_on_a_url_is_one_line_naming_it(tmp_path):
    def unreachable(fn, path):
        raise RuntimeError("Error executing an HTTP request:\n  could not resolve host")

    with _mock_epath(exists=unreachable):
        with pytest.raises(ConfigError) as error:
            run_directory.config_path("gs://bucket/run")
    assert str(error.value) == (
        "cannot read gs://bucket/run/config.gin: Error executing an HTTP request: could not resolve host"
    )


def test_a_crafted_run_config_imports_nothing_and_reads_no_other_file(tmp_path):
    import sys

    run = tmp_path / "run"
    config = run / "config.gin"
    run_directory.write_config(str(run), "import terra.training as terra3\nimport this\nTASK = 'x'\n")
    with pytest.raises(ConfigError, match=f"{config}, line 2: imports this \\(a run's config imports only terra's"):
        run_directory.config_path(str(run))
    assert "this" not in sys.modules  # the Zen of Python would have printed on import
    run_directory.write_config(str(run), "include '/etc/hostname'\n")
    with pytest.raises(ConfigError, match="line 1: includes /etc/hostname \\(terra writes a run's config whole"):
        run_directory.config_path(str(run))
    with open(config, "wb") as f:  # a declared size past the limit, checked before reading
        f.truncate(run_config.MAX_CONFIG_BYTES + 1)
    with pytest.raises(ConfigError, match="is 1.0 MiB, more than the 1.0 MiB such a file can hold, so it was not read"):
        run_directory.config_path(str(run))
    run_directory.write_config(str(run), "TASK = = 'x'\n")
    with pytest.raises(ConfigError, match="config.gin, line 1: gin cannot read it \\(Unable to parse value"):
        run_directory.config_path(str(run))
