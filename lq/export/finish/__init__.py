"""Stage 4, finish: shapes, metadata and weight layout of the finished file."""
