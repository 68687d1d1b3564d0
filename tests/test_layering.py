"""The import layering of lbkit, enforced.

``lbkit.core`` <- ``lbkit.prefill`` / ``lbkit.decode`` / ``lbkit.eplb`` (siblings never import
each other) <- ``lbkit.sim``, ``lbkit.replicas``, ``lbkit.integrations`` (engine adapters) <-
``lbkit.cli``. ``_reference`` modules (exact solvers) are imported only by tests, benchmarks and
the command-line tool. Heavy optional dependencies (and the serving engines) are never imported
by the light subpackages. No module uses a private name (``_name``) of another one: what is shared
gets a public name, also inside a private module (``lbkit.eplb._primitives.argmax``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lbkit"

LAYER = {
    "core": 0, "prefill": 1, "decode": 1, "eplb": 1, "sim": 2, "replicas": 2, "integrations": 2,
    "cli": 3,
}  # fmt: skip


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "lbkit" or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # Relative imports would hide the layer they reach; the project uses absolute ones.
            assert node.level == 0, f"{path}:{node.lineno}: use an absolute import"
            found.append((node.module or "", node.lineno))
    return found


def _modules():
    return sorted(p for p in SRC.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_follow_layers(path: Path):
    rel = path.relative_to(SRC)
    own = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else None
    if own is None or own not in LAYER:  # lbkit/__init__.py, _warmup.py, __main__.py
        own_layer = LAYER["cli"] + 1 if rel.name == "__main__.py" else -1
    else:
        own_layer = LAYER[own]
    for module, line in _imports(path):
        pkg = _package_of(module)
        if pkg is None or pkg not in LAYER or pkg == own:
            continue
        where = f"{rel}:{line} imports {module}"
        if own_layer == -1:
            pytest.fail(f"{where}: top-level modules must stay light and import no subpackage")
        assert LAYER[pkg] < own_layer, (
            f"{where}: a layer-{own_layer} module imports layer {LAYER[pkg]}"
        )


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_reference_solvers_are_not_imported_by_library_code(path: Path):
    rel = path.relative_to(SRC)
    if rel.parts[0] == "cli" or rel.name == "cli.py" or rel.name == "_reference.py":
        return
    for module, line in _imports(path):
        assert not module.endswith("._reference") and module != "_reference", (
            f"{rel}:{line} imports {module}; exact reference solvers are for tests, benchmarks "
            "and the command-line tool only"
        )


def test_light_imports_do_not_pull_heavy_dependencies():
    code = (
        "import sys, lbkit, lbkit.core, lbkit.eplb, lbkit.integrations\n"
        "import lbkit.integrations.vllm, lbkit.integrations.sglang\n"
        "for name in ('lbkit.prefill', 'lbkit.decode'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "heavy = ('ortools', 'matplotlib', 'torch', 'hypothesis', 'redis', 'vllm', 'sglang')\n"
        "heavy = sorted(m for m in heavy if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"light imports pulled in: {out.stdout.strip()}"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(module: str, name: str) -> bool:
    """Whether ``from module import name`` imports a submodule of lbkit (``_kernels``)."""
    base = SRC.parent.joinpath(*module.split("."), name)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private_uses(source: str, where: str) -> list[str]:
    """``where:line`` of every private name ``source`` takes from another lbkit module.

    A private *module* (``lbkit.eplb._primitives``) may be imported, also under an alias; a name
    starting with ``_`` imported from a module, or read as an attribute of an imported module,
    may not: what another module uses gets a public name in its (possibly private) module.
    """
    tree = ast.parse(source, filename=where)
    modules: dict[str, str] = {}  # local name -> lbkit module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lbkit.") and alias.asname is not None:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lbkit"):
            for alias in node.names:
                if _is_module(node.module, alias.name):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif _is_private(alias.name):
                    found.append(f"{where}:{node.lineno} imports {alias.name} from {node.module}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _is_private(node.attr)
        ):
            found.append(f"{where}:{node.lineno} uses {modules[node.value.id]}.{node.attr}")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_private_names_cross_modules(path: Path):
    found = _private_uses(path.read_text(), str(path.relative_to(SRC.parent)))
    assert not found, "private names used across modules: " + "; ".join(found)


def test_private_name_check_catches_both_forms():
    probe = (
        "import lbkit.eplb._primitives as prim\n"
        "from lbkit import __version__\n"
        "from lbkit.eplb import _primitives\n"
        "from lbkit.prefill.apportion import _serving\n"
        "x = prim._sift_down, prim.argmax, _primitives._heap_before\n"
    )
    found = _private_uses(probe, "probe.py")
    assert [f.split(" ", 1)[0].rsplit(":", 1)[1] for f in found] == ["4", "5", "5"], found
