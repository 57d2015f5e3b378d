"""The package's layering, enforced by reading the imports of every module.

Layers, top to bottom (a module may import only from its own layer or lower ones):

    0  config, hf (the Transformers adapter), kernels.reference, kernels._availability
    1  sampling, kernels (public dispatch and lazy Triton modules), heads
    2  rows, cache, telemetry, packing
    3  drafting, suffix, schedule, verify
    4  profiling
    5  generation
    6  modeling, zoo, prompt_sets, copy_heavy
    7  training, cli

Every module of the package must be listed here, so a new module is placed on purpose. Only
`hf` may touch Transformers' model internals (`transformers.models.*`) or its private generation
internals, and `import spark_generate` must not import Triton.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "spark_generate"

# Longest prefix wins: "spark_generate.kernels.reference" is layer 0, the rest of kernels layer 1.
LAYERS: dict[str, int] = {
    "spark_generate.config": 0,
    "spark_generate.hf": 0,
    "spark_generate.kernels.reference": 0,
    "spark_generate.kernels._availability": 0,
    "spark_generate.sampling": 1,
    "spark_generate.kernels": 1,
    "spark_generate.heads": 1,
    "spark_generate.rows": 2,
    "spark_generate.cache": 2,
    "spark_generate.telemetry": 2,
    "spark_generate.packing": 2,
    "spark_generate.drafting": 3,
    "spark_generate.suffix": 3,
    "spark_generate.schedule": 3,
    "spark_generate.verify": 3,
    "spark_generate.profiling": 4,
    "spark_generate.generation": 5,
    "spark_generate.modeling": 6,
    "spark_generate.zoo": 6,
    "spark_generate.prompt_sets": 6,
    "spark_generate.copy_heavy": 6,
    "spark_generate.training": 7,
    "spark_generate.cli": 7,
    # The package root re-exports the public API of every layer.
    "spark_generate": 8,
}

PRIVATE_GENERATION_MODULES = ("transformers.generation.utils", "transformers.generation.candidate_generator")
MAY_TOUCH_TRANSFORMERS_INTERNALS = {"spark_generate.hf"}


def is_transformers_internal(imported: str) -> bool:
    """Whether an imported name is a Transformers internal: private, model code, or generation internals."""
    if not imported.startswith("transformers"):
        return False
    private_name = any(part.startswith("_") for part in imported.split("."))
    model_code = imported.startswith("transformers.models")
    return private_name or model_code or imported.startswith(PRIVATE_GENERATION_MODULES)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    best = None
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return None if best is None else LAYERS[best]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Absolute names of the modules a file imports, with line numbers (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found.extend((node.lineno, f"{name}.{alias.name}") for alias in node.names)
    return found


SOURCES = sorted(PACKAGE_ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE_ROOT.parent)))
def test_imports_only_go_down(path: Path):
    importer = module_name(path)
    own_layer = layer_of(importer)
    placed = importer == "spark_generate" or any(
        importer == prefix or importer.startswith(prefix + ".") for prefix in LAYERS if prefix != "spark_generate"
    )
    assert placed, f"{importer} is not placed in a layer: add it to LAYERS in {__file__}"
    for lineno, imported in imported_modules(path):
        if imported.startswith("spark_generate"):
            target_layer = layer_of(imported)
            if target_layer is None or imported == "spark_generate":
                # `from spark_generate.kernels import x` also yields "spark_generate.kernels.x";
                # names that are not modules inherit their parent's layer.
                parent = imported.rpartition(".")[0]
                target_layer = layer_of(parent) if parent else LAYERS["spark_generate"]
            assert target_layer <= own_layer, (
                f"{path.name}:{lineno}: {importer} (layer {own_layer}) imports {imported} "
                f"(layer {target_layer}); imports must only go down the layers"
            )
        if is_transformers_internal(imported):
            assert importer in MAY_TOUCH_TRANSFORMERS_INTERNALS, (
                f"{path.name}:{lineno}: {importer} imports {imported}; only spark_generate.hf may touch "
                "Transformers' internals"
            )
        if imported.split(".")[0] == "triton":
            assert importer.startswith("spark_generate.kernels._triton"), (
                f"{path.name}:{lineno}: only spark_generate/kernels/_triton_*.py may import triton"
            )


def test_package_import_does_not_import_triton():
    code = "import sys, spark_generate; sys.exit(1 if 'triton' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, "import spark_generate imported triton: keep Triton imports lazy\n" + result.stderr


def test_ci_runs_the_readme_test_command():
    root = PACKAGE_ROOT.parent
    readme = (root / "README.md").read_text()
    ci = (root / ".ci" / "run").read_text()
    marker = "<!-- test-command -->"
    assert marker in readme, "README.md must mark its test command with " + marker
    command = readme.split(marker, 1)[1].split("```bash", 1)[1].split("```", 1)[0].strip()
    assert command in ci, f".ci/run must run the README's test command verbatim:\n{command}"


def test_every_layer_names_a_real_module():
    modules = {module_name(path) for path in SOURCES}
    for prefix in LAYERS:
        assert any(name == prefix or name.startswith(prefix + ".") for name in modules), (
            f"LAYERS names {prefix}, which is not a module of the package: remove it or fix its name"
        )
