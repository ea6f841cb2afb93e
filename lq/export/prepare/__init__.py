"""Stage 1, prepare: what is checked and set on the model copy before tracing."""
