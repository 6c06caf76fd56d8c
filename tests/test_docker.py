"""The Dockerfile's rules, read from its text (no docker or hadolint here): a pinned NVIDIA PyTorch
base, the image's torch kept (its stack pinned, never installed by us), every dependency of ours
installed, and a build context without environments, data, runs or .git."""

import fnmatch
import os
import re
import shlex

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_STACK = {"torch", "torchvision", "torchaudio", "triton", "pytorch-triton"}  # the image's


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, continuation lines joined."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            logical.append(current.strip())
            current = ""
    return [(s.split(None, 1)[0].upper(), s.split(None, 1)[1]) for s in logical]


def pip_installs(instrs) -> list[list[str]]:
    """The argument lists of every `pip install` command in the RUN instructions."""
    found = []
    for kind, args in instrs:
        if kind != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, "&&"]:  # commands end at &&, ||, ; and |
            if token not in ("&&", "||", ";", "|"):
                command.append(token)
                continue
            if "pip" in command and "install" in command:
                found.append(command[command.index("install") + 1 :])
            command = []
    return found


def requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0].lower().replace("_", "-")


def test_dockerfile_keeps_the_images_torch_and_installs_our_dependencies():
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        instrs = instructions(f.read())
    assert instrs[0][0] == "FROM"
    image, _, tag = instrs[0][1].partition(":")
    assert image == "nvcr.io/nvidia/pytorch" and re.fullmatch(r"\d\d\.\d\d-py3", tag), instrs[0]

    installs = pip_installs(instrs)
    assert installs, "no pip install in the Dockerfile"
    installed = set()
    for args in installs:
        assert "--no-cache-dir" in args, args
        names = {requirement_name(a) for a in args if not a.startswith("-") and a != "."}
        names -= {requirement_name(a) for a, flag in zip(args[1:], args) if flag == "-c"}  # the constraints file
        assert not names & TORCH_STACK, f"pip install would touch the image's torch stack: {args}"
        # what may resolve dependencies sticks to the image's pins; our own package goes in without its own
        assert "--no-deps" in args or "-c" in args, args
        installed |= names
    run_text = " ".join(args for kind, args in instrs if kind == "RUN")
    assert "pip list --format=freeze" in run_text and "torch|" in run_text  # the pins come from the image
    assert "grep -qi '^torch=='" in run_text  # and hold torch, or the build stops

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    ours = project["dependencies"] + [
        d for extra in ("data", "logging", "dev") for d in project["optional-dependencies"][extra]
    ]
    lint_tools = {"ruff", "mypy", "pre-commit", "pre-commit-hooks", "types-pyyaml", "types-tqdm"}  # not for the image
    wanted = {requirement_name(d) for d in ours} - TORCH_STACK - lint_tools
    assert wanted <= installed, f"missing from the image: {sorted(wanted - installed)}"
    assert "transformers" in installed


def test_dockerignore_keeps_environments_data_runs_and_git_out_of_the_context():
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        patterns = [p.strip() for p in f if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:  # docker's rule: a pattern matches the path or a folder above it
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(
            fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/")) for p in prefixes for pat in patterns
        )

    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "data_cache/demo/x.bin",
        "runs/resume/ckpt/latest",
        "megatron_zpp/__pycache__/config.cpython-311.pyc",
        ".pytest_cache/v",
        "wandb/run-1/x",
    ):
        assert ignored(path), path
    for path in (
        "pyproject.toml",
        "README.md",
        "megatron_zpp/data/indexed_dataset.py",
        "pretrain_gpt.py",
        "examples/slurm/gpt1.3b_zeropp.sbatch",
        "tools/preprocess_data.py",
    ):
        assert not ignored(path), path
