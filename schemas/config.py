"""Settings: one validated object, read once at start-up from a JSON file and the environment.

The JSON file (path in TOKENLINE_CONFIG) is MindIE's own config.json (nested: ServerConfig,
BackendConfig.ModelDeployConfig.ModelConfig[], ScheduleConfig; see schemas/mindie.py) or tokenline's
flat form with the same key names; environment variables override it. A bad value raises
ConfigError naming the key's path (and the variable it came from); keys tokenline does not use are
kept in `Settings.unused_keys` for the start-up log.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marshmallow import EXCLUDE, Schema, ValidationError, fields, post_load, pre_load, validate, validates_schema

from schemas import mindie
from schemas.model_files import default_model_name
from schemas.requests import MAX_MODEL_NAME_LENGTH, MODEL_NAME_PATTERN, first_error

logger = logging.getLogger(__name__)

# Environment variable → config key. The config keys are MindIE's where MindIE has one.
ENV_KEYS: dict[str, str] = {
    "REDIS_URL": "redisUrl",
    "TOKENLINE_MAX_SEQ_LEN": "maxSeqLen",
    "TOKENLINE_MAX_ITER_TIMES": "maxIterTimes",
    "TOKENLINE_MAX_BATCH_SIZE": "maxBatchSize",
    "TOKENLINE_MAX_INPUT_TOKEN_LEN": "maxInputTokenLen",
    "TOKENLINE_NPU_DEVICE_IDS": "npuDeviceIds",
    "TOKENLINE_MAX_N": "maxN",
    "TOKENLINE_GENERATE_STYLE": "generateStyle",
    "TOKENLINE_TOKEN_TIMEOUT": "tokenTimeout",
    "TOKENLINE_QUEUE_TIMEOUT": "queueTimeout",
    "TOKENLINE_E2E_TIMEOUT": "e2eTimeout",
    "TOKENLINE_MAX_LINK_NUM": "maxLinkNum",
    "TOKENLINE_STREAM_BUFFER": "streamBuffer",
    "TOKENLINE_LOG_LEVEL": "logLevel",
    # Stored responses (/v1/responses with store: true), in Redis.
    "TOKENLINE_RESPONSES_TTL": "responsesTtl",
    "TOKENLINE_RESPONSES_MAX_BYTES": "responsesMaxBytes",
    # The worker's own settings (tokenline's; MindIE has no such keys).
    "TOKENLINE_DEVICE": "device",
    "TOKENLINE_ACCELERATOR": "accelerator",
    "TOKENLINE_NODE": "node",
    "TOKENLINE_DEVICE_LEASE_TTL": "deviceLeaseTtl",
    "TOKENLINE_GROUP_TIMEOUT": "groupTimeout",
    "TOKENLINE_DTYPE": "dtype",
    "TOKENLINE_QUANTIZATION": "quantization",
    "TOKENLINE_TORCH_THREADS": "torchThreads",
    "TOKENLINE_PREFILL_THREADS": "prefillThreads",
    "TOKENLINE_CACHE_BLOCK_SIZE": "cacheBlockSize",
    "TOKENLINE_NPU_MEM_SIZE": "npuMemSize",
    "TOKENLINE_CPU_MEM_SIZE": "cpuMemSize",
    "TOKENLINE_MAX_PREFILL_TOKENS": "maxPrefillTokens",
    "TOKENLINE_MAX_PREFILL_BATCH_SIZE": "maxPrefillBatchSize",
    "TOKENLINE_MAX_PREEMPT_COUNT": "maxPreemptCount",
    "TOKENLINE_PREFIX_CACHING": "prefixCaching",
    "TOKENLINE_PREFILL_CHUNK_TOKENS": "prefillChunkTokens",
    "TOKENLINE_ATTENTION_BACKEND": "attentionBackend",
    "TOKENLINE_COMPILE": "compile",
    "TOKENLINE_SHUTDOWN_GRACE": "shutdownGrace",
    # How the API picks a worker for a request (app/routing.py).
    "TOKENLINE_ROUTING": "routing",
    "TOKENLINE_ROUTING_CACHE_THRESHOLD": "routingCacheThreshold",
    "TOKENLINE_ROUTING_BALANCE_ABS": "routingBalanceAbs",
    "TOKENLINE_ROUTING_BALANCE_REL": "routingBalanceRel",
    "TOKENLINE_PUBLIC": "public",
    "TOKENLINE_DEV_MODE": "devMode",
    # The API server's (gunicorn's) settings.
    "HOST": "host",
    "PORT": "port",
    "WEB_CONCURRENCY": "webConcurrency",
    "GUNICORN_WORKER_CLASS": "gunicornWorkerClass",
    "GUNICORN_WORKER_CONNECTIONS": "gunicornWorkerConnections",
    "GUNICORN_GRACEFUL_TIMEOUT": "gunicornGracefulTimeout",
    "GUNICORN_KEEPALIVE": "gunicornKeepalive",
    "GUNICORN_ACCESS_LOG": "gunicornAccessLog",
}
GENERATE_STYLES = ("mindie", "vllm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ACCELERATORS = ("", "npu", "cuda", "cpu")
QUANTIZATIONS = ("", "int8")  # schemas/quantization.py: off, or int8 weights and activations computed at load


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names the key."""


# The model tool-call formats of app/tools (tests/test_config.py keeps the two lists equal).
TOOL_PARSERS = (
    "auto",
    "none",
    "hermes",
    "llama3_json",
    "mistral",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
    "granite",
    "phi4_mini",
    "nemotron",
    "functionary_v31",
    "functionary_v32",
    "qwen3_coder",
    "gemma4",
)
REASONING_PARSERS = ("auto", "think", "none")
ATTENTION_BACKENDS = ("auto", "portable", "flex", "npu", "flashinfer")  # workers/models/attention/
COMPILE_MODES = ("auto", "on", "off")  # workers/models/compile.py
ROUTING_POLICIES = ("cache", "round-robin")  # app/routing.py


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: Path
    tool_parser: str = "auto"  # how the model writes tool calls; auto: detected from its chat template
    reasoning_parser: str = "auto"  # "think": <think>…</think> is reasoning_content; auto: from the template
    npu_mem_size: float | None = None  # MindIE's per-model npuMemSize; None: the global setting
    cpu_mem_size: float | None = None  # MindIE's per-model cpuMemSize; None: the global setting
    world_size: int = 1  # devices one instance of the model spans (MindIE's worldSize)
    chat_template: Path | None = None  # a Jinja file that replaces the model's own chat template


@dataclass(frozen=True)
class Settings:
    models: tuple[ModelConfig, ...]
    redis_url: str = "redis://127.0.0.1:6379/0"
    max_seq_len: int = 2560
    max_iter_times: int | None = None  # None: a request may generate up to the end of the context
    max_batch_size: int = 16
    max_input_token_len: int = 2048
    npu_device_ids: tuple[int, ...] = (0,)
    device_groups: tuple[tuple[int, ...], ...] = ((0,),)  # npuDeviceIds as MindIE groups them
    max_n: int = 4
    generate_style: str = "mindie"
    token_timeout: float = 60.0
    queue_timeout: float = 600.0
    e2e_timeout: float = 1800.0
    max_link_num: int = 1000
    stream_buffer: int = 1024
    log_level: str = "INFO"
    api_keys: tuple[str, ...] = ()
    responses_ttl: float = 86400.0  # seconds a stored response (and its conversation) is kept
    responses_max_bytes: int = 4 * 1024 * 1024  # the largest stored response, its conversation included
    device: str = "auto"
    accelerator: str = ""
    node: str = ""  # empty: this host's name
    device_lease_ttl: float = 15.0
    group_timeout: float = 30.0  # seconds any collective of a tensor-parallel group may wait
    dtype: str = "auto"
    quantization: str = ""  # "int8": a float checkpoint's linear layers quantized at load (models/quant/)
    torch_threads: int = 0  # 0: the worker chooses (models/runner.py default_threads)
    prefill_threads: int = 0
    cache_block_size: int = 16
    npu_mem_size: float = -1.0  # GiB per device; -1: 90% of what the device has free after loading the weights
    cpu_mem_size: float = 0.0  # GiB of host memory per worker for the KV host tier; 0: none
    max_prefill_tokens: int = 8192
    max_prefill_batch_size: int = 0  # 0: maxBatchSize
    max_preempt_count: int = 4
    prefix_caching: bool = True
    prefill_chunk_tokens: int = 0  # 0: 512 on an accelerator; on a CPU, one token per decoding sequence and at least 16
    attention_backend: str = "auto"  # models/attention/: auto, portable, flex, npu, flashinfer
    compile: str = "auto"  # the decode step compiled (models/compile.py): auto (accelerators only), on, off
    shutdown_grace: float = 30.0
    # app/routing.py: "cache" sends a request to the worker holding the longest prefix of its prompt (at
    # least routing_cache_threshold of its blocks) unless the loads are unbalanced (max − min above
    # routing_balance_abs and max above routing_balance_rel × min), then to the least loaded;
    # "round-robin" puts every request on the model's shared queue, which RQ hands to an idle worker.
    routing: str = "cache"
    routing_cache_threshold: float = 0.5
    routing_balance_abs: int = 4
    routing_balance_rel: float = 1.5
    host: str = "127.0.0.1"
    port: int = 8000
    web_concurrency: int = 2
    gunicorn_worker_class: str = "gevent"
    gunicorn_worker_connections: int = 1000
    gunicorn_graceful_timeout: int = 30
    gunicorn_keepalive: int = 5  # seconds an idle client connection is kept (a stopping API waits for it)
    gunicorn_access_log: str = "-"
    public: bool = False  # the API is published beyond this host (compose): API keys are required
    dev_mode: bool = False  # a development stack: no API keys needed even when public
    unused_keys: tuple[str, ...] = ()  # keys of the config file that tokenline does not read
    replaced_by_model_path: tuple[str, ...] = ()  # the config file's models, which MODEL_PATH replaced

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def groups_of(self, world: int) -> tuple[tuple[int, ...], ...]:
        """The device groups a model of `world` devices runs on: npuDeviceIds' groups as MindIE writes
        them ([[0, 1, 2, 3], [4, 5, 6, 7]]), or a flat list cut into consecutive groups of `world`."""
        if all(len(group) == 1 for group in self.device_groups):
            ids = self.npu_device_ids
            groups = tuple(ids[i : i + world] for i in range(0, len(ids) - world + 1, world))
        else:
            groups = self.device_groups
        if not groups or any(len(group) != world for group in groups):
            raise ConfigError(
                f"npuDeviceIds {[list(g) for g in self.device_groups]} has no group of worldSize {world} devices"
            )
        return groups

    @property
    def max_prompt_tokens(self) -> int:
        """The seed's bound before max_position_embeddings: min(maxSeqLen − maxIterTimes, maxInputTokenLen);
        without maxIterTimes a prompt may take all but one token of the context."""
        return min(self.max_seq_len - (self.max_iter_times or 1), self.max_input_token_len)


class Whole(fields.Integer):
    """A whole number: a JSON integer (or one written 8.0), or digits from the environment. marshmallow's
    Integer cuts 32.9 to 32 and 0.5 to 0 (then "must be at least 1"); here they are refused."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> int:
        if isinstance(value, float) and not value.is_integer():
            raise ValidationError(f"Must be a whole number, not {value!r}.")
        return super()._deserialize(value, attr, data, **kwargs)


class _ModelSchema(Schema):
    class Meta:
        unknown = EXCLUDE

    name = fields.String(
        data_key="modelName",
        required=True,
        validate=[validate.Length(max=MAX_MODEL_NAME_LENGTH), validate.Regexp(MODEL_NAME_PATTERN)],
    )
    path = fields.String(data_key="modelWeightPath", required=True, validate=validate.Length(min=1))
    tool_parser = fields.String(data_key="toolCallParser", validate=validate.OneOf(TOOL_PARSERS))
    reasoning_parser = fields.String(data_key="reasoningParser", validate=validate.OneOf(REASONING_PARSERS))
    npu_mem_size = fields.Float(data_key="npuMemSize", validate=lambda v: _npu_mem_size(v))
    cpu_mem_size = fields.Float(data_key="cpuMemSize", validate=validate.Range(min=0.0))
    world_size = Whole(data_key="worldSize", validate=validate.Range(min=1))
    chat_template = fields.String(data_key="chatTemplate", validate=validate.Length(min=1))

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> ModelConfig:
        return ModelConfig(
            name=data["name"],
            path=Path(data["path"]),
            tool_parser=data.get("tool_parser", "auto"),
            reasoning_parser=data.get("reasoning_parser", "auto"),
            npu_mem_size=data.get("npu_mem_size"),
            cpu_mem_size=data.get("cpu_mem_size"),
            world_size=data.get("world_size", 1),
            chat_template=Path(data["chat_template"]) if "chat_template" in data else None,
        )


class DeviceIds(fields.Field):
    """npuDeviceIds: device ids ([0, 1]) or MindIE's groups of them ([[0, 1, 2, 3]]) → groups."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> tuple[tuple[int, ...], ...]:
        if not isinstance(value, list) or not value:
            raise ValidationError("Must be a non-empty list of device ids, or of lists of device ids.")
        groups = [item if isinstance(item, list) else [item] for item in value]
        ids = [_device_id(d) for group in groups for d in group]
        if any(not group for group in groups):
            raise ValidationError("A device group must not be empty.")
        if len(set(ids)) < len(ids):
            raise ValidationError("A device appears twice.")
        return tuple(tuple(_device_id(d) for d in group) for group in groups)


def _device_id(value: Any) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)  # from the environment
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValidationError(f"{value!r} is not a device id (a non-negative integer).")
    return value


# Bounds far above any real value, below what the libraries take (a tensor's size, Redis's EXPIRE): an
# absurd value stops the start naming its key, not a worker with a traceback or every request later.
MAX_COUNT = 2**31 - 1
MAX_SECONDS = 1e9  # about 31 years


def _positive_int(key: str) -> Whole:
    return Whole(data_key=key, validate=validate.Range(min=1, max=MAX_COUNT))


def _positive_float(key: str) -> fields.Float:
    """Seconds."""
    return fields.Float(data_key=key, validate=validate.Range(min=0.0, max=MAX_SECONDS, min_inclusive=False))


def _npu_mem_size(value: float) -> None:
    if value != -1 and value <= 0:
        raise ValidationError("Must be -1 (what the device has free) or a positive number of GiB.")


class _SettingsSchema(Schema):
    class Meta:
        unknown = EXCLUDE

    models = fields.List(fields.Nested(_ModelSchema), data_key="ModelConfig", validate=validate.Length(min=1))
    redis_url = fields.String(
        data_key="redisUrl",
        validate=validate.Regexp(r"^(redis|rediss|unix)://", error="Must be a redis://, rediss:// or unix:// URL."),
    )
    max_seq_len = _positive_int("maxSeqLen")
    max_iter_times = _positive_int("maxIterTimes")
    max_batch_size = _positive_int("maxBatchSize")
    max_input_token_len = _positive_int("maxInputTokenLen")
    npu_device_ids = DeviceIds(data_key="npuDeviceIds")
    max_n = _positive_int("maxN")
    generate_style = fields.String(data_key="generateStyle", validate=validate.OneOf(GENERATE_STYLES))
    token_timeout = _positive_float("tokenTimeout")
    queue_timeout = _positive_float("queueTimeout")
    e2e_timeout = _positive_float("e2eTimeout")
    max_link_num = _positive_int("maxLinkNum")
    stream_buffer = _positive_int("streamBuffer")
    log_level = fields.String(data_key="logLevel", validate=validate.OneOf(("DEBUG", "INFO", "WARNING", "ERROR")))

    api_keys = fields.List(
        fields.String(
            validate=[
                validate.Length(min=8),
                # What a client can send in a header as it is: no spaces (a padded key would never match
                # the stripped header), nothing but ASCII (headers arrive as latin-1).
                validate.Regexp(r"^[!-~]+\Z", error="Must be printable ASCII without spaces."),
            ]
        ),
        data_key="apiKeys",
        validate=validate.Length(min=1, error="No keys in it (leave it out for an API without keys)."),
    )
    responses_ttl = _positive_float("responsesTtl")
    responses_max_bytes = _positive_int("responsesMaxBytes")
    device = fields.String(
        data_key="device",
        validate=validate.Regexp(r"^(auto|cpu|(npu|cuda)(:\d+)?)\Z", error="Must be auto, cpu, cuda:N or npu:N."),
    )
    accelerator = fields.String(data_key="accelerator", validate=validate.OneOf(ACCELERATORS))
    node = fields.String(data_key="node")
    device_lease_ttl = _positive_float("deviceLeaseTtl")
    group_timeout = _positive_float("groupTimeout")
    dtype = fields.String(data_key="dtype", validate=validate.OneOf(DTYPES))
    quantization = fields.String(
        data_key="quantization",
        validate=validate.OneOf(
            QUANTIZATIONS, error="Must be int8, or empty for the checkpoint's own weights; {input!r} is not supported."
        ),
    )
    torch_threads = Whole(data_key="torchThreads", validate=validate.Range(min=0))
    prefill_threads = Whole(data_key="prefillThreads", validate=validate.Range(min=0))
    cache_block_size = Whole(data_key="cacheBlockSize", validate=validate.Range(min=1, max=1024))
    npu_mem_size = fields.Float(data_key="npuMemSize", validate=_npu_mem_size)
    cpu_mem_size = fields.Float(data_key="cpuMemSize", validate=validate.Range(min=0.0))
    max_prefill_tokens = _positive_int("maxPrefillTokens")
    max_prefill_batch_size = Whole(data_key="maxPrefillBatchSize", validate=validate.Range(min=0))
    max_preempt_count = Whole(data_key="maxPreemptCount", validate=validate.Range(min=0))
    prefix_caching = fields.Boolean(data_key="prefixCaching")
    prefill_chunk_tokens = Whole(data_key="prefillChunkTokens", validate=validate.Range(min=0))
    attention_backend = fields.String(data_key="attentionBackend", validate=validate.OneOf(ATTENTION_BACKENDS))
    compile = fields.String(data_key="compile", validate=validate.OneOf(COMPILE_MODES))
    shutdown_grace = fields.Float(data_key="shutdownGrace", validate=validate.Range(min=0.0))
    routing = fields.String(data_key="routing", validate=validate.OneOf(ROUTING_POLICIES))
    routing_cache_threshold = fields.Float(data_key="routingCacheThreshold", validate=validate.Range(min=0.0, max=1.0))
    routing_balance_abs = Whole(data_key="routingBalanceAbs", validate=validate.Range(min=0))
    routing_balance_rel = fields.Float(data_key="routingBalanceRel", validate=validate.Range(min=1.0))
    host = fields.String(data_key="host", validate=validate.Length(min=1))
    port = Whole(data_key="port", validate=validate.Range(min=1, max=65535))
    web_concurrency = _positive_int("webConcurrency")
    gunicorn_worker_class = fields.String(data_key="gunicornWorkerClass", validate=validate.Length(min=1))
    gunicorn_worker_connections = _positive_int("gunicornWorkerConnections")
    gunicorn_graceful_timeout = Whole(data_key="gunicornGracefulTimeout", validate=validate.Range(min=0))
    gunicorn_keepalive = Whole(data_key="gunicornKeepalive", validate=validate.Range(min=0))
    gunicorn_access_log = fields.String(data_key="gunicornAccessLog")
    public = fields.Boolean(data_key="public")
    dev_mode = fields.Boolean(data_key="devMode")

    @pre_load
    def _level_names(self, data: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """Log levels in any case, WARN for WARNING (as LogConfig.logLevel takes them)."""
        level = data.get("logLevel")
        if isinstance(level, str):
            data = {**data, "logLevel": {"WARN": "WARNING"}.get(level.upper(), level.upper())}
        return data

    @validates_schema
    def _check(self, data: dict[str, Any], **kwargs: Any) -> None:
        seq = data.get("max_seq_len", Settings.max_seq_len)
        iters = data.get("max_iter_times")
        if iters is not None and iters >= seq:
            raise ValidationError(f"maxIterTimes ({iters}) must be less than maxSeqLen ({seq}).", "maxIterTimes")
        # A model is known by its name (its queue, the API's registry): two of one name would be one.
        first: dict[str, int] = {}
        for i, model in enumerate(data.get("models", ())):
            if model.name in first:
                message = f"{model.name!r} is already the name of ModelConfig[{first[model.name]}]."
                raise ValidationError({i: {"modelName": [message]}}, "ModelConfig")
            first[model.name] = i

    @post_load
    def _make(self, data: dict[str, Any], **kwargs: Any) -> Settings:
        if "npu_device_ids" in data:
            groups = data["npu_device_ids"]
            data["device_groups"] = groups
            data["npu_device_ids"] = tuple(d for group in groups for d in group)
        if "api_keys" in data:
            data["api_keys"] = tuple(data["api_keys"])
        return Settings(**{**data, "models": tuple(data.get("models", ()))})


# The environment variables of ModelConfig's per-model keys.
MODEL_ENV_KEYS = {
    "TOKENLINE_TOOL_CALL_PARSER": "toolCallParser",
    "TOKENLINE_REASONING_PARSER": "reasoningParser",
    "TOKENLINE_WORLD_SIZE": "worldSize",
    "TOKENLINE_CHAT_TEMPLATE": "chatTemplate",
}


def load_settings(environ: Mapping[str, str] | None = None, require_model: bool = True) -> Settings:
    """Build the settings from TOKENLINE_CONFIG (JSON, MindIE key names) and the environment."""
    environ = os.environ if environ is None else environ
    raw = _read_config_file(environ.get("TOKENLINE_CONFIG"))
    paths = {key: key for key in raw}
    if mindie.is_nested(raw):
        for section in mindie.SECTIONS:
            if section in raw and not isinstance(raw[section], dict):
                raise ConfigError(
                    f"invalid setting {section} in {environ['TOKENLINE_CONFIG']}: must be an object of settings"
                )
        flat = mindie.flatten(raw)
        if flat.not_objects:
            raise ConfigError(
                f"invalid setting {flat.not_objects[0]} in {environ['TOKENLINE_CONFIG']}: must be an object of settings"
            )
        raw, paths, unused = flat.settings, flat.paths, flat.unused
        # Flat keys mixed in at the top level (a misspelt one is read by no one).
        unused += [key for key, path in paths.items() if path == key and key not in _SETTINGS_KEYS]
    else:
        unused = [key for key in raw if key not in _SETTINGS_KEYS]
        models = raw.get("ModelConfig")
        for i, model in enumerate(models if isinstance(models, list) else []):
            if isinstance(model, dict):
                unused += [f"ModelConfig[{i}].{key}" for key in model if key not in mindie.MODEL_KEYS]
    sources = {key: f"{paths[key]} in {environ['TOKENLINE_CONFIG']}" for key in raw}
    for var, key in ENV_KEYS.items():
        if environ.get(var):
            raw[key] = _env_value(key, environ[var])
            sources[key] = f"{key} (from ${var})"
    keys = _api_keys(environ)
    if keys is not None:
        raw["apiKeys"], sources["apiKeys"] = keys
    replaced = ()
    # The per-model settings the environment sets: for MODEL_PATH's model, or else for every model of
    # the file's ModelConfig (the environment wins, as it does for the other settings).
    per_model = {key: environ[env] for env, key in MODEL_ENV_KEYS.items() if environ.get(env)}
    if environ.get("MODEL_PATH"):
        if raw.get("ModelConfig"):
            replaced = (f"ModelConfig in {environ['TOKENLINE_CONFIG']}",)
        path = environ["MODEL_PATH"]
        name = environ.get("MODEL_NAME") or default_model_name(Path(path))
        raw["ModelConfig"] = [{"modelName": name, "modelWeightPath": path, **per_model}]
        sources["ModelConfig"] = "ModelConfig (from $MODEL_NAME/$MODEL_PATH)"
    elif per_model and isinstance(raw.get("ModelConfig"), list):
        raw["ModelConfig"] = [{**m, **per_model} if isinstance(m, dict) else m for m in raw["ModelConfig"]]
        variables = ", ".join(f"${env}" for env, key in MODEL_ENV_KEYS.items() if key in per_model)
        sources["ModelConfig"] = f"{sources['ModelConfig']} (with {variables})"
    try:
        settings = _SettingsSchema().load({k: v for k, v in raw.items() if k in _SETTINGS_KEYS})
    except ValidationError as exc:
        key = next(iter(exc.messages))
        where, message = first_error({key: exc.messages[key]})
        inner = (where or key)[len(key) :]  # "[0].modelWeightPath" inside ModelConfig
        source = sources.get(key, key)
        path, _, rest = source.partition(" ")
        # A check across settings names the others it read, and where they came from.
        others = [
            f"{k} {_origin(k, sources[k])}" for k in sources if k != key and f"{k} (" in message and sources[k] != k
        ]
        also = f" ({'; '.join(others)})" if others else ""
        raise ConfigError(f"invalid setting {path}{inner}{' ' + rest if rest else ''}: {message}{also}") from None
    settings = dataclasses.replace(settings, unused_keys=tuple(unused), replaced_by_model_path=replaced)
    if require_model and not settings.models:
        raise ConfigError("no model configured: set MODEL_PATH or ModelConfig in $TOKENLINE_CONFIG")
    return settings


def _origin(key: str, source: str) -> str:
    """Where a setting came from, said after its name: "from $VAR", or "is PATH in FILE"."""
    variable = source.removeprefix(f"{key} (").removesuffix(")")
    return variable if variable.startswith("from $") else f"is {source}"


def log_config_notes(settings: Settings) -> None:
    """Once at start-up: the config keys tokenline does not read, and the models MODEL_PATH replaced."""
    if settings.unused_keys:
        logger.info("config keys tokenline does not use: %s", ", ".join(settings.unused_keys))
    for models in settings.replaced_by_model_path:
        logger.warning(
            "%s is not served: MODEL_PATH names the model (%s); leave MODEL_PATH empty to serve the file's",
            models,
            ", ".join(model.name for model in settings.models),
        )


def _api_keys(environ: Mapping[str, str]) -> tuple[list[str], str] | None:
    """Keys from $TOKENLINE_API_KEYS (comma-separated) and $TOKENLINE_API_KEYS_FILE (one per line, # comments)."""
    keys: list[str] = []
    sources = []
    if environ.get("TOKENLINE_API_KEYS"):
        keys += [k.strip() for k in environ["TOKENLINE_API_KEYS"].split(",") if k.strip()]
        sources.append("$TOKENLINE_API_KEYS")
    path = environ.get("TOKENLINE_API_KEYS_FILE")
    if path:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read TOKENLINE_API_KEYS_FILE={path}: {exc.strerror}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        sources.append(f"$TOKENLINE_API_KEYS_FILE={path}")
    if not sources:
        return None
    # The message names where keys came from, never a key.
    where = f"apiKeys (from {' and '.join(sources)})"
    if not keys:  # asked for, and none given: never an API without keys by mistake
        raise ConfigError(f"invalid setting {where}: no keys in it (unset it for an API without keys)")
    return keys, where


def _read_config_file(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read TOKENLINE_CONFIG={path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"TOKENLINE_CONFIG={path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"TOKENLINE_CONFIG={path} must hold a JSON object")
    return data


def _env_value(key: str, value: str) -> Any:
    """Environment strings: lists are comma-separated; numbers are left for the schema to parse."""
    if key == "npuDeviceIds":
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


# The keys the settings schema reads (data keys): anything else in a flat file is listed as unused.
_SETTINGS_KEYS = frozenset(f.data_key or name for name, f in _SettingsSchema().fields.items())
