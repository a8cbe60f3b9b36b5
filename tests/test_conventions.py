"""Meta-tests that turn the project's conventions into CI."""

import ast
import pathlib
import re

import pytest

import nki_lib
from nki_lib import registry

ROOT = pathlib.Path(nki_lib.__file__).resolve().parent
TESTS = ROOT.parent / "tests"
KERNEL_FILES = sorted(p for p in ROOT.glob("*/kernels/*.py") if p.name != "__init__.py")


def _defines_jit_kernel(tree: ast.Module) -> bool:
    """Does the module define an ``@nki.jit`` (or ``@nki.jit(...)``) function?"""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                target = deco.func if isinstance(deco, ast.Call) else deco
                if isinstance(target, ast.Attribute) and target.attr == "jit":
                    return True
    return False


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_kernel_files_document_algorithm_shapes_and_limits(path):
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree) or ""
    assert doc, f"{path.name}: every file under kernels/ opens with a docstring"
    if not _defines_jit_kernel(tree):
        return  # helper module (planning, shared tile steps): a docstring is enough
    assert len(doc) > 200, f"{path.name}: the module docstring must give algorithm, loops, shapes, limits"
    lowered = doc.lower()
    for word in ("shape", "limit"):
        assert word in lowered, f"{path.name}: docstring does not mention {word}s"


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_import_nki_only_through_nki_lib(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name == "nki" or a.name.startswith("nki.") for a in node.names), path.name
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not (node.module == "nki" or node.module.startswith("nki.")), path.name
            assert "simulator" not in node.module, f"{path.name}: kernels must not import the simulator directly"


def test_every_family_has_its_files():
    registered = {s.name for s in registry.all_specs()}
    for family in ("attention", "moe"):
        for name in ("DESIGN.md", "kernels"):
            assert (ROOT / family / name).exists(), f"nki_lib/{family}/{name} is missing"
        ops = sorted(p.name.removesuffix("_op.py") for p in (ROOT / family).glob("*_op.py"))
        assert ops, f"nki_lib/{family}: no <op>_op.py"
        for op in ops:
            assert (ROOT / family / f"{op}_reference.py").exists(), f"nki_lib/{family}/{op}_reference.py is missing"
            assert op in registered, f"nki_lib/{family}/{op}_op.py does not register an op named {op!r}"


def test_every_registered_op_is_complete():
    names = {s.name for s in registry.all_specs()}
    assert "flash_attention" in names
    for spec in registry.all_specs():
        assert spec.samples(spec.dtypes[0], False), spec.name
        assert spec.report_samples(), spec.name
        assert spec.op is not None


_LITERAL_TOL = re.compile(r"\b(atol|rtol)\s*=\s*(?!0\b)[0-9.]+(e-?[0-9]+)?")


def test_no_literal_tolerances_in_tests():
    offenders = []
    for path in TESTS.rglob("*.py"):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if _LITERAL_TOL.search(line):
                offenders.append(f"{path.relative_to(TESTS)}:{lineno}: {line.strip()}")
    assert not offenders, "tolerances belong in nki_lib/numerics:\n" + "\n".join(offenders)
