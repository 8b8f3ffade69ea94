"""The documentation stands on its own: every repository path that the README, the docs, the code,
the configs and the tests cite exists, every relative link between pages resolves, nothing cites
notes outside the repository, and the README stays a short front door."""

import glob
import itertools
import os
import re

import pytest

from helpers import REPO_ROOT

TOP_FILES = ("README.md", "CHANGELOG.md", "LICENSE", "Makefile", "setup.cfg", "pyproject.toml", "requirements.txt")
# A repository path: a top-level folder of the checkout followed by a path, or a shipped config
# named as --gin_file takes it (models/tiny.gin, relative to configs/). A shipped config's package
# path (terra/configs/models/tiny.gin, the name an include takes) is the file under configs/.
PATH = re.compile(r"(?<![\w./-])((?:terra|configs|docs|tests|scripts|\.ci)/[\w./{},*-]*[\w*}])")
PACKAGE_PATH = "terra/configs/"
CONFIG = re.compile(r"(?<![\w./-])((?:models|tasks|runs|sizes|experiments)/[\w{},*-]+\.gin)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
OUTSIDE = re.compile(r"\.\./shared|trax_reference\.md|framework_anchors\.md|cpu_decode_notes\.md|data_and_seqio\.md")


def _sources():
    """Every text file whose citations must hold: docs, code, configs, tests, build files."""
    patterns = [
        "*.md",
        "docs/**/*.md",
        "terra/**/*.py",
        "terra/**/*.cc",
        "terra/**/*.h",
        "configs/**/*.gin",
        "tests/*.py",
        "scripts/*.sh",
        ".ci/run",
    ]
    found = {os.path.join(REPO_ROOT, f) for f in TOP_FILES if os.path.isfile(os.path.join(REPO_ROOT, f))}
    for pattern in patterns:
        found.update(glob.glob(os.path.join(REPO_ROOT, pattern), recursive=True))
    return sorted(found)


SOURCES = _sources()


def _expand(path: str):
    """``a/{b,c}.{md,json}`` -> every combination; a brace without a comma is a placeholder."""
    parts = re.split(r"(\{[^{}]*\})", path)
    options = [p[1:-1].split(",") if p.startswith("{") and "," in p else [p] for p in parts]
    return ["".join(combo) for combo in itertools.product(*options)]


def _exists(relative: str, base: str = REPO_ROOT) -> bool:
    target = os.path.normpath(os.path.join(base, relative))
    return bool(glob.glob(target, recursive=True)) if "*" in relative else os.path.exists(target)


def _cited(text: str):
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".")
        yield (path[len("terra/") :] if f"{path}/".startswith(PACKAGE_PATH) else path), ""
    for match in CONFIG.finditer(text):
        yield match.group(1), "configs"


# Tests cite missing paths on purpose (error paths); the changelog records removed ones.
CITING = [s for s in SOURCES if not s.startswith(os.path.join(REPO_ROOT, "tests")) and not s.endswith("CHANGELOG.md")]


def test_every_cited_repository_path_exists():
    missing = []
    for source in CITING:
        text = open(source, encoding="utf-8").read()
        for cited, prefix in _cited(text):
            # Placeholders: {split}, <name>, NAME, X (models/X.gin).
            if re.search(r"\{[^{},]*\}|<|\b[A-Z]+\b", cited):
                continue
            for path in _expand(cited):
                if not _exists(os.path.join(prefix, path)):
                    missing.append(f"{os.path.relpath(source, REPO_ROOT)}: {path}")
    assert not missing, "cited paths that do not exist:\n  " + "\n  ".join(sorted(set(missing)))


NATIVE = os.path.join(REPO_ROOT, "terra", "backends", "native")
# A file of the native kernels named in their comments without a folder (isa.h, products.cc).
SIBLING = re.compile(r"(?<![\w./<-])(\w+\.(?:cc|h))\b")


def test_the_native_sources_comments_name_only_files_beside_them():
    missing = []
    for source in sorted(glob.glob(os.path.join(NATIVE, "*.cc")) + glob.glob(os.path.join(NATIVE, "*.h"))):
        for number, line in enumerate(open(source, encoding="utf-8"), 1):
            if line.lstrip().startswith("#include"):  # the compiler checks those
                continue
            for name in SIBLING.findall(line):
                if not os.path.exists(os.path.join(NATIVE, name)):
                    missing.append(f"{os.path.basename(source)}:{number}: {name}")
    assert not missing, "native sources naming files that do not exist:\n  " + "\n  ".join(missing)


def test_every_relative_link_of_the_markdown_pages_resolves():
    broken = []
    for source in (s for s in SOURCES if s.endswith(".md")):
        text = re.sub(r"```.*?```|`[^`\n]*`", "", open(source, encoding="utf-8").read(), flags=re.S)  # code
        for match in LINK.finditer(text):
            target = match.group(1)
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            if not _exists(target, os.path.dirname(source)):
                broken.append(f"{os.path.relpath(source, REPO_ROOT)}: {target}")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_nothing_cites_notes_outside_the_repository():
    cites = [
        f"{os.path.relpath(s, REPO_ROOT)}:{n}"
        for s in SOURCES
        if not s.endswith("test_docs.py")
        for n, line in enumerate(open(s, encoding="utf-8"), 1)
        if OUTSIDE.search(line)
    ]
    assert not cites, cites


def test_the_readme_is_a_short_front_door():
    readme = open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()
    assert len(readme.splitlines()) <= 250
    assert readme.index("make run") < readme.index("make test") < readme.index("## Install")
    for section in ("## Contents", "## Two commands", "## Install", "## Python API", "## Results", "## Documentation"):
        assert section in readme, section


# The benchmarks' stored outputs that are not a decode preset's: terra-bench's other commands,
# the install, the quick start and the test suite.
OTHER_BENCHMARKS = {
    "decode_step_profile",
    "setup",
    "quickstart",
    "test_suite",
    "train_speed",
    "quantized_products",
    "command_startup",
    "stream_speed",
    "save_load_speed",
}
# A second run of one benchmark stored beside the first: NAME_run2, NAME_a, NAME_beside.
SECOND_RUN = re.compile(r"_(?:run\d+|[a-z]|beside|old|new|before|after)$")


def test_docs_benchmarks_holds_one_folder_per_preset_with_its_latest_run_only():
    from terra.benchmarks.presets import PRESETS

    root = os.path.join(REPO_ROOT, "docs", "benchmarks")
    folders = sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))
    assert set(folders) <= set(PRESETS) | OTHER_BENCHMARKS, sorted(set(folders) - set(PRESETS) - OTHER_BENCHMARKS)
    nested = [os.path.relpath(d, root) for d, _, _ in os.walk(root) if SECOND_RUN.search(os.path.basename(d))]
    assert not nested, f"second runs stored beside the latest (git keeps earlier runs): {nested}"


@pytest.mark.parametrize("text, expected", [("docs/reproduce/{a,b}.{md,png}", 4), ("docs/x.md", 1)])
def test_brace_expansion_of_cited_paths(text, expected):
    assert len(_expand(text)) == expected


TIMING = re.compile(r"\b\d[\d,.]*(?:\s|–\d[\d,.]*\s?)?(?:ms|s|seconds|minutes|min|hours)\b")


def _readme_paragraphs(text: str):
    """The README's paragraphs; a table or a code block belongs to the paragraph before it."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        if paragraphs and block.lstrip().startswith(("|", "```")):
            paragraphs[-1] += "\n" + block
        else:
            paragraphs.append(block)
    return paragraphs


def test_every_timing_the_readme_states_cites_the_stored_output_it_comes_from():
    readme = open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()
    uncited = []
    for paragraph in _readme_paragraphs(readme):
        if not TIMING.search(paragraph):
            continue
        cited = re.findall(r"docs/benchmarks/[\w./-]*\w", paragraph)
        stored = [p for p in cited if os.path.exists(os.path.join(REPO_ROOT, p))]
        if not stored:
            uncited.append(paragraph.strip().splitlines()[0][:100])
    assert not uncited, f"README paragraphs with timings but no stored output under docs/benchmarks/: {uncited}"


# "(10 min on 2 cores: docs/benchmarks/test_suite/make_test.txt)": a figure and the `time` output it is from.
_CITED_RUN_TIME = re.compile(r"\(([\d.]+) min[^():]*: (docs/benchmarks/[\w./-]*\.txt)\)")
_REAL = re.compile(r"^real\s+(\d+)m([\d.]+)s$", re.MULTILINE)


def test_the_readmes_run_times_are_the_times_in_the_outputs_they_cite():
    readme = open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()
    cited = _CITED_RUN_TIME.findall(readme)
    assert len(cited) >= 2, cited  # make run and make test
    for figure, path in cited:
        with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
            (minutes, seconds), *_ = _REAL.findall(f.read())[-1:] or [(None, None)]
        assert minutes is not None, f"{path} holds no `real` line of `time`"
        measured = int(minutes) + float(seconds) / 60
        decimals = len(figure.split(".")[1]) if "." in figure else 0
        assert float(figure) == round(measured, decimals), f"the README says {figure} min, {path} says {measured:.2f}"


# "(14.5 min, 28.0 CPU-minutes, on ...: docs/benchmarks/test_suite/make_test.txt)": the suite's own count.
_CITED_CPU = re.compile(r"\([^()]*?([\d.]+) CPU-minutes([^():]*): (docs/benchmarks/[\w./-]*\.txt)\)")
# How the README names the widest of the vector extensions the suite's machine line lists.
_ISA_NAMES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "avx_vnni": "VNNI", "amx_int8": "AMX"}


def test_the_readmes_cpu_minutes_are_the_suites_own_count_in_the_output_it_cites():
    readme = open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()
    cited = _CITED_CPU.findall(readme)
    assert cited, "the README states make test's CPU-minutes"
    for figure, machine, path in cited:
        with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
            output = f.read()
        printed = re.findall(r"^suite CPU time: ([\d.]+) CPU-minutes", output, re.MULTILINE)
        assert printed, f"{path} holds no 'suite CPU time' line"
        assert figure == printed[-1], f"the README says {figure} CPU-minutes, {path} says {printed[-1]}"
        # The machine beside the figure is the one the output names (its last session's line).
        named = re.findall(r"^  on (.+), (\d+) cores, ([\w+]*); read bandwidth (\d+) GB/s", output, re.MULTILINE)
        assert named, f"{path} names no machine"
        cpu, cores, isa, rate = named[-1]
        widest = _ISA_NAMES.get(isa.split("+")[-1], "no AVX2")
        for part in (f"{cores}-core {cpu}", widest, f"{rate} GB/s"):
            assert part in machine, f"the README's machine ({machine.strip()}) lacks {part!r}, which {path} names"
