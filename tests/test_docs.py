"""Every code example in README.md and docs/*.md runs, or is checked against the code it names.

The rules, one per kind of example (a block no rule handles fails the test, named by file and line):

- ```python: executed in this process when listed in :data:`RUN`, after the CPU substitutions listed
  there (the only edits made; each must still match the doc); every other block is checked without
  running: each import resolves, each name it reads from an imported module exists, and each call of
  an imported callable (or a method of an instance made from one) binds its arguments to the current
  signature (``inspect.signature(...).bind_partial``).
- ```bash / ```shell blocks, and inline `` `fpdt-train ...` ``, `` `python -m lightning_fpdt.memory ...` ``,
  `` `python benchmarks/...` `` and `` `pip install ...` `` spans in prose: each command by its program:
  ``fpdt-train`` parses with the CLI's own parser (``--print_config``; config files must exist),
  ``fpdt-export`` parses with its own parser,
  ``python -m lightning_fpdt.memory`` runs (analytic, cheap; its own parser checks the flags)
  or, when listed in :data:`MEMORY_NOT_RUN`, only parses; ``python benchmarks/X.py`` is parsed by X's own
  parser and stopped there; ``pip install`` names only extras and dependencies pyproject.toml defines,
  ``pytest -m`` only markers it defines, ``python -c`` code is checked as a python block; venv lines
  and the tools in :data:`TOOLS` are accepted.
- ```yaml: parsed; the keys under ``trainer`` bind to ``lightning.Trainer``, every ``class_path``
  imports and its ``init_args`` bind to that class's signature.
- ```text: program output, diagrams and pseudocode: not code, nothing to run.

Links: every relative link ``[...](page.md#anchor)`` outside code names a file that exists and, with an anchor,
a heading of that page (GitHub's anchors); every ``docs/<page>.md`` named in prose exists; and the index,
docs/README.md, links every page of docs/.

docs/own-model.md's example is trained by tests/test_own_model.py; here it is checked like any
block that is not run.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib
import importlib.util
import inspect
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from lightning_fpdt.cli import main as cli_main
from lightning_fpdt.evaluation.command import main as eval_main
from lightning_fpdt.export import main as export_main
from lightning_fpdt.memory.__main__ import main as memory_main

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash", "shell", "yaml", "text")

# python blocks that run here, found by a line of theirs, with the substitutions that size them for
# one CPU process and a few steps (each pair must occur in the block)
RUN: dict[tuple[str, str], list[tuple[str, str]]] = {
    ("docs/getting-started.md", "data = PasskeyDataModule(seq_len=256"): [
        ("devices=2, max_steps=60,", "devices=1, max_steps=2,"),
        ("batch_size=32,", "batch_size=2,"),
        ("sequence_parallel_size=2, chunk_size=128", "sequence_parallel_size=1, chunk_size=128"),
    ],
}
# placeholders in shell commands that stand for the reader's own files
TINY = "examples/configs/tiny_cpu.yaml"
PLACEHOLDERS = {"my.yaml": TINY}
# memory-CLI commands that are checked (flags, config file) but not run, with the reason
MEMORY_NOT_RUN = {
    "examples/configs/hf_llama_gpu.yaml": "its model is the reader's local Llama-3-8B checkpoint",
}
TOOLS = {"tensorboard"}  # programs a doc may run that this project does not define (must be dependencies)


@dataclass(frozen=True)
class Example:
    """One code example: ``lang`` is the fence's language, or ``inline`` for a command in prose."""

    path: str
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def examples() -> list[Example]:
    """Every fenced block and every inline command of the docs, in file order."""
    found = []
    for file in DOC_FILES:
        rel = str(file.relative_to(ROOT))
        lines = file.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
            if fence is None:
                found += _inline_commands(rel, i + 1, lines[i])
                i += 1
                continue
            indent, lang, start = len(fence.group(1)), fence.group(2), i + 1
            i += 1
            body = []
            while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
                body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"{rel}:{start}: a code fence that is never closed")
            found.append(Example(rel, start, lang or "(none)", "\n".join(body)))
            i += 1
    return found


_INLINE = re.compile(r"`((?:fpdt-train |fpdt-eval |python3? -m lightning_fpdt\.memory|python3? benchmarks/|"
                     r"pip install )[^`]*)`")


def _inline_commands(path: str, line: int, text: str) -> list[Example]:
    return [Example(path, line, "inline", m.group(1)) for m in _INLINE.finditer(text)]


def indented_code(file: Path) -> list[str]:
    """Lines of 4-space-indented code blocks (after a blank line, outside lists and fences): they escape
    the checks, so they are refused."""
    out, in_fence, previous = [], False, ""
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if re.match(r"^\s*```", line):
            in_fence = not in_fence
        elif not in_fence and previous.strip() == "" and line.startswith("    ") and line.strip():
            out.append(f"{file.relative_to(ROOT)}:{n}: {line.strip()}")
        previous = line
    return out


# ---- python ------------------------------------------------------------------------------------------


class _Instance:
    """A variable known to hold an instance of ``cls`` (from ``x = cls(...)`` or ``x = cls.factory(...)``)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls


def _import(module: str, name: str | None = None) -> Any:
    mod = importlib.import_module(module)
    if name is None:
        return mod
    if hasattr(mod, name):
        return getattr(mod, name)
    return importlib.import_module(f"{module}.{name}")  # a submodule


def check_python_statically(code: str, where: str) -> int:
    """Resolve the imports and bind every resolvable call of ``code``; returns how many calls were bound."""
    tree = ast.parse(code)
    names: dict[str, Any] = {}
    bound = 0

    def resolve(node: ast.AST) -> Any:
        if isinstance(node, ast.Name):
            return names.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = resolve(node.value)
            if owner is None:
                return None
            if isinstance(owner, _Instance):
                assert hasattr(owner.cls, node.attr), f"{where}: {owner.cls.__name__} has no attribute {node.attr!r}"
                return _Method(owner.cls, node.attr)
            assert hasattr(owner, node.attr), f"{where}: {getattr(owner, '__name__', owner)} has no {node.attr!r}"
            return getattr(owner, node.attr)
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:  # `import a.b` binds a, `import a.b as c` binds a.b
                module = importlib.import_module(alias.name)
                names[alias.asname or alias.name.split(".")[0]] = module if alias.asname else _import(
                    alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name] = _import(node.module or "", alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1:
            made = resolve(node.value.func)
            cls = made if inspect.isclass(made) else getattr(made, "__self__", None)
            # transformers' Auto* classes make instances of other classes (AutoTokenizer.from_pretrained: a
            # PreTrainedTokenizerFast): what they return is not known here
            if inspect.isclass(cls) and isinstance(node.targets[0], ast.Name) and not cls.__name__.startswith("Auto"):
                names[node.targets[0].id] = _Instance(cls)
        if not isinstance(node, ast.Call):
            continue
        target = resolve(node.func)
        if target is None or isinstance(target, _Instance):
            continue
        signature, skip_self = (target.signature() if isinstance(target, _Method) else (_signature(target), False))
        if signature is None:
            continue
        args = [None] * (len(node.args) + skip_self) if not any(isinstance(a, ast.Starred) for a in node.args) else []
        kwargs = {k.arg: None for k in node.keywords if k.arg is not None}
        try:
            signature.bind_partial(*args, **kwargs)
            unknown = set(kwargs) - _keywords(target.cls if isinstance(target, _Method) else target, signature)
            if unknown:
                raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}, passed on through **kwargs")
        except TypeError as err:
            raise AssertionError(f"{where}: {ast.unparse(node)[:120]} does not fit {signature}: {err}") from None
        bound += 1
    return bound


# where a class's **kwargs go, for classes whose whole chain of __init__s ends in **kwargs
FORWARDED_KWARGS = {"DDPStrategy": "torch.nn.parallel.DistributedDataParallel"}


def _keywords(target: Any, signature: inspect.Signature) -> set[str] | Any:
    """The keyword names ``target`` accepts: its own, and for a class with ``**kwargs`` those of the base
    classes' ``__init__`` it passes them to (and where those forward theirs); everything when unknown."""
    def named(sig: inspect.Signature) -> tuple[set[str], bool]:
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return ({n for n, p in sig.parameters.items() if p.kind in kinds},
                any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()))

    names, open_ = named(signature)
    if not open_:
        return names
    if not inspect.isclass(target):
        return _Everything()
    for base in target.__mro__[1:]:
        if "__init__" not in vars(base):
            continue
        more, open_ = named(inspect.signature(base.__init__))
        names |= more
        if base.__name__ in FORWARDED_KWARGS:
            module, _, name = FORWARDED_KWARGS[base.__name__].rpartition(".")
            more, open_ = named(inspect.signature(_import(module, name)))
            names |= more
        if not open_:
            return names
    return _Everything()


class _Everything:
    """The accepted keywords of a callable whose ``**kwargs`` go somewhere this test cannot follow."""

    def __rsub__(self, other: set[str]) -> set[str]:
        return set()


class _Method:
    """``instance.attr`` for a variable known to hold an instance of ``cls``."""

    def __init__(self, cls: type, attr: str) -> None:
        self.cls, self.attr = cls, attr

    def signature(self) -> tuple[inspect.Signature | None, bool]:
        raw = inspect.getattr_static(self.cls, self.attr)
        function = getattr(self.cls, self.attr)
        plain = inspect.isfunction(raw)  # called on an instance: self is bound
        return _signature(function), plain


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature
        return None


def run_python(example: Example, substitutions: list[tuple[str, str]], tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> None:
    code = example.text
    for old, new in substitutions:
        assert old in code, f"{example.where}: the substitution {old!r} no longer matches the doc: update RUN"
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, example.where, "exec"), {"__name__": "__doc_example__"})


# ---- shell -------------------------------------------------------------------------------------------


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _dependency_names() -> set[str]:
    project = _pyproject()["project"]
    specs = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    return {re.split(r"[<>=!\[ ;]", s, maxsplit=1)[0].lower() for s in specs}


def _split_substitutions(line: str) -> tuple[str, list[str]]:
    """``line`` with each ``$(...)`` replaced by a placeholder word, and the commands inside them."""
    inner, out, i = [], [], 0
    while i < len(line):
        if line.startswith("$(", i):
            depth, j = 1, i + 2
            while depth and j < len(line):
                depth += {"(": 1, ")": -1}.get(line[j], 0)
                j += 1
            inner.append(line[i + 2:j - 1])
            out.append("SUBSTITUTED")
            i = j
        else:
            out.append(line[i])
            i += 1
    return "".join(out), inner


def shell_commands(text: str) -> Iterator[list[str]]:
    """Each simple command of a shell snippet as its words (continuations joined, comments dropped,
    ``&&`` / ``;`` / ``||`` split, ``$(...)`` yielded as commands of their own)."""
    for line in text.replace("\\\n", " ").splitlines():
        line, inner = _split_substitutions(line)
        for command in inner:
            yield from shell_commands(command)
        words: list[str] = []
        for word in shlex.split(line, comments=True):
            if word in ("&&", ";", "||"):
                if words:
                    yield words
                words = []
            else:
                words.append(word)
        if words:
            yield words


class _Parsed(Exception):
    """Raised by the patched ``ArgumentParser.parse_args``: the arguments parsed, the program stops there."""


def parse_only(main: Any, argv: list[str], program: str, where: str, monkeypatch: pytest.MonkeyPatch,
               capsys: pytest.CaptureFixture) -> None:
    """Run ``main``'s own argparse parser on ``argv`` (flags, values, choices) and stop before its work."""
    original = argparse.ArgumentParser.parse_args

    def parse(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        original(self, args, namespace)
        raise _Parsed

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse)
        patch.setattr(sys, "argv", [program, *argv])
        try:
            main(argv) if inspect.signature(main).parameters else main()
        except _Parsed:
            return
        except SystemExit:
            raise AssertionError(f"{where}: {program} {' '.join(argv)}: {capsys.readouterr().err.strip()}") from None
    raise AssertionError(f"{where}: {program} never parsed its arguments")


def _benchmark_main(script: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_doc_benchmark_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def check_fpdt_train(words: list[str], where: str, monkeypatch: pytest.MonkeyPatch,
                     capsys: pytest.CaptureFixture, parse: bool = True) -> None:
    args, skip = [], False
    for i, word in enumerate(words[1:]):
        if skip:
            skip = False
            continue
        if word == "--ckpt_path":  # read when fitting, not when parsing
            skip = True
            continue
        if word.startswith("--ckpt_path="):
            continue
        args.append(PLACEHOLDERS.get(word, word))
        if i > 0 and words[i] in ("--config", "-c") and parse:
            assert (ROOT / args[-1]).is_file(), f"{where}: config file {args[-1]} does not exist"
    assert args and args[0] in ("fit", "validate", "test", "predict"), f"{where}: fpdt-train {args[:1]}"
    if not parse:
        return
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["fpdt-train", *args, "--print_config"])
    with pytest.raises(SystemExit) as exit_:
        cli_main()
    out = capsys.readouterr()
    assert exit_.value.code in (0, None), f"{where}: fpdt-train {' '.join(args)}:\n{out.err[-2000:]}"


def check_fpdt_eval(words: list[str], where: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                    parse: bool = True) -> None:
    """``fpdt-eval ARGS``: its config files exist and LightningCLI parses the rest (``--print_config``), the
    checkpoint left out (read when validating, not when parsing)."""
    args = [w for i, w in enumerate(words[1:]) if w != "--ckpt_path" and words[i] != "--ckpt_path"
            and not w.startswith("--ckpt_path=")]
    for i, word in enumerate(args[:-1]):
        if word in ("--config", "-c"):
            assert (ROOT / args[i + 1]).is_file(), f"{where}: config file {args[i + 1]} does not exist"
    if not parse:
        return
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["fpdt-eval"])
    with pytest.raises(SystemExit) as exit_:
        eval_main([*args, "--print_config"])
    out = capsys.readouterr()
    assert exit_.value.code in (0, None), f"{where}: fpdt-eval {' '.join(args)}:\n{out.err[-2000:]}"


def check_memory_cli(words: list[str], where: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                     run: bool = True) -> None:
    argv = words[3:]
    configs = [argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "--config"]
    if not run:
        return
    for config in configs:
        assert (ROOT / config).is_file(), f"{where}: config file {config} does not exist"
    argv = [str(ROOT / a) if a in configs else a for a in argv]
    if any(c in MEMORY_NOT_RUN for c in configs):
        parse_only(memory_main, argv, "python -m lightning_fpdt.memory", where, monkeypatch, capsys)
        return
    try:
        memory_main(argv)
    except SystemExit as exit_:
        raise AssertionError(f"{where}: python -m lightning_fpdt.memory {' '.join(words[3:])}: {exit_}"
                             f" {capsys.readouterr().err.strip()}") from None
    assert "device peak" in capsys.readouterr().out, where


def check_pip(words: list[str], where: str) -> None:
    extras = set(_pyproject()["project"]["optional-dependencies"])
    dependencies = _dependency_names()
    for word in words[2:]:
        if word.startswith("-"):
            continue
        named = re.match(r"^(?P<name>[^\[=<>]*)(\[(?P<extras>[^\]]*)\])?", word)
        assert named is not None, where
        for extra in filter(None, (named.group("extras") or "").split(",")):
            assert extra in extras, f"{where}: pip extra {extra!r} is not in pyproject.toml ({sorted(extras)})"
        name = named.group("name").lower()
        assert name in (".", "lightning-fpdt") or name in dependencies, f"{where}: {name!r} is not a dependency"


def _abbreviated(words: list[str]) -> bool:
    """A command written with placeholders (``...``, ``<yaml>``, a last flag without its value): its program,
    flags and files are checked, but it is not parsed or run."""
    return any(w == "..." or re.fullmatch(r"<[^>]+>", w) for w in words) or words[-1] in ("--config", "-c")


def check_command(words: list[str], where: str, monkeypatch: pytest.MonkeyPatch,
                  capsys: pytest.CaptureFixture) -> str:
    """Check one command; returns the rule that handled it."""
    program = words[0]
    if program in ("python", "python3") and words[1:3] == ["-m", "venv"] or program in (".", "source"):
        assert program in ("python", "python3") or words[1].endswith("bin/activate"), where
        return "venv"
    if program == "pip":
        check_pip(words, where)
        return "pip"
    if program == "fpdt-train":
        check_fpdt_train(words, where, monkeypatch, capsys, parse=not _abbreviated(words))
        return "fpdt-train"
    if program in ("python", "python3") and words[1:3] == ["-m", "lightning_fpdt.memory"]:
        check_memory_cli(words, where, monkeypatch, capsys, run=not _abbreviated(words))
        return "memory"
    if program in ("python", "python3") and len(words) > 1 and words[1].startswith("benchmarks/"):
        script = ROOT / words[1]
        assert script.is_file(), f"{where}: {words[1]} does not exist"
        if not _abbreviated(words):
            parse_only(_benchmark_main(script), words[2:], words[1], where, monkeypatch, capsys)
        return "benchmark"
    if program in ("python", "python3") and words[1:3] == ["-m", "pytest"]:
        markers = {m.split(":")[0] for m in _pyproject()["tool"]["pytest"]["ini_options"]["markers"]}
        if "-m" in words[3:]:
            expression = words[words.index("-m", 3) + 1]
            used = set(re.findall(r"\w+", expression)) - {"not", "and", "or"}
            assert used <= markers, f"{where}: pytest markers {used - markers} are not defined in pyproject.toml"
        return "pytest"
    if program in ("python", "python3") and words[1] == "-c":
        check_python_statically(words[2], where)
        return "python -c"
    if program == "fpdt-export":
        parse_only(export_main, words[1:], program, where, monkeypatch, capsys)
        return "fpdt-export"
    if program == "fpdt-eval":
        check_fpdt_eval(words, where, monkeypatch, capsys, parse=not _abbreviated(words))
        return "fpdt-eval"
    if program in ("python", "python3") and len(words) > 1 and re.fullmatch(r"examples/[\w/]+\.py", words[1]):
        script = ROOT / words[1]
        assert script.is_file(), f"{where}: {words[1]} does not exist"
        if not _abbreviated(words):
            parse_only(_benchmark_main(script), words[2:], words[1], where, monkeypatch, capsys)
        return "example script"
    if program in TOOLS:
        assert program in _dependency_names(), f"{where}: {program} is not a dependency"
        return "tool"
    raise AssertionError(f"{where}: no rule checks the command {' '.join(words)!r}")


# ---- yaml --------------------------------------------------------------------------------------------


def check_yaml(text: str, where: str) -> int:
    document = yaml.safe_load(text)
    checked = 0
    if "trainer" in document:
        inspect.signature(L.Trainer).bind_partial(**document["trainer"])
        checked += 1

    def walk(node: Any) -> None:
        nonlocal checked
        if isinstance(node, dict):
            if "class_path" in node:
                module, _, name = node["class_path"].rpartition(".")
                cls = _import(module, name)
                init_args, signature = node.get("init_args", {}), inspect.signature(cls)
                try:
                    signature.bind_partial(**init_args)
                    unknown = set(init_args) - _keywords(cls, signature)
                    if unknown:
                        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}")
                except TypeError as err:
                    raise AssertionError(f"{where}: init_args of {node['class_path']}: {err}") from None
                checked += 1
            for value in node.values():
                walk(value)

    walk(document)
    return checked


# ---- links -------------------------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_PAGE_NAMED = re.compile(r"\bdocs/[\w-]+\.md\b")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code spans (links and page names there are code)."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if re.match(r"^\s*```", line):
            in_fence = not in_fence
        elif not in_fence:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def anchors(file: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``file``: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in file.read_text().splitlines():
        if re.match(r"^\s*```", line):
            in_fence = not in_fence
            continue
        heading = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(file: Path) -> list[str]:
    """Each link of ``file`` to a missing file or heading, and each ``docs/<page>.md`` it names that does not exist."""
    text = _prose(file.read_text())
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = (file.parent / path).resolve() if path else file
        if not dest.exists():
            broken.append(f"{file.name}: ({target}): no file {path}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{file.name}: ({target}): {dest.name} has no heading with the anchor #{anchor}")
    for name in _PAGE_NAMED.findall(file.read_text()):
        if not (ROOT / name).is_file():
            broken.append(f"{file.name}: names {name}, which does not exist")
    return broken


# ---- the tests ---------------------------------------------------------------------------------------

ALL = examples()


def _id(example: Example) -> str:
    return f"{example.where}-{example.lang}"


def test_every_example_has_a_rule() -> None:
    unknown = [f"{e.where} (```{e.lang})" for e in ALL if e.lang not in (*LANGUAGES, "inline")]
    assert not unknown, "code blocks no rule handles (give each a language: " + ", ".join(LANGUAGES) + "):\n" + \
        "\n".join(unknown)
    indented = [line for file in DOC_FILES for line in indented_code(file)]
    assert not indented, "indented code blocks escape the checks; fence them:\n" + "\n".join(indented)
    for path, marker in RUN:
        assert any(e.path == path and e.lang == "python" and marker in e.text for e in ALL), (
            f"RUN lists a block of {path} with {marker!r} that no longer exists: update RUN"
        )


@pytest.mark.parametrize("example", [e for e in ALL if e.lang == "python"], ids=_id)
def test_python_example(example: Example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = [subs for (path, marker), subs in RUN.items() if path == example.path and marker in example.text]
    if run:
        run_python(example, run[0], tmp_path, monkeypatch)
    assert check_python_statically(example.text, example.where) > 0, f"{example.where}: no call could be checked"


@pytest.mark.parametrize("example", [e for e in ALL if e.lang in ("bash", "shell", "inline")], ids=_id)
def test_shell_example(example: Example, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    commands = list(shell_commands(example.text))
    assert commands, f"{example.where}: an empty shell block"
    for words in commands:
        check_command(words, example.where, monkeypatch, capsys)


@pytest.mark.parametrize("example", [e for e in ALL if e.lang == "yaml"], ids=_id)
def test_yaml_example(example: Example) -> None:
    assert check_yaml(example.text, example.where) > 0, f"{example.where}: nothing in it names a class"


def test_the_checks_catch_drift(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Each rule fails on the drift it exists for (a doc check that cannot fail checks nothing)."""
    with pytest.raises(AssertionError, match="does not fit"):
        check_python_statically("from lightning_fpdt import FPDTStrategy\nFPDTStrategy(chunk_sise=4)", "x")
    with pytest.raises(AssertionError, match="does not fit"):
        check_python_statically("from lightning_fpdt.data import PasskeyDataModule\nPasskeyDataModule(seq_lenx=8)", "x")
    check_python_statically("from lightning_fpdt import FPDTStrategy\nFPDTStrategy(timeout=None, bucket_cap_mb=4)", "x")
    with pytest.raises(AssertionError, match="has no 'no_such_method'"):
        check_python_statically("from lightning_fpdt.models import Llama\nLlama.no_such_method()", "x")
    with pytest.raises(AssertionError, match="LlamaLM has no attribute 'to_hf_v2'"):
        check_python_statically("from lightning_fpdt.models import LlamaLM\nm = LlamaLM(None)\nm.to_hf_v2()", "x")
    with pytest.raises(ModuleNotFoundError):
        check_python_statically("from lightning_fpdt.no_such_module import X", "x")
    for command, match in [
        ("python benchmarks/training.py --seqs 128", "unrecognized arguments: --seqs 128"),
        ("python benchmarks/training.py --variants fpdt_fast", "invalid choice: 'fpdt_fast'"),
        ("pip install -e '.[gpu]'", "pip extra 'gpu' is not in pyproject.toml"),
        ("python -m pytest -m 'not slow'", "markers {'slow'} are not defined"),
        ("python -m lightning_fpdt.memory --sequence 8", "unrecognized arguments: --sequence 8"),
        ("fpdt-train fit --config examples/configs/no_such.yaml", "config file examples/configs/no_such.yaml does not"),
        (f"fpdt-train fit --config {TINY} --trainer.strategy.init_args.chunk_sise=4", "chunk_sise"),
        ("make docs", "no rule checks the command"),
    ]:
        with pytest.raises(AssertionError, match=re.escape(match)):
            for words in shell_commands(command):
                check_command(words, "x", monkeypatch, capsys)
    with pytest.raises(AssertionError, match="init_args of lightning_fpdt.FPDTStrategy"):
        check_yaml("trainer:\n  strategy:\n    class_path: lightning_fpdt.FPDTStrategy\n    init_args:\n"
                   "      chunk_sise: 4\n", "x")


def _what_is_where() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## What is where")
    return readme[start:readme.index("\n## ", start + 1) if "\n## " in readme[start + 1:] else len(readme)]


def test_the_readme_table_names_every_module() -> None:
    """README's "What is where" table is the map of the package: every module file is named in it (by its
    path, its file name in a row that starts with its folder, or a pattern such as ``hf_*.py``)."""
    table = _what_is_where()
    named = set(re.findall(r"`([^`\s]+\.py)`", table))
    missing = []
    for path in sorted((ROOT / "lightning_fpdt").rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(ROOT).as_posix()
        if not any(fnmatch.fnmatch(rel, name) or fnmatch.fnmatch(path.name, name) for name in named):
            missing.append(rel)
    assert not missing, f"README's 'What is where' table names no row for {missing}"


def test_every_link_resolves() -> None:
    """Links between the pages (and to a heading of a page) survive pages being split, renamed or retitled."""
    broken = [line for file in DOC_FILES for line in broken_links(file)]
    assert not broken, "broken links in the docs:\n" + "\n".join(broken)


def test_the_docs_index_lists_every_page() -> None:
    """docs/README.md is the way into the docs: it links every page, so a new page is found in the reading order."""
    index = ROOT / "docs" / "README.md"
    targets = _LINK.findall(_prose(index.read_text()))
    linked = {(index.parent / target.partition("#")[0]).resolve() for target in targets}
    pages = {page.resolve() for page in (ROOT / "docs").glob("*.md")} - {index.resolve()}
    missing = sorted(page.name for page in pages - linked)
    assert not missing, f"docs/README.md links no line for {missing}"


def test_the_link_check_catches_broken_links(tmp_path: Path) -> None:
    """A link to a missing page, to a heading a page does not have, or a missing docs/ page named in prose, is found."""
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## Loading a checkpoint (`HFCausalLM`)\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#loading-a-checkpoint-hfcausallm) [ok](other.md#twice-1) [self](#a-page)\n"
                    "# A page\n[gone](gone.md) [no heading](other.md#exporting) see docs/no-such-page.md\n"
                    "```python\nx = [1](2)\n```\n")
    assert broken_links(page) == [
        "page.md: (gone.md): no file gone.md",
        "page.md: (other.md#exporting): other.md has no heading with the anchor #exporting",
        "page.md: names docs/no-such-page.md, which does not exist",
    ]
