"""README.md and docs/ stay readable and true to the code: the README short, no table cell a wall of
text, every relative link and anchor resolving, every --flag they name known to pretrain_gpt.py's
parser or written in some script, and every script or package file they name present."""

import glob
import os
import re

from megatron_zpp.config.arguments import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
NOT_OURS = {"--flag", "--nodes"}  # a placeholder in docs/megatron_compat.md; sbatch's own flag
MEGATRON_LM_FILES = {  # Megatron-LM's example scripts, whose argument lists tests/fixtures/ holds
    "examples/llama/train_llama3_8b_h100_fp8.sh",
    "examples/gpt3/train_gpt3_175b_distributed.sh",
    "examples/mixtral/train_mixtral_8x7b_distributed.sh",
    "examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh",
}


def read(page):
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def anchors(page):
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = [line.lstrip("#").strip().lower() for line in read(page).split("\n") if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h).replace(" ", "-") for h in heads}


def code_sources():
    paths = ["pretrain_gpt.py", "Dockerfile"]
    for pattern in (
        "megatron_zpp/**/*.py",
        "tools/**/*.py",
        "tools/*.sh",
        "bench/**/*.py",
        "bench/*.sh",
        "examples/**/*",
    ):
        paths += glob.glob(os.path.join(ROOT, pattern), recursive=True)
    text = []
    for path in paths:
        path = os.path.join(ROOT, path)
        if os.path.isfile(path) and path.endswith((".py", ".sh", ".sbatch", "Dockerfile")):
            with open(path, errors="replace") as f:
                text.append(f.read())
    return "\n".join(text)


def test_readme_is_short_and_no_table_cell_is_a_wall_of_text():
    assert len(read("README.md").split("\n")) <= 250
    for page in PAGES:
        for n, line in enumerate(read(page).split("\n"), 1):
            if line.startswith("|"):
                longest = max(len(cell) for cell in line.strip().strip("|").split(" | "))
                assert longest <= 200, (
                    f"{page}:{n}: a table cell of {longest} characters; move the detail below the table"
                )


def test_links_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", read(page)):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert os.path.exists(os.path.join(ROOT, linked)), f"{page}: link to {target}: no such file"
            if anchor and linked.endswith(".md"):
                assert anchor in anchors(linked), f"{page}: link to {target}: no such heading"


def test_every_flag_named_exists():
    parser_flags = {s for action in build_parser()._actions for s in action.option_strings}
    sources = code_sources()
    for page in PAGES:
        for flag in sorted(set(FLAG.findall(read(page))) - NOT_OURS):
            assert flag in parser_flags or flag in sources, f"{page} names {flag}, which no parser or script has"


def test_every_named_file_exists():
    pattern = re.compile(r"`((?:megatron_zpp|tools|bench|examples|tests)/[\w./-]+\.(?:py|sh|yaml|sbatch|json))`")
    for page in PAGES:
        for path in set(pattern.findall(read(page))) - MEGATRON_LM_FILES:
            assert os.path.exists(os.path.join(ROOT, path)), f"{page} names {path}, which does not exist"
