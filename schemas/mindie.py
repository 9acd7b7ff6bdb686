"""MindIE Service's own config.json, as Huawei ships it, read into tokenline's flat settings.

MindIE nests its keys: `ServerConfig`, `BackendConfig` (with `ModelDeployConfig.ModelConfig[]` and
`ScheduleConfig`) and `LogConfig`. tokenline's flat form uses the same key names at the top level.
`flatten` maps the nested layout onto the flat one, remembers each key's path (so that a bad value
is reported as `BackendConfig.ScheduleConfig.maxBatchSize`), and lists the keys tokenline does not
use. The mapping is documented in docs/configuration.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SECTIONS = ("ServerConfig", "BackendConfig", "LogConfig")

# Nested path → flat key. Anything else under the sections is reported as unused.
KEYS: dict[str, str] = {
    "ServerConfig.ipAddress": "host",
    "ServerConfig.port": "port",
    "ServerConfig.maxLinkNum": "maxLinkNum",
    "ServerConfig.tokenTimeout": "tokenTimeout",
    "ServerConfig.e2eTimeout": "e2eTimeout",
    "BackendConfig.npuDeviceIds": "npuDeviceIds",
    "BackendConfig.ModelDeployConfig.maxSeqLen": "maxSeqLen",
    "BackendConfig.ModelDeployConfig.maxInputTokenLen": "maxInputTokenLen",
    "BackendConfig.ScheduleConfig.cacheBlockSize": "cacheBlockSize",
    "BackendConfig.ScheduleConfig.maxPrefillBatchSize": "maxPrefillBatchSize",
    "BackendConfig.ScheduleConfig.maxPrefillTokens": "maxPrefillTokens",
    "BackendConfig.ScheduleConfig.maxBatchSize": "maxBatchSize",
    "BackendConfig.ScheduleConfig.maxIterTimes": "maxIterTimes",
    "BackendConfig.ScheduleConfig.maxPreemptCount": "maxPreemptCount",
    "LogConfig.logLevel": "logLevel",
}
# Keys of each ModelConfig[] entry that tokenline reads.
MODEL_KEYS = (
    "modelName",
    "modelWeightPath",
    "npuMemSize",
    "cpuMemSize",
    "worldSize",
    "toolCallParser",
    "reasoningParser",
    "chatTemplate",
)
# MindIE's log levels (LogConfig.logLevel) in Python's names.
LOG_LEVELS = {
    "debug": "DEBUG",
    "info": "INFO",
    "warn": "WARNING",
    "warning": "WARNING",
    "error": "ERROR",
    "critical": "ERROR",
}


@dataclass
class Flattened:
    settings: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)  # flat key → where it was in the file
    unused: list[str] = field(default_factory=list)  # paths tokenline does not read
    not_objects: list[str] = field(default_factory=list)  # sections tokenline reads that are not objects


def is_nested(raw: dict[str, Any]) -> bool:
    return any(section in raw for section in SECTIONS)


def flatten(raw: dict[str, Any]) -> Flattened:
    """The nested layout as flat settings. Flat keys at the top level are kept as they are (a file
    may mix both); top-level keys MindIE has outside its sections (Version) are unused."""
    out = Flattened()
    for key, value in raw.items():
        if key in SECTIONS:  # an object (load_settings refuses any other section)
            _walk(value, key, out)
        elif key == "Version":
            out.unused.append(key)
        else:
            out.settings[key] = value
            out.paths[key] = key
    _shared_memory(out)
    level = out.settings.get("logLevel")
    if isinstance(level, str) and out.paths.get("logLevel") == "LogConfig.logLevel":
        out.settings["logLevel"] = LOG_LEVELS.get(level.lower(), level)
    return out


def _walk(section: dict[str, Any], prefix: str, out: Flattened) -> None:
    for key, value in section.items():
        path = f"{prefix}.{key}"
        if path == "BackendConfig.ModelDeployConfig.ModelConfig":
            out.settings["ModelConfig"] = _models(value, path, out)
            out.paths["ModelConfig"] = path
        elif path in KEYS and path != "ModelConfig":
            out.settings[KEYS[path]] = value
            out.paths[KEYS[path]] = path
        elif path in ("BackendConfig.ModelDeployConfig", "BackendConfig.ScheduleConfig"):
            if isinstance(value, dict):
                _walk(value, path, out)
            else:
                out.not_objects.append(path)
        else:
            out.unused.append(path)


def _models(value: Any, path: str, out: Flattened) -> Any:
    if not isinstance(value, list):
        return value  # the schema reports it
    models = []
    for i, model in enumerate(value):
        if not isinstance(model, dict):
            models.append(model)
            continue
        models.append({k: v for k, v in model.items() if k in MODEL_KEYS})
        out.unused += [f"{path}[{i}].{k}" for k in model if k not in MODEL_KEYS]
    return models


def _shared_memory(out: Flattened) -> None:
    """MindIE sets npuMemSize and cpuMemSize per model; when every model has the same value it is the
    global setting (which the environment may override), else each model keeps its own."""
    models = out.settings.get("ModelConfig")
    for key in ("npuMemSize", "cpuMemSize"):
        if not isinstance(models, list) or not all(isinstance(m, dict) and key in m for m in models):
            continue
        values = {repr(m[key]) for m in models}
        if len(values) == 1 and models:
            out.settings[key] = models[0][key]
            out.paths[key] = f"{out.paths['ModelConfig']}[0].{key}"
            for model in models:
                del model[key]
