"""Settings: MindIE key names in a JSON file, environment overrides, errors that name the key."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from schemas.config import ConfigError, load_settings, log_config_notes


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_file_with_mindie_keys_is_read(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        {
            "maxSeqLen": 4096,
            "maxIterTimes": 1024,
            "maxBatchSize": 8,
            "maxInputTokenLen": 3000,
            "npuDeviceIds": [0, 1, 2],
            "ModelConfig": [{"modelName": "llama-7b", "modelWeightPath": "/m/llama"}],
        },
    )
    settings = load_settings({"TOKENLINE_CONFIG": config})
    assert (settings.max_seq_len, settings.max_iter_times, settings.max_batch_size) == (4096, 1024, 8)
    assert settings.npu_device_ids == (0, 1, 2)
    assert settings.models[0].name == "llama-7b" and str(settings.models[0].path) == "/m/llama"
    assert settings.max_prompt_tokens == 3000


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, {"maxIterTimes": 100, "ModelConfig": [{"modelName": "a", "modelWeightPath": "/a"}]})
    settings = load_settings(
        {"TOKENLINE_CONFIG": config, "TOKENLINE_MAX_ITER_TIMES": "64", "MODEL_PATH": "/models/b", "MODEL_NAME": "b"}
    )
    assert settings.max_iter_times == 64
    assert [m.name for m in settings.models] == ["b"]


def test_model_name_defaults_to_the_directory_name() -> None:
    assert load_settings({"MODEL_PATH": "/models/qwen-0.5b"}).models[0].name == "qwen-0.5b"


def test_bad_value_names_the_key_and_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"maxBatchSize \(from \$TOKENLINE_MAX_BATCH_SIZE\)"):
        load_settings({"MODEL_PATH": "/m", "TOKENLINE_MAX_BATCH_SIZE": "0"})


def test_bad_value_in_the_file_names_the_key_and_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, {"maxSeqLen": "long", "ModelConfig": [{"modelName": "a", "modelWeightPath": "/a"}]})
    with pytest.raises(ConfigError, match=rf"maxSeqLen in {config}"):
        load_settings({"TOKENLINE_CONFIG": config})


def test_max_iter_times_must_be_below_max_seq_len() -> None:
    with pytest.raises(ConfigError, match="maxIterTimes"):
        load_settings({"MODEL_PATH": "/m", "TOKENLINE_MAX_SEQ_LEN": "512", "TOKENLINE_MAX_ITER_TIMES": "512"})


def test_unknown_generate_style_is_refused() -> None:
    with pytest.raises(ConfigError, match="generateStyle"):
        load_settings({"MODEL_PATH": "/m", "TOKENLINE_GENERATE_STYLE": "tgi"})


def test_an_unsupported_quantization_is_refused_by_its_value() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings({"MODEL_PATH": "/m", "TOKENLINE_QUANTIZATION": "int4"})
    assert str(caught.value) == (
        "invalid setting quantization (from $TOKENLINE_QUANTIZATION): Must be int8, or empty for the "
        "checkpoint's own weights; 'int4' is not supported."
    )


def test_no_model_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no model configured"):
        load_settings({})


def test_unreadable_and_invalid_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings({"TOKENLINE_CONFIG": str(tmp_path / "missing.json")})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_settings({"TOKENLINE_CONFIG": str(bad)})


SAMPLE = Path(__file__).parent / "data" / "mindie_config.json"  # MindIE's sample, as Huawei ships it


def sample(tmp_path: Path, **models: object) -> dict:
    """The sample with only its model's name and path changed (and `models` merged into it)."""
    data = json.loads(SAMPLE.read_text())
    model = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    model.update({"modelName": "llama-65b", "modelWeightPath": "/models/llama-65b", **models})
    return data


def test_mindies_own_config_file_is_read_with_its_nested_keys(tmp_path: Path) -> None:
    settings = load_settings({"TOKENLINE_CONFIG": write(tmp_path, sample(tmp_path))})
    assert (settings.host, settings.port, settings.max_link_num) == ("127.0.0.1", 1025, 1000)
    assert (settings.token_timeout, settings.e2e_timeout, settings.log_level) == (600, 600, "INFO")
    assert (settings.max_seq_len, settings.max_input_token_len) == (2560, 2048)
    assert (settings.cache_block_size, settings.max_prefill_batch_size, settings.max_prefill_tokens) == (128, 50, 8192)
    assert (settings.max_batch_size, settings.max_iter_times, settings.max_preempt_count) == (200, 512, 0)
    assert settings.device_groups == ((0, 1, 2, 3),) and settings.npu_device_ids == (0, 1, 2, 3)
    assert settings.npu_mem_size == -1
    assert settings.cpu_mem_size == 5  # the host tier for KV blocks, GiB
    (model,) = settings.models
    assert (model.name, str(model.path), model.world_size) == ("llama-65b", "/models/llama-65b", 4)


def test_the_keys_tokenline_does_not_use_are_listed_by_path(tmp_path: Path) -> None:
    unused = load_settings({"TOKENLINE_CONFIG": write(tmp_path, sample(tmp_path))}).unused_keys
    for path in (
        "Version",
        "LogConfig.logPath",
        "ServerConfig.httpsEnabled",
        "ServerConfig.metricsPort",
        "BackendConfig.backendName",
        "BackendConfig.ModelDeployConfig.truncation",
        "BackendConfig.ModelDeployConfig.ModelConfig[0].backendType",
        "BackendConfig.ScheduleConfig.templateType",
    ):
        assert path in unused
    assert not any(p.endswith((".maxBatchSize", ".modelName", ".npuDeviceIds", ".worldSize")) for p in unused)
    mixed = write(tmp_path, {**sample(tmp_path), "maxBatchSise": 8, "maxSeqLen": 4096})  # a flat key misspelt
    mixed_unused = load_settings({"TOKENLINE_CONFIG": mixed}).unused_keys
    assert "maxBatchSise" in mixed_unused and "maxSeqLen" not in mixed_unused
    model = {"modelName": "a", "modelWeightPath": "/a", "toolCallparser": "hermes"}
    flat = write(tmp_path, {"maxSeqLen": 4096, "frobnicate": 1, "ModelConfig": [model]})
    assert load_settings({"TOKENLINE_CONFIG": flat}).unused_keys == ("frobnicate", "ModelConfig[0].toolCallparser")


def test_model_path_replacing_the_config_files_models_is_said_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """docker-compose.yml sets MODEL_PATH for every service: mounting deploy/examples/npu-70b.json as
    TOKENLINE_CONFIG served the demo model, and nothing said so."""
    config = write(tmp_path, sample(tmp_path))
    settings = load_settings({"TOKENLINE_CONFIG": config, "MODEL_PATH": "/models/demo", "MODEL_NAME": "demo"})
    assert [model.name for model in settings.models] == ["demo"]
    assert settings.replaced_by_model_path == (f"ModelConfig in {config}",)
    with caplog.at_level(logging.WARNING, logger="schemas.config"):
        log_config_notes(settings)
    assert caplog.messages == [
        f"ModelConfig in {config} is not served: MODEL_PATH names the model (demo); leave MODEL_PATH empty to "
        "serve the file's"
    ]
    assert load_settings({"TOKENLINE_CONFIG": config}).replaced_by_model_path == ()
    assert load_settings({"MODEL_PATH": "/models/demo"}).replaced_by_model_path == ()


def test_a_bad_value_in_mindies_layout_names_its_path(tmp_path: Path) -> None:
    data = sample(tmp_path)
    data["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] = 0
    config = write(tmp_path, data)
    with pytest.raises(ConfigError, match=rf"BackendConfig\.ScheduleConfig\.maxBatchSize in {config}: "):
        load_settings({"TOKENLINE_CONFIG": config})
    data = sample(tmp_path, modelWeightPath="")
    with pytest.raises(ConfigError, match=r"BackendConfig\.ModelDeployConfig\.ModelConfig\[0\]\.modelWeightPath in "):
        load_settings({"TOKENLINE_CONFIG": write(tmp_path, data)})
    data = sample(tmp_path)
    data["BackendConfig"]["npuDeviceIds"] = [[0, 1], [1, 2]]
    with pytest.raises(ConfigError, match=r"BackendConfig\.npuDeviceIds in .*: A device appears twice"):
        load_settings({"TOKENLINE_CONFIG": write(tmp_path, data)})


def test_several_models_each_get_their_own_entry_and_the_environment_still_wins(tmp_path: Path) -> None:
    data = sample(tmp_path)
    models = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
    models.append(
        {
            **models[0],
            "modelName": "qwen-7b",
            "modelWeightPath": "/models/qwen",
            "worldSize": 1,
            "npuMemSize": 8,
            "cpuMemSize": 2,
        }
    )
    settings = load_settings({"TOKENLINE_CONFIG": write(tmp_path, data), "TOKENLINE_MAX_BATCH_SIZE": "8"})
    # Each model's own memory sizes where the models' differ (the sample's are -1 and 5 GiB).
    assert [(m.name, m.world_size, m.npu_mem_size, m.cpu_mem_size) for m in settings.models] == [
        ("llama-65b", 4, -1, 5),
        ("qwen-7b", 1, 8, 2),
    ]
    assert settings.max_batch_size == 8


def test_two_models_of_one_name_are_refused_naming_the_second(tmp_path: Path) -> None:
    data = sample(tmp_path)
    models = data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
    models.append({**models[0], "modelWeightPath": "/models/other"})
    with pytest.raises(ConfigError, match=r"ModelConfig\[1\]\.modelName in .*: 'llama-65b' is already the name of"):
        load_settings({"TOKENLINE_CONFIG": write(tmp_path, data)})


@pytest.mark.parametrize(
    "environ",
    [{"TOKENLINE_API_KEYS": ",, ,"}, {"TOKENLINE_API_KEYS_FILE": "KEYS"}],
)
def test_api_keys_asked_for_without_any_stop_the_start(environ: dict[str, str], tmp_path: Path) -> None:
    """Keys asked for (a variable or file set) but none given is an error, never an API without keys."""
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys go here\n\n")
    environ = {name: str(keys) if value == "KEYS" else value for name, value in environ.items()}
    with pytest.raises(ConfigError, match=r"invalid setting apiKeys \(from \$TOKENLINE_API_KEYS.*: no keys in it"):
        load_settings({"MODEL_PATH": "/m", **environ})


def test_an_api_key_shorter_than_8_characters_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"apiKeys\[1\] \(from \$TOKENLINE_API_KEYS\): Shorter than minimum length 8"):
        load_settings({"MODEL_PATH": "/m", "TOKENLINE_API_KEYS": "long-enough-key,short"})
    assert load_settings({"MODEL_PATH": "/m", "TOKENLINE_API_KEYS": "exactly8"}).api_keys == ("exactly8",)


@pytest.mark.parametrize("key", [" padded-key-01 ", "sk-ключ-00001", "two words-01"])
def test_an_api_key_a_client_could_not_send_as_it_is_is_refused_without_naming_it(tmp_path: Path, key: str) -> None:
    """A key with spaces (the presented key is stripped) or beyond ASCII (headers arrive as latin-1)
    would never match: the start stops, rather than lock every client out."""
    with pytest.raises(ConfigError, match=r"apiKeys\[1\] in .*: Must be printable ASCII without spaces") as caught:
        load_settings({"MODEL_PATH": "/m", "TOKENLINE_CONFIG": write(tmp_path, {"apiKeys": ["plain-key-01", key]})})
    assert key.strip() not in str(caught.value)


def test_device_groups_for_a_world_size(tmp_path: Path) -> None:
    env = {"MODEL_PATH": "/m", "TOKENLINE_WORLD_SIZE": "4", "TOKENLINE_NPU_DEVICE_IDS": "0,1,2,3,4,5,6,7"}
    settings = load_settings(env)
    assert settings.models[0].world_size == 4
    assert settings.groups_of(4) == ((0, 1, 2, 3), (4, 5, 6, 7))  # a flat list, cut in order
    assert settings.groups_of(8) == ((0, 1, 2, 3, 4, 5, 6, 7),)
    with pytest.raises(ConfigError, match=r"npuDeviceIds \[\[0\], .*\] has no group of worldSize 16 devices"):
        settings.groups_of(16)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"npuDeviceIds": [[0, 1], [2, 3]]}))
    grouped = load_settings({"MODEL_PATH": "/m", "TOKENLINE_CONFIG": str(config)})
    assert grouped.groups_of(2) == ((0, 1), (2, 3))
    with pytest.raises(ConfigError, match="has no group of worldSize 4 devices"):
        grouped.groups_of(4)
    with pytest.raises(ConfigError, match=r"ModelConfig\[0\]\.worldSize .*: Must be greater than or equal to 1"):
        load_settings({"MODEL_PATH": "/m", "TOKENLINE_WORLD_SIZE": "0"})


def test_the_per_model_variables_set_every_model_of_the_config_file(tmp_path: Path) -> None:
    """The environment wins for ModelConfig's per-model keys too: without MODEL_PATH they set each
    model of the file (they were read only with MODEL_PATH, and a file's models ran on one device
    whatever TOKENLINE_WORLD_SIZE said, without a word). A bad value names the variable."""
    models = [{"modelName": "a", "modelWeightPath": "/a"}, {"modelName": "b", "modelWeightPath": "/b", "worldSize": 2}]
    config = write(tmp_path, {"ModelConfig": models})
    env = {"TOKENLINE_CONFIG": config, "TOKENLINE_WORLD_SIZE": "4", "TOKENLINE_TOOL_CALL_PARSER": "none"}
    settings = load_settings(env)
    assert [(m.world_size, m.tool_parser, m.reasoning_parser) for m in settings.models] == [(4, "none", "auto")] * 2
    assert [m.world_size for m in load_settings({"TOKENLINE_CONFIG": config}).models] == [1, 2]
    with pytest.raises(ConfigError, match=r"ModelConfig\[0\]\.worldSize in .* \(with \$TOKENLINE_WORLD_SIZE\)"):
        load_settings({"TOKENLINE_CONFIG": config, "TOKENLINE_WORLD_SIZE": "0"})


def test_every_tool_call_format_the_api_reads_can_be_named_in_the_config() -> None:
    from app.tools import FORMATS
    from schemas.config import TOOL_PARSERS

    assert set(TOOL_PARSERS) == (set(FORMATS) - {"required"}) | {"auto", "none"}


def test_every_attention_backend_the_worker_has_can_be_named_in_the_config() -> None:
    from schemas.config import ATTENTION_BACKENDS
    from workers.models.attention import BACKENDS

    assert ATTENTION_BACKENDS == BACKENDS
    assert load_settings({"MODEL_PATH": "/m", "TOKENLINE_ATTENTION_BACKEND": "npu"}).attention_backend == "npu"
    with pytest.raises(ConfigError, match="attentionBackend"):
        load_settings({"MODEL_PATH": "/m", "TOKENLINE_ATTENTION_BACKEND": "tpu"})


@pytest.mark.parametrize(
    ("variable", "value", "key"),
    [
        ("TOKENLINE_MAX_BATCH_SIZE", "100000000000000000000", "maxBatchSize"),
        ("TOKENLINE_RESPONSES_TTL", "1e30", "responsesTtl"),
    ],
)
def test_an_absurdly_large_count_or_time_stops_the_start_naming_it(variable: str, value: str, key: str) -> None:
    """Far above any real value: a worker died with a traceback (a tensor's size), or every stored
    response was a 503 (Redis's EXPIRE) instead."""
    with pytest.raises(ConfigError, match=rf"invalid setting {key} \(from \${variable}\): .*less than or equal to"):
        load_settings({"MODEL_PATH": "/m", variable: value})


def test_log_levels_are_taken_in_any_case_and_warn_for_warning() -> None:
    """As LogConfig.logLevel takes them (Debug, Warn): the variable alike."""
    for given, level in (("debug", "DEBUG"), ("Warn", "WARNING"), ("error", "ERROR")):
        assert load_settings({"MODEL_PATH": "/m", "TOKENLINE_LOG_LEVEL": given}).log_level == level


@pytest.mark.parametrize("section", ["ServerConfig", "BackendConfig.ScheduleConfig", "BackendConfig.ModelDeployConfig"])
def test_a_mindie_section_that_is_not_an_object_is_refused_by_name(tmp_path: Path, section: str) -> None:
    """Not ignored, its settings left at their defaults (ScheduleConfig), nor "no model configured"
    (ModelDeployConfig)."""
    data = sample(tmp_path)
    parent, _, name = section.rpartition(".")
    (data[parent] if parent else data)[name] = []
    with pytest.raises(ConfigError, match=rf"invalid setting {section} in .*: must be an object of settings$"):
        load_settings({"TOKENLINE_CONFIG": write(tmp_path, data)})


@pytest.mark.parametrize(
    ("section", "key", "attribute", "value"),
    [
        ("BackendConfig.ScheduleConfig", "maxIterTimes", "max_iter_times", 32.9),
        ("BackendConfig.ScheduleConfig", "maxBatchSize", "max_batch_size", 0.5),
        ("ServerConfig", "maxLinkNum", "max_link_num", 2.7),
        ("ServerConfig", "port", "port", 8080.6),
    ],
)
def test_a_fractional_count_is_refused_not_cut_to_a_whole_one(
    tmp_path: Path, section: str, key: str, attribute: str, value: float
) -> None:
    """marshmallow's Integer took 32.9 as 32 (and 0.5 as 0: "must be at least 1"); 8.0 is 8."""
    data = sample(tmp_path)
    parent, _, name = section.rpartition(".")
    settings = data[parent][name] if parent else data[section]
    settings[key] = value
    refused = rf"invalid setting {section}\.{key} in .*: Must be a whole number, not {value}\.$"
    with pytest.raises(ConfigError, match=refused):
        load_settings({"TOKENLINE_CONFIG": write(tmp_path, data)})
    settings[key] = 8.0
    assert getattr(load_settings({"TOKENLINE_CONFIG": write(tmp_path, data)}), attribute) == 8


def test_a_fractional_count_from_the_environment_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"invalid setting maxBatchSize \(from \$TOKENLINE_MAX_BATCH_SIZE\): Not a"):
        load_settings({"MODEL_PATH": "/m", "TOKENLINE_MAX_BATCH_SIZE": "4.5"})


def test_a_check_across_two_settings_says_where_the_other_came_from(tmp_path: Path) -> None:
    data = sample(tmp_path)
    data["BackendConfig"]["ScheduleConfig"]["maxIterTimes"] = 32
    refused = (
        r"invalid setting BackendConfig\.ScheduleConfig\.maxIterTimes in .*: maxIterTimes \(32\) must be less than "
        r"maxSeqLen \(20\)\. \(maxSeqLen from \$TOKENLINE_MAX_SEQ_LEN\)$"
    )
    with pytest.raises(ConfigError, match=refused):
        load_settings({"TOKENLINE_CONFIG": write(tmp_path, data), "TOKENLINE_MAX_SEQ_LEN": "20"})
    data["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] = 20
    with pytest.raises(ConfigError, match=r"\(maxSeqLen is BackendConfig\.ModelDeployConfig\.maxSeqLen in .*\)$"):
        load_settings({"TOKENLINE_CONFIG": write(tmp_path, data)})


def test_a_models_chat_template_comes_from_the_config_or_the_environment(tmp_path: Path) -> None:
    models = [{"modelName": "a", "modelWeightPath": "/a", "chatTemplate": "/t/a.jinja"}]
    config = write(tmp_path, {"ModelConfig": models})
    assert load_settings({"TOKENLINE_CONFIG": config}).models[0].chat_template == Path("/t/a.jinja")
    env = {"MODEL_PATH": "/m", "TOKENLINE_CHAT_TEMPLATE": "/t/m.jinja"}
    assert load_settings(env).models[0].chat_template == Path("/t/m.jinja")
    assert load_settings({"MODEL_PATH": "/m"}).models[0].chat_template is None
    with pytest.raises(ConfigError, match=r"ModelConfig\[0\]\.chatTemplate .*: Shorter than minimum length 1"):
        load_settings({"TOKENLINE_CONFIG": write(tmp_path, {"ModelConfig": [{**models[0], "chatTemplate": ""}]})})
