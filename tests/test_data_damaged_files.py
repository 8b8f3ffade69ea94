"""Damaged and unexpected data files: every case ends in one message naming the file (and the
line), a record without text is skipped and counted, nothing hangs; and C4-style JSON loads with
any shard names (allenai/c4, OLMo, Dolma). The policy is in ``terra/data/json_lines.py``."""

import gzip
import json
import os
import random
import socket
import subprocess
import sys
import zipfile
from unittest import mock

import gin
import pytest
import tensorflow as tf

from terra.cli import data as data_cli
from terra.data import fixtures, json_lines, pipeline, sources, tasks
from terra.errors import DataNotFoundError, InputError

from helpers import REPO_ROOT

LENGTHS = {"inputs": 32, "targets": 8}


def _write_lines(path, lines, *, compress=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    compress = path.endswith(".gz") if compress is None else compress
    with gzip.open(path, "wt") if compress else open(path, "w") as f:
        f.writelines(line + "\n" for line in lines)
    return path


def _docs(n, start=0, **extra):
    return [json.dumps({"text": f"Document {i} is about sparse layers.", **extra}) for i in range(start, start + n)]


def _texts(source, split="train"):
    return sorted(
        ex["text"].decode() for ex in json_lines.checked(source.get_dataset(split, shuffle=False).as_numpy_iterator())
    )


def _c4_batches(path, split="train", **kwargs):
    with gin.unlock_config():
        gin.bind_parameter("terra.data.c4_source.json_path", path)
    try:
        return pipeline.batch_iterator(tasks.get_task("c4_lm"), split, feature_lengths=LENGTHS, batch_size=2, **kwargs)
    finally:
        gin.clear_config()


def test_records_without_text_are_skipped_counted_and_reported(tmp_path):
    lines = _docs(3) + [json.dumps({"url": "u"}), json.dumps({"text": "  "}), json.dumps({"text": 7})] + _docs(2, 3)
    _write_lines(str(tmp_path / "part.jsonl"), lines)
    source = sources.c4_json_source(path=str(tmp_path / "part.jsonl"))
    assert len(_texts(source)) == 5
    assert source.reader.skipped == {"no 'text' field": 1, "empty 'text'": 1, "'text' is a int, not a string": 1}
    assert "used 5 records, skipped 3" in source.reader.summary()


@pytest.mark.slow
def test_a_stream_of_records_without_text_stops_instead_of_spinning(tmp_path):
    path = _write_lines(str(tmp_path / "en" / "c4-train.00000-of-00001.json.gz"), [json.dumps({"url": "u"})] * 5)
    batches = _c4_batches(str(tmp_path))
    with pytest.raises(InputError, match=r"task 'c4_lm', split 'train', gave no full batch of 2 examples.*no 'text'"):
        next(batches)
    assert path in str(batches.files)


def test_consecutive_skips_stop_the_stream_naming_the_lines(tmp_path):
    path = _write_lines(str(tmp_path / "a.jsonl"), _docs(1) + [json.dumps({"id": i}) for i in range(40)])
    reader = json_lines.JsonLinesReader(
        "test data", ("text",), lambda r: [sources._c4_features(r)[0]], max_consecutive_skips=10
    )
    ds = reader.read_file(tf.constant(path)).repeat()
    with pytest.raises(
        InputError, match=r"10 records in a row were skipped, the last at .*a\.jsonl, line 11, the first at .*line 2"
    ):
        for _ in json_lines.checked(ds.as_numpy_iterator()):
            pass


@pytest.mark.slow
def test_an_empty_shard_is_an_error_not_a_stop_iteration(tmp_path):
    _write_lines(str(tmp_path / "en" / "c4-train.00000-of-00001.json.gz"), [])
    with pytest.raises(InputError, match="gave no full batch of 2 examples: its files hold no usable records"):
        next(_c4_batches(str(tmp_path)))


def test_a_malformed_json_line_names_the_file_and_the_line(tmp_path):
    path = _write_lines(str(tmp_path / "c4-train.00000-of-00001.json.gz"), _docs(4) + ['{"text": "cut'] + _docs(2))
    with pytest.raises(InputError, match=rf"{path}, line 5: not valid JSON") as error:
        list(_c4_batches(str(tmp_path)))
    assert "Traceback" not in str(error.value) and len(str(error.value).splitlines()) == 1


def test_a_json_value_that_is_not_an_object_names_the_line(tmp_path):
    path = _write_lines(str(tmp_path / "data.json"), _docs(2) + ["[1, 2]"])
    with pytest.raises(InputError, match=rf"{path}, line 3: a JSON list, not an object"):
        _texts(sources.c4_json_source(path=path))


def test_a_truncated_gzip_shard_is_named(tmp_path):
    good = _write_lines(str(tmp_path / "c4-train.00000-of-00002.json.gz"), _docs(50))
    cut = _write_lines(str(tmp_path / "c4-train.00001-of-00002.json.gz"), _docs(400, 50))
    with open(cut, "rb") as f:
        data = f.read()
    with open(cut, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(InputError, match=rf"{cut}: the gzip stream is damaged after line \d+") as error:
        list(_c4_batches(str(tmp_path)))
    assert good not in str(error.value)


def test_a_shard_named_gz_that_is_not_gzip_fails_before_reading(tmp_path):
    path = _write_lines(str(tmp_path / "c4-train.00000-of-00001.json.gz"), _docs(3), compress=False)
    with pytest.raises(InputError, match=rf"{path} is named .gz but is not gzip"):
        _c4_batches(str(tmp_path))


def test_zstd_shards_say_how_to_decompress(tmp_path):
    path = str(tmp_path / "documents" / "part-0000.json.zst")
    os.makedirs(os.path.dirname(path))
    open(path, "wb").write(b"(\xb5/\xfd")
    with pytest.raises(InputError, match=rf"zstd -d {path}"):
        sources.c4_json_source(path=str(tmp_path)).get_dataset("train")


def test_a_missing_validation_split_says_how_to_name_it(tmp_path):
    _write_lines(str(tmp_path / "shard-0.jsonl"), _docs(2))
    with pytest.raises(DataNotFoundError, match="no file for split 'validation'.*validation_json_path"):
        sources.c4_json_source(path=str(tmp_path)).get_dataset("validation")


def test_dolma_and_olmo_layouts_load_with_any_names_and_extra_fields(tmp_path):
    dolma = _docs(4, id="x", source="c4", added="2023", metadata={"a": 1})
    _write_lines(str(tmp_path / "dolma" / "documents" / "c4-0000.json.gz"), dolma[:2])
    _write_lines(str(tmp_path / "dolma" / "documents" / "c4-0001.json.gz"), dolma[2:])
    _write_lines(str(tmp_path / "dolma" / "val" / "part-0.jsonl"), _docs(1, 100))
    found = sources.c4_json_files(str(tmp_path / "dolma"))
    assert [os.path.basename(f) for f in found["train"]] == ["c4-0000.json.gz", "c4-0001.json.gz"]
    assert [os.path.basename(f) for f in found["validation"]] == ["part-0.jsonl"]
    source = sources.c4_json_source(path=str(tmp_path / "dolma"))
    assert len(_texts(source)) == 4 and _texts(source, "validation") == ["Document 100 is about sparse layers."]
    # A glob without {split}, or a list of files: all training data; validation named apart.
    olmo = [_write_lines(str(tmp_path / "olmo" / f"olmo-mix-{k}.jsonl.gz"), _docs(2, 10 * k)) for k in range(3)]
    glob_source = sources.c4_json_source(
        path=str(tmp_path / "olmo" / "olmo-mix-*.jsonl.gz"), validation_path=str(tmp_path / "dolma" / "val")
    )
    assert len(_texts(glob_source)) == 6 and len(_texts(glob_source, "validation")) == 1
    assert len(_texts(sources.c4_json_source(path=olmo[:2]))) == 4


def test_the_allenai_layout_keeps_its_split_names(tmp_path):
    fixtures.write_c4_json(str(tmp_path), {"train": ["a", "b", "c"], "validation": ["d"]}, shards=2)
    found = sources.c4_json_files(str(tmp_path))
    assert len(found["train"]) == 2 and all("c4-train." in f for f in found["train"])
    assert len(found["validation"]) == 2 and all("c4-validation." in f for f in found["validation"])


def test_a_folder_mixing_allenai_shards_with_other_json_files_reads_every_file(tmp_path):
    fixtures.write_c4_json(str(tmp_path), {"train": ["a", "b"], "validation": ["d"]}, shards=1)
    olmo = _write_lines(str(tmp_path / "en" / "c4-sample.01.json.gz"), _docs(2))
    dolma = _write_lines(str(tmp_path / "en" / "dolma" / "part-0.jsonl.gz"), _docs(1, 10))
    dev = _write_lines(str(tmp_path / "en" / "dev" / "part-1.jsonl"), _docs(1, 20))
    found = sources.c4_json_files(str(tmp_path))
    assert olmo in found["train"] and dolma in found["train"] and dev in found["validation"]
    assert sum(len(v) for v in found.values()) == 5


def test_a_fifo_or_a_symlink_loop_named_like_data_is_refused_by_name(tmp_path):
    folder = tmp_path / "c4"
    _write_lines(str(folder / "shard-0.jsonl"), _docs(2))
    fifo = folder / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match=f"{fifo} is a FIFO, not a data file"):
        sources.c4_json_source(path=str(folder)).get_dataset("train")
    fifo.unlink()
    loop = folder / "loop.json.gz"
    os.symlink(loop, loop)
    with pytest.raises(InputError, match=f"cannot open {loop}: Too many levels of symbolic links"):
        sources.c4_json_source(path=str(folder)).get_dataset("train")


def test_arxiv_papers_without_an_abstract_are_skipped_and_counted(tmp_path):
    papers = [fixtures.cohan_record(i, [f"sentence of paper {i} ."], [f"paper {i} ."]) for i in range(3)]
    del papers[1]["abstract_text"]
    folder = tmp_path / "arxiv-dataset"
    _write_lines(str(folder / "train.txt"), [json.dumps(p) for p in papers])
    source = sources.arxiv_cohan_source(path=str(tmp_path))
    ids = [ex["id"] for ex in json_lines.checked(source.get_dataset("train", shuffle=False).as_numpy_iterator())]
    assert ids == [b"paper0", b"paper2"]
    assert source.reader.skipped == {"no 'abstract_text' field": 1}


def test_arxiv_papers_with_null_or_numbers_for_sentences_are_skipped_naming_the_file_and_line(tmp_path, caplog):
    papers = [fixtures.cohan_record(i, [f"sentence of paper {i} ."], [f"paper {i} ."]) for i in range(4)]
    papers[1]["article_text"] = None
    papers[2]["abstract_text"] = [3, "paper 2 ."]
    _write_lines(str(tmp_path / "arxiv-dataset" / "train.txt"), [json.dumps(p) for p in papers])
    source = sources.arxiv_cohan_source(path=str(tmp_path))
    ids = [ex["id"] for ex in json_lines.checked(source.get_dataset("train", shuffle=False).as_numpy_iterator())]
    assert ids == [b"paper0", b"paper3"]
    assert source.reader.skipped == {
        "'article_text' is null": 1,
        "'abstract_text' sentence 0 is a int, not a string": 1,
    }
    assert "train.txt, line 2: 'article_text' is null" in caplog.text


def test_prepare_arxiv_with_a_wrong_archive_is_one_clear_error(tmp_path):
    manual = tmp_path / "downloads" / "manual"
    manual.mkdir(parents=True)
    with zipfile.ZipFile(manual / "arxiv-dataset.zip", "w") as z:
        z.writestr("arxiv-dataset/train.txt", "{}\n")

    def refuse(*args):
        raise AssertionError("prepare_arxiv tried the network")

    with mock.patch.object(socket.socket, "connect", refuse):
        with pytest.raises(InputError, match="arxiv-dataset.zip is not the arXiv archive TFDS expects"):
            sources.prepare_arxiv(str(tmp_path))


def test_terra_data_show_exits_2_with_one_line_naming_the_damaged_line(tmp_path, capsys):
    path = _write_lines(str(tmp_path / "c4-train.00000-of-00001.json.gz"), _docs(1) + ["not json"])
    status = data_cli.main(["show", "--task", "c4_lm", "--split", "train", "--c4_json", str(tmp_path), "--n", "5"])
    err = capsys.readouterr().err
    assert status == 2
    assert f"{path}, line 2: not valid JSON" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err


@pytest.mark.slow
def test_a_command_stopped_by_a_damaged_file_exits_with_its_one_line(tmp_path):
    # The error surfaces inside tf.data's parallel map; the process must then end (Python's final
    # garbage collection could deadlock on that iterator) with the error line alone, even when
    # TensorFlow's C++ log level is not set.
    words, rng = ["alpha", "beta", "gamma", "delta", "epsilon"], random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(80))}) for _ in range(3000)]
    folder = tmp_path / "c4"
    folder.mkdir()
    (folder / "c4-train.00000-of-00001.json.gz").write_bytes(gzip.compress("\n".join(lines).encode())[:3000])
    _write_lines(str(folder / "c4-validation.00000-of-00001.json.gz"), lines[:300])
    command = [
        sys.executable,
        "-m",
        "terra.cli.train",
        "--gin_file=experiments/quickstart.gin",
        f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
        f"--c4_json={folder}",
        "--gin.TASK='c4_span_corruption'",
        "--gin.TRAIN_STEPS=2",
    ]
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("error: C4 JSON under") and "the gzip stream is damaged" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr[-3000:]


def test_the_error_tensorflow_raised_is_found_among_parallel_parse_errors():
    from terra.data import json_lines

    reader = json_lines.JsonLinesReader("C4 JSON", ["text"], lambda record: [record["text"]])
    # Two of tf.data's parallel parses fail together; TensorFlow raises the first one's.
    first = reader._fail("a.json, line 3: not valid JSON")
    second = reader._fail("b.json, line 9: not valid JSON")
    raised_by_tf = tf.errors.InvalidArgumentError(None, None, f"EagerPyFunc: {first}")
    assert json_lines.as_input_error(raised_by_tf, readers=[reader]) is first
    raised_by_tf = tf.errors.InvalidArgumentError(None, None, str(second))
    assert json_lines.as_input_error(raised_by_tf, readers=[reader]) is second
    assert reader.raised_errors() == [first, second]


def test_terra_data_show_counts_refuse_fifos_and_damaged_gzip_in_one_line(tmp_path, capsys):
    folder = tmp_path / "c4"
    _write_lines(str(folder / "c4-train.00000-of-00002.json.gz"), _docs(3))
    damaged = folder / "c4-train.00001-of-00002.json.gz"
    whole = gzip.compress(("\n".join(_docs(50)) + "\n").encode())
    damaged.write_bytes(whole[: len(whole) // 2])  # a download cut short
    argv = ["show", "--task", "c4_lm", "--split", "train", "--c4_json", str(folder)]
    assert data_cli.main(argv) == 2  # the count reads every file first: it must not hang or trace back
    err = capsys.readouterr().err
    assert err.startswith(f"error: C4 JSON under {folder}: {damaged}: the gzip stream is damaged after line"), err
    assert err.count("\n") == 1
    damaged.unlink()
    fifo = folder / "c4-train.00001-of-00002.json"
    os.mkfifo(fifo)
    assert data_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{fifo} is a FIFO, not a data file" in err and err.count("\n") == 1, err
    fifo.unlink()
    assert data_cli.main([*argv, "--n", "1"]) == 0
    assert capsys.readouterr().out.startswith("split train: 1 files, 3 records\nsplit validation: 0 files")
