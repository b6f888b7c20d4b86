"""Parallelism applied to an unmodified transformers model: tensor parallel, gradient sync, norms."""
