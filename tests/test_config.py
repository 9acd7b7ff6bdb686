"""Settings: MindIE key names in a JSON file, environment overrides, errors that name the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.config import ConfigError, load_settings


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
