"""The files of a diffusers pipeline directory: JSON configs read with errors that name the file's role, content
digests that key what is prepared from them, and what a hub snapshot keeps beside a pipeline that is not part of it.
Standard library only: the CLI's checks read them before anything heavy loads."""

import hashlib
import json
from pathlib import Path
from typing import Any

# Top-level files of a hub snapshot that are single-file checkpoints, not parts of the pipeline.
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pt", ".pth", ".gguf")
CHUNK_BYTES = 1 << 20  # weight files can be GBs: hash them streaming, 1 MiB at a time


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`; `what` names the file's role in the error messages."""
    if not path.is_file():
        raise ValueError(f"{what}: {path} does not exist; is {path.parent} a complete diffusers directory?")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{what}: {path} is not readable JSON ({error}); re-save or re-download it") from error
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} holds a JSON {type(data).__name__}, not an object; re-save it")
    return data


def file_sha256(path: Path) -> str:
    digest, buffer = hashlib.sha256(), bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with path.open("rb") as f:
        while size := f.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def prompts_digest(prompts: list[str], negative_prompt: str, encoder_fingerprint: str,
                   max_sequence_length: int = 256) -> str:
    """sha256 hex of everything an encoded prompt table depends on (the T5 length included)."""
    payload = {"prompts": list(prompts), "negative_prompt": negative_prompt, "encoders": encoder_fingerprint,
               "max_sequence_length": max_sequence_length}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()

