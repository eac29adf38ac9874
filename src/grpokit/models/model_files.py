"""Is a local model directory's every file intact? Checked before transformers reads it, so a damaged
file ends in one line naming it and the fix, not in a traceback from the library that read it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

# How to get an intact file back; the same for every kind of damage.
REPAIR = ("replace it with an intact copy (download the model again, or rerun what wrote it, "
          "e.g. `make models` for models/)")
# The JSON files from_pretrained reads, when a directory has them.
JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
              "special_tokens_map.json", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model")


class ModelNotFound(ValueError):
    """model.name_or_path is neither a local model directory nor a hub id that loads here."""


class DamagedModelFile(ModelNotFound):
    """A file of a local model directory that does not parse or does not fit the others."""


def check_model_files(directory: str | Path) -> None:
    """Every JSON file parses and every *.safetensors file is as long as its header says: else a
    DamagedModelFile naming the file. Reads only headers, so it costs milliseconds."""
    directory = Path(directory)
    for name in JSON_FILES:
        path = directory / name
        if path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as err:
                raise DamagedModelFile(f"{path} is not valid JSON ({_first_line(err)}): {REPAIR}") from None
    for path in sorted(directory.glob("*.safetensors")):
        _check_safetensors(path)


def _check_safetensors(path: Path) -> None:
    """A safetensors file: 8 bytes of header length, a JSON header of tensor offsets, then the data."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        header_length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if header_length is None or header_length > size - 8:
            raise DamagedModelFile(f"{path} is truncated or not a safetensors file ({size} bytes, too short for "
                                   f"its header): {REPAIR}")
        try:
            header = json.loads(f.read(header_length))
        except (ValueError, UnicodeDecodeError):
            raise DamagedModelFile(f"{path} is not a safetensors file (its header is not JSON): {REPAIR}") from None
    ends = [t["data_offsets"][1] for key, t in header.items() if key != "__metadata__" and isinstance(t, dict)]
    expected = 8 + header_length + max(ends, default=0)
    if size < expected:
        raise DamagedModelFile(f"{path} is truncated: {size} bytes of the {expected} its header describes: {REPAIR}")


def describe_load_failure(directory: str | Path, what: str, err: Exception) -> DamagedModelFile:
    """A DamagedModelFile for a directory whose `what` ("tokenizer" or "weights") failed to load with
    `err`, naming the file to blame where one can be found."""
    directory = Path(directory)
    if what == "tokenizer":
        blamed = _damaged_tokenizer_json(directory)
        if blamed:
            return DamagedModelFile(f"{directory / 'tokenizer.json'} does not load as a tokenizer ({blamed}): {REPAIR}")
        files = ", ".join(n for n in TOKENIZER_FILES if (directory / n).is_file()) or "none"
        return DamagedModelFile(f"{directory}: its tokenizer does not load ({type(err).__name__}: {_first_line(err)}; "
                                f"tokenizer files there: {files}): {REPAIR}")
    return DamagedModelFile(f"{directory}: its weights do not load ({type(err).__name__}: {_first_line(err)}): "
                            f"{REPAIR}")


def check_loading_info(directory: str | Path, info: dict) -> None:
    """The weights from_pretrained read fit config.json: none of the model's weights is missing from
    the checkpoint and none has another shape (transformers would initialise those at random)."""
    mismatched = sorted(info.get("mismatched_keys") or (), key=str)
    missing = sorted(info.get("missing_keys") or ())
    weights = _weights_name(Path(directory))
    if mismatched:
        first = mismatched[0]
        detail = (f"{first[0]}: {tuple(first[1])} in the file, {tuple(first[2])} in the model"
                  if isinstance(first, tuple) and len(first) == 3 else str(first))
        raise DamagedModelFile(f"{weights} does not fit {Path(directory) / 'config.json'}: {len(mismatched)} "
                               f"weight(s) have other shapes (e.g. {detail}); the weights and config.json come from "
                               f"different models: {REPAIR}")
    if missing:
        raise DamagedModelFile(f"{weights} lacks {len(missing)} weight(s) {Path(directory) / 'config.json'} needs "
                               f"(e.g. {missing[0]}): it is incomplete or from another model: {REPAIR}")


def _weights_name(directory: Path) -> Path:
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    return files[0] if len(files) == 1 else directory / "(its weight files)"


def _damaged_tokenizer_json(directory: Path) -> str:
    """Why tokenizer.json does not load with `tokenizers`; empty when it loads or is absent."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return ""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        return _first_line(err)
    return ""


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return (text.splitlines() or [""])[0][:200] or type(err).__name__
