"""The models a several-model server may serve: `--models FILE` or `--models-dir DIR`, read and checked
before anything loads, and what each is estimated to take in memory.

A models file (YAML, or JSON, which YAML reads too) maps each name clients send to a model path and
any of that model's settings:

    chat:                              # the name in requests' `model` field
      model: /models/qwen3-0.6b        # (or `path:`) a folder or .gguf file; relative to the file
      max_model_len: 4096              # any engine setting (the flags' names, snake- or kebab-case)
      kv_cache_memory: 512MiB          # a byte size: a number, or with KB/MB/GB, KiB/MiB/GiB
      reasoning_parser: qwen3          # and the served settings of one model (`PER_MODEL`)
    embedder: /models/bge-small        # a bare path: the defaults

Engine settings not given take the command line's (and `--config`'s) values, else their defaults.
`--models-dir DIR` serves every model folder (one with a config.json) and .gguf file in DIR, named
after the folder or the file without .gguf, with the command line's settings.

Memory (`--memory`, least-recently-used unloading): a model's weights as its files hold them, scaled
to the dtype and weight quantization it will run in, plus its KV cache (`kv_cache_memory`, else the
CPU default). Every mistake is a ValueError naming the file, the model and the key.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tokenmill.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig, check_known, check_setting
from tokenmill.model_files import is_gguf
from tokenmill.server.settings import CAPS, ServeSettings

# served settings a model may have of its own (the rest belong to the whole server)
PER_MODEL = (
    "max_waiting",
    "max_n",
    "max_tokens_limit",
    "max_prompt_tokens",
    *CAPS,
    "strict_fields",
    "prefix_cache_isolation",
    "reasoning_parser",
)
UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
UNITS.update({p: 1024**i for i, p in enumerate("kmgt", 1)})
UNITS.update({p + "ib": 1024**i for i, p in enumerate("kmgt", 1)})
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
QUANTIZED_BYTES = {"int8": 1.0, "w8a8": 1.0, "int4": 0.5}  # bytes a weight, quantized at load
BYTE_SIZED = ("kv_cache_memory",)


@dataclass(frozen=True)
class ModelSpec:
    """One model of the catalog: its name, engine config, served settings and memory estimate."""

    name: str
    config: EngineConfig
    served: dict[str, Any]  # PER_MODEL settings given for this model (the server's own otherwise)
    weight_bytes: int  # estimated from its files (see `estimate_weight_bytes`)
    kv_bytes: int  # its KV cache's budget

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def parse_bytes(value: Any, what: str) -> int:
    """A byte size: an integer, or text as 8GiB, 512MiB, 1.5GB, 2G (K/M/G/T alone: binary, as KiB...)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value)) if isinstance(value, str) else None
    if match is not None:
        scale = UNITS.get(match.group(2).lower())
        if scale is not None and float(match.group(1)) > 0:
            return int(float(match.group(1)) * scale)
    raise ValueError(f"{what}: expected a byte size (a positive integer, or as 8GiB, 512MiB, 1.5GB), got {value!r}")


def estimate_weight_bytes(config: EngineConfig) -> int:
    """The weights' bytes as the model will hold them: its files' sizes (.safetensors, else .bin; a GGUF
    file's size), scaled from the checkpoint's float dtype to the one it will run in, and to a
    quantization at load. A checkpoint quantized already (GGUF, compressed-tensors, AWQ, GPTQ) as is."""
    path = Path(config.model)
    if is_gguf(path):
        return path.stat().st_size
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    stored = sum(f.stat().st_size for f in files)
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return stored
    if "quantization_config" in hf:
        return stored
    source = DTYPE_BYTES.get(str(hf.get("torch_dtype") or hf.get("dtype") or "float32"), 4)
    if config.quantization in QUANTIZED_BYTES:
        return int(stored * QUANTIZED_BYTES[config.quantization] / source)
    target = DTYPE_BYTES.get(config.dtype, source)  # (auto, fastest: as stored)
    if config.dtype == "auto" and source == 4 and config.device.startswith("cuda"):
        target = 2  # (a float32 checkpoint runs in bfloat16 on a GPU)
    return stored * target // source


def model_spec(name: str, config: EngineConfig, served: Mapping[str, Any]) -> ModelSpec:
    if config.device.startswith("cuda") and config.kv_cache_memory is None:
        raise ValueError(
            f"{name}: kv_cache_memory: required for each model on a GPU (by default one model's KV cache takes "
            "most of the GPU's free memory)"
        )
    kv = config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
    return ModelSpec(name, config, dict(served), estimate_weight_bytes(config), kv)


def check_model_path(path: Path, where: str) -> None:
    if is_gguf(path):
        if not path.is_file():
            raise ValueError(f"{where}: {path}: no such GGUF file")
    elif not (path / "config.json").is_file():
        raise ValueError(f"{where}: {path}: not a model folder (no config.json) nor a .gguf file")


def read_models_file(path: str, base: EngineConfig) -> list[ModelSpec]:
    """The models of a models file (see the module docstring), over `base`'s engine settings."""
    where = f"--models {path}"
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{where}: not valid YAML or JSON{at} ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{where}: expected a mapping of model names to a path or to settings, got {raw!r}")
    specs = []
    for name, entry in raw.items():
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ValueError(f"{where}: {name!r}: a model name is a non-empty string without surrounding spaces")
        try:
            specs.append(_entry(name, entry, Path(path).resolve().parent, base))
        except ValueError as e:
            raise ValueError(f"{where}: {name}: {e}") from None
    return specs


def _entry(name: str, entry: Any, folder: Path, base: EngineConfig) -> ModelSpec:
    """One model of a models file: its path and settings, checked, over `base`."""
    if isinstance(entry, str):
        entry = {"model": entry}
    if not isinstance(entry, dict):
        raise ValueError(f"expected a path or a mapping of settings, got {type(entry).__name__}")
    engine_names = [f.name for f in dataclasses.fields(EngineConfig)]
    engine: dict[str, Any] = {}
    served: dict[str, Any] = {}
    for key, value in entry.items():
        field = str(key).replace("-", "_")
        if field == "path":
            field = "model"
        if field in engine or field in served:
            raise ValueError(f"{key}: given twice")
        if field in BYTE_SIZED and isinstance(value, str):
            value = parse_bytes(value, field)
        if field == "model":
            engine[field] = value
        elif field in engine_names:
            check_setting(EngineConfig, field, value)
            engine[field] = value
        elif field in PER_MODEL:
            check_setting(ServeSettings, field, value)
            served[field] = value
        elif field in {f.name for f in dataclasses.fields(ServeSettings)}:
            raise ValueError(f"{key}: a setting of the whole server, not of one model (give it on the command line)")
        else:
            check_known([field], [*engine_names, "path", *PER_MODEL], "model setting")
    if not isinstance(engine.get("model"), str) or not engine["model"]:
        raise ValueError("model: required: the model's folder or .gguf file (as `model:` or `path:`)")
    model = Path(engine["model"]).expanduser()
    model = model if model.is_absolute() else folder / model
    check_model_path(model, "model")
    engine["model"] = str(model)
    return model_spec(name, dataclasses.replace(base, **engine), served)


def scan_models_dir(folder: str, base: EngineConfig) -> list[ModelSpec]:
    """Every model folder (with a config.json) and .gguf file directly in `folder`, by name."""
    where = f"--models-dir {folder}"
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{where}: not a folder")
    found = sorted(p for p in root.iterdir() if (p.is_dir() and (p / "config.json").is_file()) or is_gguf(p))
    if not found:
        raise ValueError(f"{where}: holds no model folder (with a config.json) nor .gguf file")
    specs, names = [], set()
    for path in found:
        name = path.stem if is_gguf(path) else path.name
        if name in names:
            raise ValueError(f"{where}: two models named {name!r} (a folder and a .gguf file?)")
        names.add(name)
        specs.append(model_spec(name, dataclasses.replace(base, model=str(path)), {}))
    return specs
