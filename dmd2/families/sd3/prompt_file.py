"""The prompt file of `[data] prompts` (dmd2/prompt_file.py, shared by the text families)."""

from dmd2.prompt_file import read_prompts

__all__ = ["read_prompts"]
