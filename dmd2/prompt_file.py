"""The prompt file of `[data] prompts`: plain text, one prompt a line, or JSONL with a "prompt" field per line.

Standard library only: the CLI reads and checks the file before anything heavy loads
(the text families' checks); the families read their prompts with the same function.
"""

import json
from pathlib import Path


def _prompt_error(path: Path, problem: str) -> ValueError:
    return ValueError(f"[data] prompts {path}: {problem}")


def _jsonl_prompt(path: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise _prompt_error(path, f"line {number} is not JSON ({error}); each line must be an object like "
                                  '{"prompt": "a photo of a cat"}') from error
    prompt = record.get("prompt") if isinstance(record, dict) else None
    if not isinstance(prompt, str):
        raise _prompt_error(path, f'line {number} has no string "prompt" field; each line must be an object '
                                  'like {"prompt": "a photo of a cat"}')
    return prompt


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a file: plain text (one prompt a line) or `.jsonl` (a `prompt` string per line).

    Blank lines are skipped and surrounding whitespace stripped. An empty result is an error.
    """
    path = Path(path)
    if not path.is_file():
        raise _prompt_error(path, "does not exist; give a text file with one prompt a line, or a .jsonl file "
                                  'with a "prompt" field per line')
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise _prompt_error(path, f"cannot be read as UTF-8 text ({error})") from error
    is_jsonl = path.suffix.lower() == ".jsonl"
    prompts = [_jsonl_prompt(path, n, line) if is_jsonl else line.strip()
               for n, line in enumerate(lines, start=1) if line.strip()]
    if not prompts:
        raise _prompt_error(path, "holds no prompt; write one prompt a line (blank lines are skipped)")
    return prompts
