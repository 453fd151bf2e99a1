"""The tree's imports point one way, down: the contract at the ground (``tokenmill/``), the
components above it (``producer/``, ``workers/``, ``server_mgr/``), the façade on top (the
public API, the CLI root, the demo). A component imports the contract and itself, never another
component; the contract imports no component. Admission is a room of its own inside
``workers/``: the workers call it, and it imports nothing of theirs, only the contract.

Every ``import`` statement counts, inside functions and ``TYPE_CHECKING`` blocks too. The façade
mounts components by name (strings resolved on first use), which is not an import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ROOT

FACADE = {"tokenmill", "tokenmill.cli", "tokenmill.demo"}
COMPONENTS = ("workers.admission", "producer", "workers", "server_mgr")
SUB_ROOM = ("workers", "workers.admission")  # (who may use it, the room)
PRODUCT = ("tokenmill", "producer", "workers", "server_mgr")


def room(module: str) -> str:
    """The room a module belongs to: the façade, a component, or the contract."""
    if module in FACADE:
        return "facade"
    for name in COMPONENTS:
        if module == name or module.startswith(name + "."):
            return name
    return "contract"


def allowed(importer: str, imported: str) -> bool:
    """Whether a module of room ``importer`` may import one of room ``imported``."""
    return importer == "facade" or imported in ("contract", importer) or (importer, imported) == SUB_ROOM


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] in PRODUCT]


def target(name: str) -> str:
    """The module an imported name lives in (``from pkg import mod`` names a module)."""
    while name and not (
        (ROOT / (name.replace(".", "/") + ".py")).exists() or (ROOT / name.replace(".", "/")).is_dir()
    ):
        name = name.rpartition(".")[0]
    return name


def wrong_imports(paths: list[Path]) -> list[str]:
    wrong = []
    for path in paths:
        importer = module_name(path)
        for line, name in imports_of(path):
            imported = target(name)
            if not allowed(room(importer), room(imported)):
                wrong.append(
                    f"{path.relative_to(ROOT)}:{line}: {room(importer)} imports {imported} ({room(imported)})"
                )
    return wrong


def product_files() -> list[Path]:
    return sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py"))


def fresh(call: str) -> Any:
    """``call``'s JSON value, computed in a new interpreter. In a pytest worker that ran other
    tests first, CPython 3.11's ``ast.parse`` of a plain module once raised "SystemError: AST
    constructor recursion depth mismatch" (CI, 2026-12-06): the parser's recursion count is
    process-wide state that another test's deep nesting can leave off."""
    code = f"import json, sys\nfrom tests import test_layers, test_one_door\nprint(json.dumps({call}))"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_no_import_runs_up_or_sideways() -> None:
    # Given every module of the product
    # Then none imports a component other than its own, and the contract imports none
    assert fresh("test_layers.wrong_imports(test_layers.product_files())") == []


@pytest.mark.parametrize(
    ("importer", "imported", "ok"),
    [
        ("workers.task", "server_mgr.consumers", False),  # sideways
        ("tokenmill.ledger", "producer.client", False),  # upward
        ("workers.admission.limiter", "workers.job", False),  # admission is a room of its own
        ("workers.job_path", "workers.admission.limiter", True),  # the workers call admission
        ("producer.status", "workers.admission.limiter", False),
        ("producer.status", "tokenmill.keys", True),
        ("tokenmill.cli", "producer.cli", True),  # the façade mounts components
        ("workers.admission.limiter", "tokenmill.keys", True),
    ],
)
def test_the_rule(importer: str, imported: str, ok: bool) -> None:
    assert allowed(room(importer), room(imported)) is ok


def test_a_new_sideways_import_is_caught(tmp_path: Path) -> None:
    # Given a workers module that imports the server manager
    bad = ROOT / "workers" / "_layer_probe.py"
    bad.write_text("from server_mgr import consumers  # noqa\n")
    try:
        # Then the check names it
        assert wrong_imports([bad]) == [
            "workers/_layer_probe.py:1: workers imports server_mgr.consumers (server_mgr)"
        ]
    finally:
        bad.unlink()
