"""Dependencies point one way: the numerics and the modules never import the exporter.

``lq.nn`` (a QuantLSTM) imported ``lq.export.prepare._loop_ops`` for the markers it traces in the export, so building a
quantized model pulled in onnx and the exporter, and the exporter could not be changed without the modules.
Checked on the source (every import statement, also those inside functions), so an import that only runs
on some path is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

LQ = Path(__file__).resolve().parents[1] / "lq"
#: the layers below the exporter: quantization numerics, calibrators, modules
BELOW_EXPORT = ["nn", "calib", "tensor_quant.py", "_ops.py", "_reference.py", "_ext.py", "quant_modules.py"]


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
    from lq.export.prepare import _loop_ops
    from lq.nn.modules import _rnn_markers

    assert _loop_ops.lstm_scan is _rnn_markers.lstm_scan and _loop_ops.loop_state is _rnn_markers.loop_state
    assert _loop_ops.dynamic_lstm is _rnn_markers.dynamic_lstm
