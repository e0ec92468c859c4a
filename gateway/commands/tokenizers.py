"""The tokenizers a config's models name (``models.<m>.tokenizer``), loaded for the mocks that serve them.

A relative ``tokenizer`` directory is taken from the config file's directory first, then from the
working directory (`fleet_config.kv_events.resolve_tokenizer_dir`). ``mock-fleet`` hands its
workers a copy of the settings in a temporary file, so it also hands them the original file's
directory (``--config-dir``) to resolve against.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from fleet_config import BackendEntry, Settings
from fleet_config.kv_events import resolve_tokenizer_dir
from tokenization import EngineTokenizer


def load_tokenizer(value: str, config_dir: Path | None, *, where: str) -> EngineTokenizer:
    """The tokenizer in directory ``value`` (resolved as the module docstring says).

    Raises:
        ValueError: no such directory or a broken tokenizer; the message starts with ``where``
            (the setting that named it, e.g. ``models.m.tokenizer`` or ``--tokenizer``).
    """
    try:
        return EngineTokenizer.from_dir(resolve_tokenizer_dir(value, config_dir))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def model_tokenizers(settings: Settings, backends: Iterable[BackendEntry],
                     config_dir: Path | None) -> dict[str, EngineTokenizer]:
    """The tokenizer of each model ``backends`` serve whose ``models`` entry names one, loaded once per model.

    Returns:
        Served model name -> its tokenizer; models without a ``tokenizer`` are absent.

    Raises:
        ValueError: a named tokenizer that cannot be loaded (`load_tokenizer`).
    """
    out: dict[str, EngineTokenizer] = {}
    for backend in backends:
        entry = settings.models.get(backend.model)
        if entry is not None and entry.tokenizer is not None and backend.model not in out:
            out[backend.model] = load_tokenizer(entry.tokenizer, config_dir, where=f"models.{backend.model}.tokenizer")
    return out


def backend_tokenizer(settings: Settings, backend: BackendEntry, *, override: str | None,
                      config_dir: Path | None) -> EngineTokenizer | None:
    """The tokenizer one mock of ``backend`` uses: ``override`` (``mock-vllm --tokenizer``, from the
    working directory) when given, else its model's ``models`` entry's, else None (the mock's own).

    Raises:
        ValueError: a named tokenizer that cannot be loaded (`load_tokenizer`).
    """
    if override is not None:
        return load_tokenizer(override, None, where="--tokenizer")
    return model_tokenizers(settings, [backend], config_dir).get(backend.model)
