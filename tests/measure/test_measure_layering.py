"""measure/ sits below stages/ and validate/, which stand side by side: the imports of the package say so
(every import, module-level or inside a function, read from the source)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import bertopt

PACKAGE = Path(bertopt.__file__).parent


def bertopt_imports(path: Path) -> set[str]:
    """The bertopt modules a file imports (anywhere in it), as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "bertopt"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "bertopt":
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def imports_of(part: str) -> dict[str, set[str]]:
    root = PACKAGE / part
    files = [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))
    assert files, part
    return {str(f.relative_to(PACKAGE)): bertopt_imports(f) for f in files}


def offending(part: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{file} imports {name}" for file, names in imports_of(part).items() for name in sorted(names)
            if any(name == f"bertopt.{f}" or name.startswith(f"bertopt.{f}.") for f in forbidden)]


@pytest.mark.parametrize("part, forbidden", [
    ("stages", ("validate",)),
    ("validate", ("stages",)),
    ("measure", ("stages", "validate", "serve", "spark", "kafka", "tune", "cli", "registry", "recipes", "bench",
                 "tf")),
])
def test_no_import_runs_against_the_layers(part, forbidden):
    assert offending(part, forbidden) == []


@pytest.mark.parametrize("declaration", ["tasks.py", "families.py"])
def test_the_declarations_stand_on_the_ground(declaration):
    assert imports_of(declaration)[declaration] <= {"bertopt.errors", "bertopt.errors.UserError"}


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from bertopt.validate.gate import validate_artifact\n", encoding="utf-8")
    assert "bertopt.validate.gate" in bertopt_imports(probe)
