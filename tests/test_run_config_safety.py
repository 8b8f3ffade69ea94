"""A run directory is data: opening a run someone else made (``terra.load``, ``terra-summarize
--checkpoint``, ``terra-evaluate --checkpoint``) imports, calls and writes nothing its files ask
for. Every configurable of terra's registry is tried: those that write files or read a path of
their own are refused by name, as are references to any configurable terra calls itself; each
refusal is one error naming the file, the line and the selector, with nothing written anywhere
and gin's configuration untouched."""

import os
import stat

import gin
import pytest

import terra
from terra import run_config
from terra.cli import evaluate as evaluate_cli
from terra.cli import summarize as summarize_cli
from terra.errors import ConfigError, InputError
from terra.gin_config import registry_file
from terra.training import run_directory

# What terra writes at the top of a run's config.gin, so the hostile line is line 5.
PREAMBLE = (
    "import terra.data.tasks\n"
    "MODEL = @terra.models.EncoderDecoderModel()\n"
    "TASK = 'embedded_summarization'\n"
    "TASK_FEATURE_LENGTHS = {'inputs': 32, 'targets': 8}\n"
)
HOSTILE_LINE = 5


def _snapshot(*folders):
    """Every path under ``folders`` with its size and modification time."""
    seen = {}
    for folder in folders:
        for root, dirs, names in os.walk(folder):
            for name in dirs + names:
                path = os.path.join(root, name)
                status = os.lstat(path)
                seen[path] = (status.st_size, status.st_mtime_ns)
    return seen


@pytest.fixture
def hostile_run(tmp_path):
    """``make(line)``: a run directory whose config.gin is terra's preamble plus ``line``;
    ``victim``: a folder a hostile config points its writes at; ``unchanged()``: whether
    nothing was written in either, nor in terra's cache, since the run was made."""
    run, victim = tmp_path / "run", tmp_path / "victim"
    victim.mkdir()
    (victim / "existing.model").write_bytes(b"the user's own file")
    cache = os.environ["TERRA_CACHE_DIR"]

    class Hostile:
        def make(self, line: str) -> str:
            run.mkdir(exist_ok=True)
            (run / "config.gin").write_text(PREAMBLE + line + "\n")
            self.before = _snapshot(tmp_path, cache)
            return str(run)

        def unchanged(self) -> bool:
            return _snapshot(tmp_path, cache) == self.before

    hostile = Hostile()
    hostile.run, hostile.victim = str(run), str(victim)
    return hostile


def _registry_by_role(role):
    return sorted(selector for selector, r in run_config.roles().items() if r == role)


def test_every_configurable_in_the_registry_has_a_role_and_every_named_one_exists():
    registry = registry_file.stored_registry()
    assert set(run_config.roles()) == set(registry)
    named = set(run_config._REFUSED) | set(run_config._REFERABLE)
    assert named <= set(registry), named - set(registry)
    # The configurables that write files are among the refused ones (the module's docstring).
    for writer in ("terra.data.train_sentencepiece", "terra.data.build_corpus", "terra.evaluation.evaluate"):
        assert run_config.role(writer) == run_config.REFUSED
    assert run_config.role("terra.training.Checkpointer") == run_config.BINDABLE  # creates folders when called
    assert run_config.role("terra.models.EncoderDecoderModel") == run_config.REFERABLE


def _refused(hostile, line: str, *expected: str) -> str:
    path = hostile.make(line)
    gin.clear_config()
    with pytest.raises(ConfigError) as error:
        terra.load(path)
    message = str(error.value)
    assert message.startswith(f"{path}/config.gin, line {HOSTILE_LINE}: "), message
    assert "\n" not in message and "nothing it names was imported, called or written" in message
    for words in expected:
        assert words in message, message
    assert hostile.unchanged(), "opening the run wrote files"
    assert gin.config_str() == "", "the refused config reached gin"
    return message


@pytest.mark.parametrize("selector", _registry_by_role(run_config.REFUSED))
def test_a_configurable_that_writes_or_reads_its_own_path_is_refused_bound_or_referenced(hostile_run, selector):
    parameters = registry_file.stored_registry()[selector] or ["path"]
    target = os.path.join(hostile_run.victim, "existing.model")
    _refused(hostile_run, f"{selector}.{parameters[0]} = {target!r}", f"binds {selector}, which ")
    short = selector.rsplit(".", 1)[-1]
    _refused(hostile_run, f"TransformerConfig.vocab_size = @{short}()", f"refers to @{short} ({selector})")
    _refused(hostile_run, f"MODEL/TransformerConfig.d_model = @{short}", f"refers to @{short}")
    assert open(target, "rb").read() == b"the user's own file"


@pytest.mark.parametrize("selector", _registry_by_role(run_config.BINDABLE))
def test_a_configurable_terra_calls_itself_is_never_called_from_a_run_config(hostile_run, selector):
    _refused(hostile_run, f"EncoderDecoderTransformer.config = @{selector}()", f"refers to @{selector}")


@pytest.mark.parametrize(
    "line, words",
    [
        ("import os", "imports os (a run's config imports only terra's configurable packages)"),
        ("import terra.cli.quickstart", "imports terra.cli.quickstart"),
        ("from terra.benchmarks import decode_speed", "imports terra.benchmarks.decode_speed"),
        ("include 'terra/configs/models/tiny.gin'", "includes terra/configs/models/tiny.gin"),
        ("seqio.SentencePieceVocabulary.sentencepiece_model_file = '/x'", "not one of terra's configurables"),
        ("TransformerConfig.d_model = @gin.config.external_configurable()", "not one of terra's configurables"),
        ("TASK_FEATURE_LENGTHS = {@TransformerConfig(): 1}", "dict key that is not a string or an integer"),
        ("TASK = b'embedded'", "holds a bytes, not a value terra writes"),
        ("TASK = 2j", "holds a complex"),
        ("TASK = " + "[" * 40 + "]" * 40, "nests its value more than 16 deep"),
    ],
)
def test_anything_terra_does_not_write_into_a_run_is_one_error_naming_line_and_selector(hostile_run, line, words):
    _refused(hostile_run, line, words)


@pytest.mark.parametrize(
    "line, words",
    [
        ("TransformerConfig:\n  d_model = 64", "line 5: holds a BlockDeclaration"),
        ("TASK = " + "9" * 5000, "line 5: gin cannot read it (Exceeds the limit (4300 digits)"),
        ("TASK = " + "[" * 5000 + "]" * 5000, "holds a value gin cannot read (nested too deeply)"),
        ("TASK = = 1", "line 5: gin cannot read it"),
    ],
)
def test_a_block_or_an_unreadable_literal_is_refused_before_gin_parses(hostile_run, line, words):
    path = hostile_run.make(line)
    with pytest.raises(ConfigError) as error:
        terra.load(path)
    message = str(error.value)
    assert message.startswith(f"{path}/config.gin") and words in message and "\n" not in message, message
    assert hostile_run.unchanged() and gin.config_str() == ""


@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "sparse"])
def test_a_run_config_that_is_not_a_small_regular_file_is_refused_unread(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    config = run / "config.gin"
    if kind == "fifo":
        os.mkfifo(config)  # a read would wait forever for a writer
    elif kind == "device":
        os.symlink("/dev/zero", config)  # a read would run until memory is gone
    elif kind == "folder":
        config.mkdir()
    else:
        with open(config, "wb") as f:  # 4 GiB that take no disk
            f.truncate(4 << 30)
    with pytest.raises(ConfigError) as error:
        terra.load(str(run))
    expected = "is 4.0 GiB, more than the 1.0 MiB" if kind == "sparse" else "is not a regular file"
    assert str(error.value).startswith(f"the run's config.gin {config}") and expected in str(error.value)
    assert stat.S_ISFIFO(os.lstat(config).st_mode) == (kind == "fifo")


def test_the_configs_terra_writes_pass_the_check(tmp_path):
    """The operative config of every shipped experiment and model config, as a run records it."""
    from terra.gin_config import parsing

    names = sorted(f"experiments/{n}" for n in os.listdir(os.path.join(parsing.CONFIGS_DIR, "experiments")))
    names += parsing.shipped_configs("models")
    for name in names:
        if not name.endswith(".gin"):
            continue
        bindings = ["MODEL_DIR = '/runs/x'"] if name.startswith("experiments/") else []
        parsing.parse_gin([name], bindings, finalize=False)
        text = gin.config_str()
        statements = run_config.check_text(text, name)
        assert statements, name


def test_a_run_whose_vocabulary_copy_is_gone_names_the_copy_not_a_new_vocabulary(hostile_run, tmp_path):
    path = hostile_run.make("terra.data.text_vocabulary.spm_path = '/data/c4-32k.model'")
    with pytest.raises(ConfigError) as error:
        terra.load(path)
    message = str(error.value)
    assert message.startswith(f"{path}/vocabulary/sentencepiece.model is missing: the run keeps a copy")
    assert "it was trained from /data/c4-32k.model" in message and "Put the run's copy back" in message
    assert "terra-vocab" not in message
    # A vocabulary named by the user wins, as for any run.
    assert run_directory.load_bindings(
        path, run_directory.read_config(path), ["terra.data.text_vocabulary.spm_path = '/mine.model'"]
    ) == [f"MODEL_DIR = {path!r}"]


@pytest.mark.parametrize("damage", ["garbage", "empty", "device"])
def test_a_damaged_vocabulary_copy_is_one_error_naming_it(tmp_path, damage):
    from terra.data import vocabularies

    model = tmp_path / "sentencepiece.model"
    if damage == "garbage":
        model.write_bytes(b"\x0a\xff\xff\xff\xff\x0f" * 100)  # a protobuf length past the end
    elif damage == "empty":
        model.write_bytes(b"")
    else:
        os.symlink("/dev/zero", model)
    with pytest.raises(InputError) as error:
        vocabularies.sentencepiece_vocabulary(str(model))
    expected = "is not a regular file" if damage == "device" else "is not a SentencePiece model"
    assert str(error.value).startswith(f"the SentencePiece model {model}") and expected in str(error.value)


@pytest.mark.parametrize("cli", [summarize_cli, evaluate_cli])
def test_the_commands_refuse_a_hostile_run_in_one_line_before_tensorflow_and_write_nothing(
    hostile_run, capsys, cli, tmp_path, no_tensorflow
):
    document = tmp_path / "victim" / "doc.txt"
    document.write_text("A document to summarize.\n")
    path = hostile_run.make(
        f"terra.data.train_sentencepiece.model_path = {os.path.join(hostile_run.victim, 'existing.model')!r}"
    )
    argv = [f"--checkpoint={path}", str(document)] if cli is summarize_cli else [f"--checkpoint={path}"]
    hostile_run.before = _snapshot(tmp_path, os.environ["TERRA_CACHE_DIR"])
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"error: {path}/config.gin, line {HOSTILE_LINE}: binds "), err
    assert "terra.data.train_sentencepiece" in err[0]
    assert hostile_run.unchanged()


@pytest.fixture(scope="module")
def saved_params(tmp_path_factory):
    """A one-step checkpoint of a two-array parameter tree, as terra-convert writes one."""
    import numpy as np

    from terra.training import checkpointing

    root = tmp_path_factory.mktemp("checkpoint")
    params = {"dense": {"kernel": np.ones((4, 3), np.float32), "bias": np.zeros(3, np.float32)}}
    writer = checkpointing.Checkpointer(str(root), save_interval_steps=1, keep_last=None)
    try:
        writer.save(0, {"params": params}, force=True)
    finally:
        writer.close()
    return root, params


@pytest.mark.parametrize("kind", ["device", "fifo", "sparse"])
def test_a_checkpoint_file_that_is_not_a_small_regular_file_is_refused_unread(tmp_path, saved_params, kind):
    import shutil

    import jax

    from terra.errors import CheckpointError
    from terra.training import checkpointing

    root, params = saved_params
    run = tmp_path / "run"
    shutil.copytree(root, run)
    metadata = run / "checkpoints" / "0" / "state" / "_METADATA"
    metadata.unlink()
    if kind == "device":
        os.symlink("/dev/zero", metadata)
    elif kind == "fifo":
        os.mkfifo(metadata)
    else:
        with open(metadata, "wb") as f:
            f.truncate(1 << 40)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)

    class Model:  # what load_params (terra.load, terra-evaluate, terra-summarize) asks of a model
        def abstract_params(self):
            return abstract

    expected = "is 1024.0 GiB, more than the 256.0 MiB" if kind == "sparse" else "is not a regular file"
    # Every reader of a step: a run's parameters as restored for fine-tuning, as loaded to decode
    # (which first reads how its weights are stored), and that dtype alone.
    for read in (
        lambda where: checkpointing.restore_params(where, abstract),
        lambda where: checkpointing.load_params(Model(), where)[0],
        lambda where: checkpointing.stored_weights_dtype(where),
    ):
        with pytest.raises(CheckpointError) as error:
            read(str(run))
        assert str(error.value).startswith(f"checkpoint {run}/checkpoints/0: the metadata file {metadata}")
        assert expected in str(error.value)
    assert checkpointing.restore_params(str(root), abstract)["dense"]["kernel"].shape == (4, 3)  # the intact copy
    assert checkpointing.load_params(Model(), str(root))[0]["dense"]["kernel"].shape == (4, 3)
    assert checkpointing.stored_weights_dtype(str(root)) == "float32"
