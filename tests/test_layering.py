"""Dependencies point one way: the numerics and the modules never import the exporter.

``lq.nn`` (a QuantLSTM) imported ``lq.export.trace._loop_ops`` for the markers it traces in the export, so building a
quantized model pulled in onnx and the exporter, and the exporter could not be changed without the modules.
Checked on the source (every import statement, also those inside functions), so an import that only runs
on some path is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

LQ = Path(__file__).resolve().parents[1] / "lq"
#: the layers below the exporter: quantization numerics, calibrators, modules, the glue that places quantizers
#: in the model, and the per-runtime rules both the glue and the exporter read
BELOW_EXPORT = ["nn", "calib", "capture", "glue", "rules", "tensor_quant.py", "_ops.py", "_reference.py", "_ext.py",
                "quant_modules.py"]


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_modules_and_numerics_never_import_the_exporter():
    files = [p for part in BELOW_EXPORT for p in ([LQ / part] if part.endswith(".py") else (LQ / part).rglob("*.py"))]
    assert len(files) > 20
    bad = [f"{p.relative_to(LQ.parent)}: {m}" for p in files for m in _imports(p)
           if m == "lq.export" or m.startswith("lq.export.")]
    assert not bad, bad


def test_the_recurrent_markers_are_the_exporters_ops():
    """One definition of the markers: the exporter writes exactly the ops the module traces."""
    from lq.export.trace import _loop_ops
    from lq.nn.modules import _rnn_markers

    assert _loop_ops.lstm_scan is _rnn_markers.lstm_scan and _loop_ops.loop_state is _rnn_markers.loop_state
    assert _loop_ops.dynamic_lstm is _rnn_markers.dynamic_lstm


#: calibration's modules, lowest first: each may import only the ones before it. ``lq.calibration`` runs
#: ``auto`` (``lq.auto_calib``), whose search and metric ``lq.sensitivity`` also offers, and
#: ``sensitivity_analysis`` calibrates through ``lq.calibration``: when the search lived in ``lq.sensitivity``
#: the three imported each other in a circle (inside functions, so nothing failed at import time).
CALIBRATION_LAYERS = ["lq.calib._forward", "lq.calib._fidelity", "lq.auto_calib", "lq.calibration", "lq.sensitivity"]


def _resolved_imports(source: str, module: str) -> list[str]:
    """Every module (and ``module.name``) that ``source`` imports, relative imports resolved, also inside
    functions."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[:-node.level]
                base = ".".join(parent + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def _wrong_way(sources: dict[str, str], order: list[str]) -> list[str]:
    """``module: import`` for every import of a module above the importer in ``order``."""
    rank = {m: i for i, m in enumerate(order)}
    bad = []
    for module, source in sources.items():
        for imp in _resolved_imports(source, module):
            for other, r in rank.items():
                if other != module and r > rank[module] and (imp == other or imp.startswith(other + ".")):
                    bad.append(f"{module}: {imp}")
    return sorted(set(bad))


def test_calibration_auto_and_sensitivity_import_one_way():
    sources = {m: (LQ.parent / (m.replace(".", "/") + ".py")).read_text() for m in CALIBRATION_LAYERS}
    bad = _wrong_way(sources, CALIBRATION_LAYERS)
    assert not bad, f"imports against {' <- '.join(CALIBRATION_LAYERS)}: {bad}"
    # and the calibrators with their searches (AWQ, block scales) are below all of them
    upward = []
    for path in (LQ / "calib").rglob("*.py"):
        module = ".".join(path.relative_to(LQ.parent).with_suffix("").parts)  # a package is its __init__
        upward += _wrong_way({module: path.read_text()}, [module] + CALIBRATION_LAYERS[2:])
    assert not upward, f"lq.calib imports a module above it: {upward}"


def test_the_layering_check_sees_an_import_inside_a_function():
    """The old circle, written the way it was: the check names each wrong-way import."""
    order = ["lq.calib._fidelity", "lq.auto_calib", "lq.calibration", "lq.sensitivity"]
    sources = {
        "lq.auto_calib": "def choose():\n    from lq.sensitivity import fidelity_metric\n",
        "lq.sensitivity": "def fidelity_metric():\n    from lq.calibration import default_forward\n",
        "lq.calibration": "def calibrate_model():\n    from lq import auto_calib\n",
        "lq.calib._fidelity": "from . import _forward\nfrom ..calibration import x\n",
    }
    assert _wrong_way(sources, order) == [
        "lq.auto_calib: lq.sensitivity", "lq.auto_calib: lq.sensitivity.fidelity_metric",
        "lq.calib._fidelity: lq.calibration", "lq.calib._fidelity: lq.calibration.x",
    ]


#: the export's stages in pipeline order: a stage imports only stages before it (and the shared
#: lq/export/_ir.py, _files.py); lq/export/_export.py, the pipeline itself, imports them all
STAGES = ["prepare", "trace", "passes", "finish", "verify", "timing", "report"]


def test_export_stages_import_only_earlier_stages():
    bad = []
    for i, stage in enumerate(STAGES):
        later = STAGES[i + 1:]
        for p in (LQ / "export" / stage).rglob("*.py"):
            bad += [f"{p.relative_to(LQ.parent)}: {m}" for m in _imports(p)
                    if any(m == f"lq.export.{s}" or m.startswith(f"lq.export.{s}.") for s in later)]
    assert not bad, bad
    assert sorted(d.name for d in (LQ / "export").iterdir() if d.is_dir() and d.name != "__pycache__") == sorted(STAGES)


def test_the_capture_knows_nothing_of_quantization():
    """The capture records what a model runs; the glue places quantizers on it (lq.glue imports lq.capture, never
    the reverse): the capture imports nothing of lq."""
    files = list((LQ / "capture").rglob("*.py"))
    assert files
    bad = [f"{p.relative_to(LQ.parent)}: {m}" for p in files for m in _imports(p)
           if (m == "lq" or m.startswith("lq.")) and not m.startswith("lq.capture")]
    assert not bad, bad
