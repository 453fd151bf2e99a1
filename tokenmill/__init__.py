"""tokenmill: prompts in, completions out, exactly once, on Celery and Redis."""

__version__ = "0.1.0"
