"""Stage 3, rewrite: the graph passes that lower placeholders to Q/DQ and place them for the runtime."""
