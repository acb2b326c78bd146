"""The layering of docs/architecture.md, checked on the source: no import cycles, dependencies pointing one
way, the plug-in packages reached only through their protocols, and no project import hidden in a function."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

pytestmark = pytest.mark.exact  # messages, files and configs: no floats from different code paths (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("diffrl", "pipelines", "rewards")
PROTOCOLS = {"pipelines", "pipelines.base", "rewards", "rewards.base"}
SHARED_HELPERS = {"diffrl.hub"}  # leaf modules of diffrl that the plug-ins may use (they import no project module)

# diffrl's layers, top to bottom: a module may import its own layer's modules and the layers below it
LAYERS = [
    ("diffrl.tools",),
    ("diffrl.trainer", "diffrl.resume", "diffrl.rollout_driver", "diffrl.run_evaluation", "diffrl.run_setup", "diffrl.run_report"),
    ("diffrl.recipes", "diffrl.run_rewards", "diffrl.run_weights", "diffrl.run_parts"),
    ("diffrl.distributed",),
    ("diffrl.algorithms",),
    ("diffrl.engine", "diffrl.checkpoint"),
    ("diffrl.sampling", "diffrl.data", "diffrl.logging", "diffrl.wandb_file"),
    ("diffrl.prompt_sets", "diffrl.selection"),
    ("diffrl.config", "diffrl.hub", "diffrl"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, known: set[str]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imports(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """Project-internal import edges of every module, and those made inside functions."""
    known = set(modules)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    hidden = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_function = {id(node) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in ast.walk(f)}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = _resolve(name, known)
                if target and target != mod:
                    edges[mod].add(target)
                    if id(node) in in_function:
                        hidden.append((mod, target, node.lineno))
    return edges, hidden


def _layer(module: str) -> int | None:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "diffrl") or module == "diffrl" and "diffrl" in prefixes:
            return index
    return None


def test_no_import_cycles():
    edges, _ = _imports(_modules())
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, cycles


def test_plugin_packages_are_reached_only_through_their_protocols():
    edges, _ = _imports(_modules())
    bad = []
    for src, targets in edges.items():
        top = src.split(".")[0]
        for dst in targets:
            other = dst.split(".")[0]
            if top == "diffrl" and other in ("pipelines", "rewards") and dst not in PROTOCOLS:
                bad.append((src, dst, "diffrl imports a concrete family or reward"))
            if top in ("pipelines", "rewards") and other == "diffrl" and dst not in SHARED_HELPERS:
                bad.append((src, dst, "a plug-in imports diffrl"))
            if top == "rewards" and other == "pipelines":
                bad.append((src, dst, "a reward imports a model family"))
    assert not bad, bad
    assert all(not edges[helper] for helper in SHARED_HELPERS), {h: edges[h] for h in SHARED_HELPERS}  # leaves: no cycle through a plug-in


def test_diffrl_dependencies_point_down():
    edges, _ = _imports(_modules())
    bad = []
    for src, targets in edges.items():
        s = _layer(src)
        for dst in targets:
            d = _layer(dst)
            if s is not None and d is not None and d < s:
                bad.append((src, dst))
    assert not bad, f"imports from a lower layer up into a higher one: {bad}"
    assert _layer("diffrl.algorithms.nft") < _layer("diffrl.engine.engine") < _layer("diffrl.sampling.sde")  # the table is read as meant


def test_no_project_import_inside_a_function():
    _, hidden = _imports(_modules())
    assert not hidden, f"project imports inside functions hide the graph: {hidden}"


def test_only_the_registry_and_the_class_know_an_algorithm_name():
    """No code outside diffrl/algorithms reads ``algorithm.trainer`` or ``algorithm.loss`` (the registry's keys)."""
    offenders = []
    for mod, path in _modules().items():
        if mod.startswith("diffrl.algorithms") or not mod.startswith("diffrl"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("trainer", "loss"):
                owner = node.value
                if (isinstance(owner, ast.Attribute) and owner.attr == "algorithm") or (isinstance(owner, ast.Name) and owner.id in ("a", "algorithm")):
                    offenders.append((mod, node.lineno, ast.unparse(node)))
    assert not offenders, offenders


def test_every_diffrl_module_has_a_layer_and_the_docs_draw_them_in_order():
    """Every diffrl module sits in a layer of the table above, and docs/architecture.md's layer drawing names them top to
    bottom in the table's order (so the drawing cannot say one order while the test enforces another)."""
    unplaced = sorted(m for m in _modules() if m.startswith("diffrl") and _layer(m) is None)
    assert not unplaced, f"modules outside every layer (add them to LAYERS and the drawing): {unplaced}"
    text = (ROOT / "docs" / "architecture.md").read_text()
    drawing = text.split("## Layers", 1)[1].split("```", 2)[1]
    named = [line.split()[0].rstrip("/") for line in drawing.splitlines() if line.startswith("diffrl/")]
    layers = [_layer(name.removesuffix(".py").replace("/", ".")) for name in named]
    assert None not in layers, dict(zip(named, layers))
    assert layers == sorted(layers), f"the drawing's order differs from LAYERS: {list(zip(named, layers))}"
    assert set(layers) == set(range(len(LAYERS))), f"layers missing from the drawing: {sorted(set(range(len(LAYERS))) - set(layers))}"



# what an objective declares, and the attributes it was once probed for before the contract was a type
PROBED_NAMES = {"loss_fn", "objective", "algorithm", "spec"}
LEGACY_PROBES = {"needs_reference", "reference_policy", "micro_losses", "prepare_batch", "rollout_correction", "loss_name",
                 "preference_pairs", "needs_old_policy", "record_means"}


def _probes(tree: ast.AST, fields: set[str]) -> list[ast.Call]:
    """``getattr``/``hasattr`` calls whose first argument mentions one of ``PROBED_NAMES`` (a name or an attribute of the
    expression) or whose attribute name is one of ``fields``."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and node.args):
            continue
        owner = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)} | {n.attr for n in ast.walk(node.args[0]) if isinstance(n, ast.Attribute)}
        name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
        if owner & PROBED_NAMES or name in fields:
            found.append(node)
    return found


def _contract_fields() -> set[str]:
    from diffrl.algorithms import ObjectiveSpec

    return {f.name for f in dataclasses.fields(ObjectiveSpec)} - {"name"} | LEGACY_PROBES  # "name": any object's


def test_no_probe_of_an_objective_outside_the_algorithms():
    """The engine, the rollout driver and the run's checks read an objective's declared ``ObjectiveSpec``
    (``diffrl/engine/objective.py``); none asks an objective or an algorithm ``getattr``/``hasattr`` (:func:`_probes`)."""
    fields = _contract_fields()
    offenders = []
    for mod, path in _modules().items():
        if mod.startswith("diffrl.algorithms") or not mod.startswith("diffrl"):
            continue
        offenders += [(mod, node.lineno, ast.unparse(node)) for node in _probes(ast.parse(path.read_text(encoding="utf-8")), fields)]
    assert not offenders, f"probes of an objective's attributes (declare them in its ObjectiveSpec and read the field): {offenders}"


def test_the_probe_scan_sees_a_probe():
    """The scan finds the probes it is for, and passes the engine's own lookups (a guard against a scan that matches nothing)."""
    source = """
def f(loss_fn, algorithm, x, module):
    getattr(loss_fn, "prepare_batch", None)
    hasattr(algorithm.config, "preference_pairs")
    getattr(x, "record_means", False)
    getattr(self.objective, "anything")
    getattr(module, "peft_config", {})
"""
    found = [ast.unparse(call) for call in _probes(ast.parse(source), _contract_fields())]
    assert found == ["getattr(loss_fn, 'prepare_batch', None)", "hasattr(algorithm.config, 'preference_pairs')",
                     "getattr(x, 'record_means', False)", "getattr(self.objective, 'anything')"], found
