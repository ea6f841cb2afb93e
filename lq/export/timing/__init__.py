"""Stage 6, time: the INT8 file against the user's plain FP32 export."""
