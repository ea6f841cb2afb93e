"""Stage 7, report: which kernels onnxruntime runs, and the ExportResult."""
