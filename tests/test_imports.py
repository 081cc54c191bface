"""The package's import graph: the folders' order (no import reaches up to a later layer of :data:`LAYERS`), no
circle, no unexplained import inside a function, no module over 380 lines, and the layers that must stay light (the
strategy loads no bundled model; configuration and the binding contract load no attention pipeline).

The graph is read from the source (``ast``), not by importing: an edge ``a -> b`` is an import of ``b`` that
runs when ``a`` is imported (module level, class bodies and ``if TYPE_CHECKING:`` blocks included: a circle
hidden from the interpreter is still a circle in the design). ``from p import name`` is an edge to the module
``p.name`` when there is one, else to ``p``. Importing ``p.q`` also runs the package ``p``'s ``__init__``;
that is not an edge of its own (a package's ``__init__`` importing its own modules is no circle), and the
light-layer checks below import the modules for real, in a fresh interpreter, to catch what it loads. A module of
the package looked up by name (``importlib.import_module("lightning_fpdt...")``, ``__import__``, or
``optional.require``, with the name a string literal) is an edge too, as a deferred import.
"""

from __future__ import annotations

import ast
import io
import pkgutil
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

PACKAGE = "lightning_fpdt"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
REASONS = ("cycle", "circular", "optional")  # what a comment must name to explain an import inside a function


def package_modules() -> dict[str, Path]:
    """``{module name: source file}`` of every module of the package, found with ``pkgutil`` (nothing imported)."""
    modules = {PACKAGE: ROOT / "__init__.py"}

    def walk(path: Path, prefix: str) -> None:
        for info in pkgutil.iter_modules([str(path)]):
            name = f"{prefix}.{info.name}"
            if info.ispkg:
                modules[name] = path / info.name / "__init__.py"
                walk(path / info.name, name)
            else:
                modules[name] = path / f"{info.name}.py"

    walk(ROOT, PACKAGE)
    return modules


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The package modules ``node`` imports."""
    found = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            # `import a.b.c` imports a.b.c (and runs a, a.b): the deepest module of the package named
            for end in range(len(parts), 0, -1):
                if ".".join(parts[:end]) in known:
                    found.add(".".join(parts[:end]))
                    break
        return found
    base = _absolute(module, is_package, node)
    for alias in node.names:
        target = f"{base}.{alias.name}"
        if target in known:
            found.add(target)
        elif base in known:
            found.add(base)
    return found


_BY_NAME = {"import_module", "__import__", "require"}  # functions that import the module a string names


def _by_name(tree: ast.AST, known: set[str]) -> set[str]:
    """The package modules ``tree`` looks up by a literal name (the deepest known module the name starts with)."""
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        name = node.args[0].value
        if func in _BY_NAME and name.split(".")[0] == PACKAGE:
            parts = name.split(".")
            found |= {next(".".join(parts[:end]) for end in range(len(parts), 0, -1) if ".".join(parts[:end]) in known)}
    return found


def _function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    inside = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside += [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return inside


def import_graph(deferred_too: bool = False) -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """``({module: modules it imports}, [(module, line, import) inside a function])``: the imports that run when a
    module is imported, and with ``deferred_too`` also those inside its functions (a circle through a deferred
    import is a circle in the design all the same)."""
    modules = package_modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    in_functions = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        deferred = {id(n) for n in _function_imports(tree)}
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if id(node) in deferred:
                    in_functions.append((name, node.lineno, ast.unparse(node)))
                if id(node) not in deferred or deferred_too:
                    graph[name] |= _targets(name, is_package, node, known) - {name}
        if deferred_too:
            graph[name] |= _by_name(tree, known) - {name}
    return graph, in_functions


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan), as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_circle_in(graph, set(group)) for group in groups]


def _circle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(group)


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every package module importing ``start`` runs, through module-level imports."""
    seen, todo = {start}, [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


_HEADERS = ("try:", "if ", "elif ", "else:", "with ")  # block headers between an import and its comment


def _explained(path: Path, line: int) -> bool:
    """Whether the import on ``line`` has a comment naming why, on the line or in the comment lines just above
    it (block headers such as ``try:`` or ``if name == ...:`` between them are skipped)."""
    source = path.read_text()
    comments = {tok.start[0]: tok.string.lower() for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    candidates = [line]
    above = line - 1
    while above >= 1:
        text = lines[above - 1].strip()
        if not (text.startswith("#") or (text.startswith(_HEADERS) and text.endswith(":"))):
            break
        candidates.append(above)
        above -= 1
    return any(reason in comments.get(n, "") for n in candidates for reason in REASONS)


# The package's layers, from the floor up: a module may import its own layer and those before it, never one after.
# Each entry: its name and the modules or folders (relative to the package; "" is the package's own __init__) in it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("the floor", ("errors", "optional", "backends", "profiling")),
    ("offload", ("offload",)),
    ("parallel", ("parallel",)),
    ("attention", ("attention",)),
    ("layers", ("layers",)),
    ("configuration", ("options",)),
    ("models", ("models",)),
    ("memory", ("memory",)),
    ("hf", ("hf",)),
    ("data", ("data",)),
    ("checkpoints", ("checkpoints",)),
    ("strategy", ("strategy",)),
    ("export", ("export",)),
    ("entry points", ("cli", "callbacks", "testing")),
    ("evaluation", ("evaluation",)),
    ("the package", ("",)),
]
# The one import that reaches up on purpose, with why: the public path of HFCausalLM, imported on first use
UPWARD_BY_DESIGN = {
    (f"{PACKAGE}.models", f"{PACKAGE}.hf.causal_lm"):
        "lightning_fpdt.models.HFCausalLM, imported on first use (transformers is optional)",
}


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of a package module (its folder's, or its own at the root)."""
    relative = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if relative == member or (member and relative.startswith(member + ".")):
                return index
    raise AssertionError(f"{module} is in no layer of tests/test_imports.py's LAYERS: add it to one")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import from a module to one of a later layer, but those :data:`UPWARD_BY_DESIGN` allows."""
    return [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
            for a, targets in sorted(graph.items()) for b in sorted(targets)
            if layer_of(b) > layer_of(a) and (a, b) not in UPWARD_BY_DESIGN]


def test_the_graph_is_read_from_the_source() -> None:
    graph, _ = import_graph()
    assert f"{PACKAGE}.strategy.fpdt" in graph and f"{PACKAGE}.attention.pipeline" in graph
    assert f"{PACKAGE}.parallel.binding" in graph[f"{PACKAGE}.strategy.fpdt"]
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    by_name, _ = import_graph(deferred_too=True)  # models' __init__ names hf.causal_lm for optional.require
    assert f"{PACKAGE}.hf.causal_lm" in by_name[f"{PACKAGE}.models"] - graph[f"{PACKAGE}.models"]


def test_every_module_is_in_a_layer_and_no_import_reaches_up() -> None:
    """Deferred and by-name imports included; README's "What is where" lists the layers in this order."""
    graph, _ = import_graph(deferred_too=True)
    upward = upward_imports(graph)
    assert not upward, "imports from a layer to a later one (tests/test_imports.py LAYERS):\n" + "\n".join(upward)


def test_an_upward_import_fails_the_order() -> None:
    """Tried: the binding contract importing the strategy, or the offload floor the models, is caught."""
    graph = {f"{PACKAGE}.parallel.binding": {f"{PACKAGE}.strategy.fpdt"},
             f"{PACKAGE}.offload.tiling": {f"{PACKAGE}.models.llama", f"{PACKAGE}.offload.recompute"}}
    assert upward_imports(graph) == [
        f"{PACKAGE}.offload.tiling (offload) imports {PACKAGE}.models.llama (models)",
        f"{PACKAGE}.parallel.binding (parallel) imports {PACKAGE}.strategy.fpdt (strategy)",
    ]


def test_at_most_12_modules_at_the_root() -> None:
    root = sorted(p.stem for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= 12, f"{len(root)} modules at the root of {PACKAGE}/ (put the others in their layer): {root}"


def test_no_import_circle() -> None:
    """Counting the imports inside functions too: a comment explains a deferred import, it does not excuse a
    circle."""
    graph, _ = import_graph(deferred_too=True)
    circles = find_circles(graph)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_every_import_inside_a_function_says_why() -> None:
    modules = package_modules()
    _, in_functions = import_graph()
    unexplained = [f"{name}:{line}: {text}" for name, line, text in in_functions
                   if not _explained(modules[name], line)]
    assert not unexplained, (
        "imports inside functions without a comment (on the line, or just above) naming the import cycle or"
        " optional dependency they avoid:\n" + "\n".join(unexplained)
    )


@pytest.mark.parametrize(("module", "forbidden"), [
    ("parallel.binding", ("attention", "layers", "options", "memory", "models", "strategy")),
    ("options", ("attention.pipeline", "layers", "memory", "models", "strategy")),
    ("errors", ("",)),
])
def test_light_layers_import_little(module: str, forbidden: tuple[str, ...]) -> None:
    """From the source: the contract and the configuration reach none of the heavy layers."""
    graph, _ = import_graph()
    reached = closure(graph, f"{PACKAGE}.{module}") - {f"{PACKAGE}.{module}"}
    bad = sorted(m for m in reached for f in forbidden if m == f"{PACKAGE}.{f}".rstrip(".")
                 or m.startswith(f"{PACKAGE}.{f}".rstrip(".") + "."))
    assert not bad, f"{PACKAGE}.{module} imports {bad}"


def _loaded_by(statement: str) -> set[str]:
    """The package modules a fresh interpreter holds after ``statement`` (``lightning_fpdt`` itself stubbed,
    so its public ``__init__``, which imports the strategy, does not count)."""
    script = textwrap.dedent(f"""
        import sys, types
        package = types.ModuleType({PACKAGE!r})
        package.__path__ = [{str(ROOT)!r}]
        sys.modules[{PACKAGE!r}] = package
        {statement}
        print("\\n".join(m for m in sys.modules if m.startswith({PACKAGE + "."!r})))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(proc.stdout.split())


def test_the_strategy_loads_no_bundled_model() -> None:
    loaded = _loaded_by(f"import {PACKAGE}.strategy")
    assert f"{PACKAGE}.strategy" in loaded
    models = sorted(m for m in loaded if m.startswith(f"{PACKAGE}.models"))
    assert not models, f"importing {PACKAGE}.strategy loads {models}"


@pytest.mark.parametrize("module", ["options", "parallel.binding"])
def test_configuration_and_contract_load_no_attention_pipeline(module: str) -> None:
    loaded = _loaded_by(f"import {PACKAGE}.{module}")
    assert f"{PACKAGE}.{module}" in loaded
    heavy = sorted(loaded & {f"{PACKAGE}.layers.block", f"{PACKAGE}.attention.pipeline",
                             f"{PACKAGE}.attention.sources"})
    assert not heavy, f"importing {PACKAGE}.{module} loads {heavy}"


MAX_LINES = 380  # one job per module (issues 28, 41); a longer module holds two


def test_every_module_is_at_most_380_lines() -> None:
    lines = {name: len(path.read_text().splitlines()) for name, path in package_modules().items()}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split each into modules with one job): {long}"


def test_without_transformers_the_models_import_and_the_hf_features_name_the_install() -> None:
    """transformers is the extra ``hf``: without it (blocked in a fresh interpreter) the package and the bundled
    models import and train from a config; ``HFCausalLM`` and ``LlamaLM(hf_checkpoint=...)`` say how to install it."""
    script = textwrap.dedent("""
        import sys, tempfile

        class NotInstalled:  # transformers (and its submodules) cannot be found, as if not installed
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "transformers":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NotInstalled())
        import importlib.metadata as metadata  # its metadata too (what torchmetrics' RequirementCache reads)
        for getter in ("distribution", "version"):
            def missing(name, _real=getattr(metadata, getter)):
                if name == "transformers":
                    raise metadata.PackageNotFoundError(name)
                return _real(name)
            setattr(metadata, getter, missing)
        from lightning_fpdt.models import LlamaConfig, LlamaLM
        LlamaLM(LlamaConfig.tiny())
        hint = "pip install 'lightning-fpdt[hf]'"
        try:
            from lightning_fpdt.models import HFCausalLM
        except ModuleNotFoundError as err:
            assert hint in str(err) and "HFCausalLM" in str(err), err
        else:
            raise AssertionError("HFCausalLM imported without transformers")
        try:
            LlamaLM(hf_checkpoint=tempfile.mkdtemp())
        except ModuleNotFoundError as err:
            assert hint in str(err) and "LlamaLM(hf_checkpoint=...)" in str(err), err
        else:
            raise AssertionError("LlamaLM(hf_checkpoint=...) read a directory without transformers")
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=ROOT.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_hf_hint_names_the_python_its_releases_need() -> None:
    """transformers 5.24 on needs Python 3.11: on 3.10 ``pip install 'lightning-fpdt[hf]'`` cannot succeed, so the hint
    says which Python to use first; on 3.11 and newer it is the install command alone."""
    from lightning_fpdt.optional import install_hint

    assert install_hint("transformers", (3, 10, 13)) == (
        "the releases the 'hf' extra names need Python >= 3.11 (transformers 5.24 on), and this is Python 3.10.13: use"
        " Python 3.11 or newer, then pip install 'lightning-fpdt[hf]'")
    assert install_hint("peft", (3, 10, 2)).endswith("this is Python 3.10.2: use Python 3.11 or newer, then pip install"
                                                     " 'lightning-fpdt[hf]'")
    for python in ((3, 11, 0), (3, 13, 1)):
        assert install_hint("transformers", python) == "pip install 'lightning-fpdt[hf]'"
    assert install_hint("numpy", (3, 10, 13)) == "pip install numpy"


def test_a_missing_hf_package_is_named_with_the_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """``require`` names the feature, the package and this Python's hint."""
    from lightning_fpdt import optional

    def not_installed(name: str) -> None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name.split(".")[0])

    monkeypatch.setattr(optional.importlib, "import_module", not_installed)
    with pytest.raises(ModuleNotFoundError) as missing:
        optional.require("transformers.models", "HFCausalLM")
    assert str(missing.value) == f"HFCausalLM needs transformers: {optional.install_hint('transformers')}."
