"""Meta-tests that turn the project's conventions into CI."""

import ast
import importlib
import pathlib
import re

import pytest
import torch

import nki_lib
from nki_lib import registry

ROOT = pathlib.Path(nki_lib.__file__).resolve().parent
TESTS = ROOT.parent / "tests"
KERNEL_FILES = sorted(p for p in ROOT.glob("*/kernels/*.py") if p.name != "__init__.py")


def _is_jit(node: ast.FunctionDef) -> bool:
    """Is the function decorated ``@nki.jit`` (or ``@nki.jit(...)``)?"""
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _defines_jit_kernel(tree: ast.Module) -> bool:
    """Does the module define an ``@nki.jit`` (or ``@nki.jit(...)``) function?"""
    return any(isinstance(node, ast.FunctionDef) and _is_jit(node) for node in ast.walk(tree))


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
            leaf = node.module.rpartition(".")[2]
            imported = [leaf] + [a.name for a in node.names]
            assert not any(n.endswith(("_reference", "_op")) for n in imported), \
                f"{path.name}: kernels import NKI, shared helpers and host-side preparation, never an op or reference"


FAMILIES = ("attention", "moe")
SHARED_KERNEL_HELPERS = {"attention": {"tiles"}, "moe": set()}   # kernels/ modules shared by several ops
SPECS = registry.all_specs()


def test_every_family_has_its_files():
    for family in FAMILIES:
        for name in ("DESIGN.md", "kernels"):
            assert (ROOT / family / name).exists(), f"nki_lib/{family}/{name} is missing"
    assert {s.family for s in SPECS} == set(FAMILIES)


def _module_file(dotted: str) -> pathlib.Path:
    return ROOT.parent.joinpath(*dotted.split(".")).with_suffix(".py")


def _split(dotted: str) -> tuple[str, str]:
    module, _, attr = dotted.rpartition(".")
    return module, attr


def _directions(spec) -> tuple[str, ...]:
    return ("fwd", "bwd") if spec.differentiable else ("fwd",)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_op_pieces_follow_the_grammar(spec):
    """<family>/<op>_op.py holds the custom op and this spec; <family>/<op>_reference.py the
    reference (naive included); launch_<op>_<dir> and <op>_<dir>_kernel live in kernels/."""
    assert spec.family in FAMILIES, f"{spec.name}: family {spec.family!r}"
    op_module = importlib.import_module(spec.op_module)
    assert _module_file(spec.op_module).exists()
    assert op_module.SPEC is spec, f"{spec.op_module} must declare the registered SPEC of {spec.name}"
    assert _module_file(spec.reference_module).exists(), f"{spec.reference_module} is missing"
    assert spec.naive.__module__ == spec.reference_module, f"{spec.name}: naive must live in the reference"
    assert (spec.backward_name is not None) == spec.differentiable
    if spec.backward_name is not None:
        assert spec.backward_name == f"{spec.name}_backward"
    for variant in spec.variants:       # internal ops serving the op's calls: <op>_<role>, in its op module
        assert variant.startswith(f"{spec.name}_") and variant != spec.backward_name, variant
        assert hasattr(torch.ops.nki, variant), f"torch.ops.nki.{variant} is not registered"
    kernels_pkg = f"nki_lib.{spec.family}.kernels"
    directions = _directions(spec)
    assert len(spec.launchers) == len(spec.kernels) == len(directions), spec.name
    for direction, launcher, kernel in zip(directions, spec.launchers, spec.kernels):
        stem = f"{spec.name}_{direction}"
        module, name = _split(launcher)
        assert name == f"launch_{stem}", launcher
        assert module.rpartition(".")[0] == kernels_pkg, launcher
        leaf = module.rpartition(".")[2]
        assert leaf == stem or leaf.startswith(stem + "_"), f"{launcher}: not in kernels/{stem}[_<role>].py"
        assert callable(getattr(importlib.import_module(module), name, None)), f"{launcher} does not exist"
        module, name = _split(kernel)
        assert (module, name) == (f"{kernels_pkg}.{stem}", f"{stem}_kernel"), kernel
        tree = ast.parse(_module_file(module).read_text())
        jitted = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)}
        assert name in jitted, f"{kernel} is not an @nki.jit function of {module}"


def test_every_kernel_file_belongs_to_an_op_or_is_a_shared_helper():
    for family in FAMILIES:
        ops = sorted((s.name for s in SPECS if s.family == family), key=len, reverse=True)
        for path in (ROOT / family / "kernels").glob("*.py"):
            stem = path.stem
            if stem == "__init__" or stem in SHARED_KERNEL_HELPERS[family]:
                continue
            owner = next((op for op in ops if stem.startswith(op + "_")), None)
            assert owner is not None, f"nki_lib/{family}/kernels/{path.name}: name it <op>_<role>.py"


def test_every_op_and_reference_module_is_registered():
    for family in FAMILIES:
        names = {s.name for s in SPECS if s.family == family}
        for suffix in ("_op", "_reference"):
            stems = {p.stem.removesuffix(suffix) for p in (ROOT / family).glob(f"*{suffix}.py")}
            assert stems == names, f"nki_lib/{family}/*{suffix}.py {sorted(stems)} vs registered {sorted(names)}"


def test_every_registered_op_is_complete():
    names = {s.name for s in SPECS}
    assert "flash_attention" in names
    for spec in SPECS:
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


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_kernel_state_classes_declare_their_fields(path):
    """A state class (``nl.NKIObject``) lists its fields: annotations in the class body, or an
    ``__init__`` that assigns them (a class built by keyword alone would declare nothing)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and any(getattr(b, "attr", None) == "NKIObject" for b in node.bases):
            annotated = any(isinstance(s, ast.AnnAssign) for s in node.body)
            has_init = any(isinstance(s, ast.FunctionDef) and s.name == "__init__" for s in node.body)
            assert annotated or has_init, f"{path.name}: class {node.name} does not declare its fields"
