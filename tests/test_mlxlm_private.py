"""No module of provider/ but provider/mlxlm.py uses a private name of mlx-lm.

Read from the source with `ast`, nothing of ours is imported. A private name of mlx-lm is one with a
single leading underscore that mlx-lm's own source defines: a module-level function, class or
variable, a method, or an attribute it assigns (`self._idx = 0`). A use of one, in a module of ours:

* an import of it from an mlx_lm module (`from mlx_lm.generate import _right_pad_prompts`);
* an attribute of anything but `self` or `cls` (`generator._prompt_batch`, `super()._step()`);
* in a class derived from an mlx-lm class (directly, or through classes of ours),
  `self._name` or a method `def _name` (an override of a private hook), for a private name of that
  mlx-lm class;
* the name as a string argument (`vars(tokenizer).get("_chat_template")`, `getattr(x, "_idx")`).

Run as a script to list the uses and count them: `python tests/test_mlxlm_private.py [root]` (root:
a checkout, this one by default).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = "provider.mlxlm"
PACKAGE = "provider"
MLX_LM = "mlx_lm"


def _private(name: str) -> bool:
    return len(name) > 1 and name.startswith("_") and not name.startswith("__")


def module_names(root: Path, package: str) -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


@cache
def mlx_lm_modules() -> dict[str, Path]:
    spec = importlib.util.find_spec(MLX_LM)  # finds the package without running it
    assert spec is not None and spec.submodule_search_locations, "mlx-lm is not installed"
    return module_names(Path(next(iter(spec.submodule_search_locations))).parent, MLX_LM)


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _class_privates(node: ast.ClassDef) -> set[str]:
    """The private names a class defines: its methods and class attributes, and what it assigns to self."""
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name) \
                and sub.value.id == "self":
            names.add(sub.attr)
    return {n for n in names if _private(n)}


@cache
def mlx_lm_private_names() -> frozenset[str]:
    """Every private name mlx-lm's source defines, anywhere."""
    names: set[str] = set()
    for path in mlx_lm_modules().values():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(n for n in names if _private(n))


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(module: str, path: Path) -> dict[str, tuple[str, str | None]]:
    """Local name -> (module, name in it) or (module, None) for a module, from the module's imports."""
    out: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = (alias.name, None)
                else:
                    out[alias.name.split(".")[0]] = (alias.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, path, node)
            for alias in node.names:
                out[alias.asname or alias.name] = (source, alias.name)
    return out


class Resolver:
    """Which classes derive from mlx-lm classes, and the private names they get from them."""

    def __init__(self, ours: dict[str, Path]) -> None:
        self.ours = ours
        self._done: dict[tuple[str, str], frozenset[str] | None] = {}

    def _modules(self, module: str) -> dict[str, Path]:
        return mlx_lm_modules() if module.split(".")[0] == MLX_LM else self.ours

    def class_privates(self, module: str, name: str) -> frozenset[str] | None:
        """For a class `module.name`: None when no mlx-lm class is among its bases (ours), else the
        private names of the mlx-lm classes it derives from."""
        key = (module, name)
        if key in self._done:
            return self._done[key]
        self._done[key] = None  # a circle of bases (never valid Python) ends here
        path = self._modules(module).get(module)
        found: frozenset[str] | None = None
        if path is not None:
            node = next((n for n in _tree(path).body if isinstance(n, ast.ClassDef) and n.name == name), None)
            if node is None:  # a name the module imports (a package re-exporting a class)
                source = _imported(module, path).get(name)
                if source is not None and source[1] is not None:
                    found = self.class_privates(*source)
            else:
                found = self._derived(module, path, node)
        self._done[key] = found
        return found

    def _derived(self, module: str, path: Path, node: ast.ClassDef) -> frozenset[str] | None:
        own = module.split(".")[0] == MLX_LM
        inherited: set[str] = set()
        derived = own
        for base in node.bases:
            target = self.base_of(module, path, base)
            if target is None:
                continue
            privates = self.class_privates(*target)
            if privates is not None:
                inherited |= privates
                derived = True
        if not derived:
            return None
        return frozenset(inherited | (_class_privates(node) if own else set()))

    def base_of(self, module: str, path: Path, base: ast.expr) -> tuple[str, str] | None:
        """The (module, class) a base expression names, if it can be told from the source."""
        names = _imported(module, path)
        if isinstance(base, ast.Name):
            if base.id in names and names[base.id][1] is not None:
                return names[base.id][0], names[base.id][1]
            if any(isinstance(n, ast.ClassDef) and n.name == base.id for n in _tree(path).body):
                return module, base.id
            return None
        if isinstance(base, ast.Attribute) and isinstance(base.value, (ast.Name, ast.Attribute)):
            dotted = ast.unparse(base.value)
            head, _, rest = dotted.partition(".")
            if head in names and names[head][1] is None:
                return ".".join([names[head][0], *([rest] if rest else [])]), base.attr
            if head in names:
                source, name = names[head]
                return ".".join([source, name, *([rest] if rest else [])]), base.attr
        return None


@dataclass(frozen=True, slots=True)
class Use:
    path: Path
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def uses_in(module: str, path: Path, resolver: Resolver) -> Iterator[Use]:
    """The uses of mlx-lm's private names in one module of ours (module docstring)."""
    private = mlx_lm_private_names()
    tree = _tree(path)

    def visit(node: ast.AST, inherited: frozenset[str]) -> Iterator[Use]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                privates = resolver.class_privates(module, child.name) if child in tree.body else None
                if privates:
                    for item in child.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in privates:
                            yield Use(path, item.lineno, f"def {item.name} (overrides mlx-lm's)")
                yield from visit(child, privates or frozenset())
                continue
            if isinstance(child, ast.ImportFrom) and _absolute(module, path, child).split(".")[0] == MLX_LM:
                for alias in child.names:
                    if _private(alias.name):
                        yield Use(path, child.lineno, f"import {alias.name}")
            elif isinstance(child, ast.Attribute) and child.attr in private:
                on_self = isinstance(child.value, ast.Name) and child.value.id in ("self", "cls")
                if not on_self or child.attr in inherited:
                    yield Use(path, child.lineno, ast.unparse(child))
            elif isinstance(child, ast.Call):
                for arg in child.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value in private:
                        yield Use(path, arg.lineno, ast.unparse(child))
            yield from visit(child, inherited)

    yield from visit(tree, frozenset())


def private_uses(root: Path = ROOT, *, exempt: str | None = ADAPTER) -> list[Use]:
    ours = module_names(root, PACKAGE)
    resolver = Resolver(ours)
    return [use for module, path in ours.items() if module != exempt for use in uses_in(module, path, resolver)]


def test_no_module_but_the_adapter_uses_a_private_name_of_mlx_lm():
    uses = private_uses()
    assert not uses, "mlx-lm's private names belong in provider/mlxlm.py:\n" + "\n".join(map(str, uses))


def test_the_scan_finds_each_kind_of_use(tmp_path):
    """The guard is not vacuous: a module with each kind of use, and one whose names only look alike."""
    (tmp_path / PACKAGE).mkdir()
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "base.py").write_text(
        "from mlx_lm.generate import GenerationBatch\n"
        "class Base(GenerationBatch):\n"
        "    pass\n")
    (tmp_path / PACKAGE / "bad.py").write_text(
        "from mlx_lm.generate import BatchGenerator, _right_pad_prompts\n"
        "from provider.base import Base\n"
        "class Mine(Base):\n"
        "    def _step(self):\n"
        "        return self._next_tokens\n"
        "def waiting(generator: BatchGenerator):\n"
        "    return generator._unprocessed_sequences, vars(generator).get('_prompt_batch')\n")
    (tmp_path / PACKAGE / "fine.py").write_text(
        "class Own:\n"
        "    def __init__(self):\n"
        "        self._step = 0\n"  # a private name mlx-lm also has, on a class of our own
        "    def _next_tokens(self):\n"
        "        return self._step\n")
    found = sorted((use.path.name, use.what) for use in private_uses(tmp_path))
    assert found == [
        ("bad.py", "def _step (overrides mlx-lm's)"),
        ("bad.py", "generator._unprocessed_sequences"),
        ("bad.py", "import _right_pad_prompts"),
        ("bad.py", "self._next_tokens"),
        ("bad.py", "vars(generator).get('_prompt_batch')"),
    ]
    # Exempt nothing: the adapter itself is where they all are.
    assert private_uses(ROOT, exempt=None)


if __name__ == "__main__":
    found = private_uses(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    for use in found:
        print(use)
    print(f"{len(found)} uses of mlx-lm's private names outside {ADAPTER}")
