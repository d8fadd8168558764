"""The overlay's layering, checked statically: no import cycle inside ``inductor_overlay`` (imports inside functions
included, since those are how cycles hide), kernels that import no FX pass, kernel sources that are template files
rather than edited strings, and no process-global registry of fused nodes."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "inductor_overlay"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("inductor_overlay"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in modules}
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (a list of modules, first = last), or []."""
    state, path = {}, []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = "done"
        path.pop()
        return []

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return []


def test_no_import_cycles_in_the_overlay():
    graph = _import_graph()
    assert "inductor_overlay.fx_passes.attention_fusion" in graph and len(graph) > 15
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_kernels_import_no_fx_pass():
    """Passes decide, lowerings render: a kernel module reads the fused node's data (``ops``), not a pass's
    internals."""
    graph = _import_graph()
    for module, targets in graph.items():
        if module.startswith("inductor_overlay.kernel."):
            assert not [t for t in targets if t.startswith("inductor_overlay.fx_passes")], (module, targets)


def _string_edits(source: str) -> list[int]:
    """The lines of ``source`` that call ``.replace(...)`` or ``re.sub``/``re.subn``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            on_re = isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
            if node.func.attr == "replace" or (on_re and node.func.attr in ("sub", "subn")):
                lines.append(node.lineno)
    return lines


def test_kernel_sources_are_rendered_not_edited():
    """A kernel's source is a template file under ``kernel/templates/`` whose structure template variables and macro
    arguments pick (``kernel/template_files.py``): no kernel module edits source text by string replacement."""
    edits = {path.name: _string_edits(path.read_text()) for path in (PACKAGE / "kernel").rglob("*.py")}
    assert len(edits) >= 4 and {name: lines for name, lines in edits.items() if lines} == {}


def test_the_string_edit_check_finds_edits():
    assert _string_edits("source = SOURCE.replace('A', 'B')\nre.sub(r'x', 'y', source)\n") == [1, 2]
    assert _string_edits("source = render('kernel.jinja', chain=0)\n") == []


def test_no_registry_of_fused_nodes():
    source = (PACKAGE / "ops.py").read_text()
    for name in ("SCORE_CHAINS", "MASK_SUMMARIES", "register_score_chain", "register_mask_summary"):
        assert name not in source
