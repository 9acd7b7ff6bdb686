"""docker-compose.yml, its override files and the Dockerfiles, checked without a container engine.

Debian's docker-compose parses and validates the files (`config`); the invariants that matter for a
safe deployment are then asserted on the resolved configuration.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from schemas.config import load_settings

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = ["docker-compose.npu.yml", "docker-compose.cuda.yml"]
LONG_RUNNING = {"redis", "worker", "api", "nginx", "dashboard", "prometheus"}
ONE_SHOT = {"certs", "demo-model"}


def compose_config(*files: str, **env: str) -> dict:
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is not installed: `make system-deps` installs Debian's package"
    args = [binary, "--project-directory", str(ROOT), "-f", "docker-compose.yml"]
    for extra in files:
        args += ["-f", extra]
    result = subprocess.run(
        [*args, "config"], cwd=ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env}
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module", params=[(), *[(o,) for o in OVERRIDES]], ids=["cpu", "npu", "cuda"])
def config(request: pytest.FixtureRequest) -> dict:
    return compose_config(*request.param)


def published(service: dict) -> list[tuple[str, int, int]]:
    """(host interface, host port, container port) of each published port; "" = every interface."""
    ports = []
    for port in service.get("ports", []):
        if isinstance(port, str):  # docker-compose 1.29 prints "IP:HOST:CONTAINER" when an interface is named
            host_ip, host, target = port.rsplit(":", 2)
            ports.append((host_ip, int(host), int(target.split("/")[0])))
        else:
            ports.append((port.get("host_ip", ""), int(port["published"]), int(port["target"])))
    return sorted(ports)


def test_nginx_is_the_only_public_entry(config: dict) -> None:
    services = config["services"]
    assert set(services) == LONG_RUNNING | ONE_SHOT
    assert published(services["nginx"]) == [("", 80, 80), ("", 443, 443)]
    for name, service in services.items():
        if name in ("nginx", "dashboard", "prometheus"):
            continue
        assert not published(service), f"{name} publishes {published(service)}"
    # The dashboard and Prometheus listen on the loopback interface only, each behind a profile.
    assert published(services["dashboard"]) == [("127.0.0.1", 9181, 9181)]
    assert services["dashboard"]["profiles"] == ["dashboard"]
    assert published(services["prometheus"]) == [("127.0.0.1", 9090, 9090)]
    assert services["prometheus"]["profiles"] == ["monitoring"]


def test_prometheus_scrapes_the_api_and_the_dashboard_reads_metrics_that_exist(config: dict) -> None:
    prometheus = config["services"]["prometheus"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in prometheus["volumes"] if m.startswith("/")}
    scrape = yaml.safe_load(Path(mounts["/etc/prometheus/prometheus.yml"]).read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["api:8000"]
    dashboard = json.loads((ROOT / "deploy/grafana/tokenline-dashboard.json").read_text())
    exposed = set(re.findall(r'"(tokenline:[a-z0-9_]+)"', (ROOT / "workers/ops/metrics.py").read_text()))
    exposed |= set(re.findall(r'"(tokenline:[a-z0-9_]+)"', (ROOT / "app/metrics.py").read_text()))
    used = {
        name
        for panel in dashboard["panels"]
        for t in panel["targets"]
        for name in re.findall(r"tokenline:\w+", t["expr"])
    }
    suffixes = ("_total", "_bucket", "_count", "_sum")
    unknown = {u for u in used if u not in exposed and not any(u.removesuffix(x) in exposed for x in suffixes)}
    assert not unknown and len(dashboard["panels"]) >= 10
    # Every API process shows every engine worker's metrics (their snapshots come through Redis): with
    # several API containers scraped, a panel that summed them counted each worker once per API. Each
    # panel takes one copy per worker (or per model) first.
    from_redis = set(re.findall(r'"(tokenline:[a-z0-9_]+)"', (ROOT / "workers/ops/metrics.py").read_text()))
    from_redis |= {"tokenline:live_workers", "tokenline:num_requests_queued", "tokenline:worker_up"}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"tokenline:\w+", target["expr"]):
                if name.removesuffix("_total").removesuffix("_bucket") in from_redis:
                    assert re.search(rf"max by \([a-z_, ]*\) \((rate\()?{name}\b", target["expr"]), target["expr"]
    # The model picker lists every configured model, one with no live worker too (worker_up has a
    # series only while a worker of the model is up: the Workers panel hid the model that was down).
    (model,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    assert model["query"] == "label_values(tokenline:live_workers, model)"


def test_redis_has_a_user_per_role_no_port_and_no_persistence(config: dict) -> None:
    services = config["services"]
    redis = services["redis"]
    assert "ports" not in redis
    assert redis["entrypoint"] == ["sh", "/etc/tokenline/start-redis.sh"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in redis["volumes"]}
    assert mounts["/etc/tokenline/start-redis.sh"] == str(ROOT / "deploy/redis/start-redis.sh")
    script = (ROOT / "deploy/redis/start-redis.sh").read_text()
    assert '--save "" --appendonly no' in script and "user default off" in script
    for role, service, variable in (
        ("api", "api", "REDIS_URL"),
        ("worker", "worker", "REDIS_URL"),
        ("dashboard", "dashboard", "RQ_DASHBOARD_REDIS_URL"),
    ):
        password = redis["environment"][f"REDIS_{role.upper()}_PASSWORD"]
        assert services[service]["environment"][variable] == f"redis://{role}:{password}@redis:6379/0"


def test_every_long_running_service_has_a_healthcheck_and_restarts(config: dict) -> None:
    for name in LONG_RUNNING:
        service = config["services"][name]
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
        assert service["restart"] == "unless-stopped", name
    for name in ONE_SHOT:
        assert config["services"][name]["restart"] == "no"


def test_startup_order_waits_for_health_and_one_shot_steps(config: dict) -> None:
    services = config["services"]
    assert services["nginx"]["depends_on"] == {
        "api": {"condition": "service_healthy"},
        "certs": {"condition": "service_completed_successfully"},
    }
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["redis"] == {"condition": "service_healthy"}
        assert services[name]["depends_on"]["demo-model"] == {"condition": "service_completed_successfully"}


def test_nginx_runs_the_one_template_over_tls(config: dict) -> None:
    nginx = config["services"]["nginx"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in nginx["volumes"]}
    assert mounts["/etc/nginx/templates/default.conf.template"] == str(ROOT / "deploy/nginx/default.conf.template")
    assert nginx["environment"]["NGINX_ENVSUBST_FILTER"] == "^NGINX_"
    assert nginx["environment"]["NGINX_MAX_BODY"] == "4m"  # the API's own limit (app.MAX_BODY_BYTES)
    template = (ROOT / "deploy/nginx/default.conf.template").read_text()
    assert set(re.findall(r"\$\{(NGINX_\w+)\}", template)) <= set(nginx["environment"])


def test_secure_defaults_dev_passwords_and_keyless_api_need_development_mode(config: dict) -> None:
    services = config["services"]
    assert services["redis"]["environment"]["TOKENLINE_DEV_MODE"] == "0"
    assert services["api"]["environment"]["TOKENLINE_PUBLIC"] == "1"
    assert services["api"]["environment"]["TOKENLINE_DEV_MODE"] == "0"


@pytest.mark.parametrize("override", OVERRIDES)
def test_accelerator_overrides_run_the_demo_model_step_in_their_own_image(override: str) -> None:
    services = compose_config(override)["services"]
    assert services["demo-model"]["image"] == services["worker"]["image"] != "tokenline-worker:cpu"
    assert services["demo-model"]["build"]["args"] == services["worker"]["build"]["args"]


def test_worker_device_settings_per_accelerator() -> None:
    cpu = compose_config()["services"]["worker"]
    assert cpu["environment"]["TOKENLINE_DEVICE"] == "cpu"
    npu = compose_config("docker-compose.npu.yml")["services"]["worker"]
    assert npu["environment"]["TOKENLINE_DEVICE"] == "auto"
    assert npu["build"]["args"]["ACCELERATOR"] == "npu"
    assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc", "/dev/davinci0"} <= set(npu["devices"])
    mounted = {m.split(":")[1] for m in npu["volumes"]}
    assert {"/usr/local/Ascend/driver", "/usr/local/bin/npu-smi"} <= mounted
    cuda = compose_config("docker-compose.cuda.yml")["services"]["worker"]
    assert cuda["environment"]["TOKENLINE_DEVICE"] == "auto"
    assert cuda["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


@pytest.mark.parametrize("override", OVERRIDES)
def test_a_tensor_parallel_group_per_replica_on_an_8_device_host(override: str) -> None:
    """2 × TP4 and 1 × TP8 (docs/deployment.md): WORLD_SIZE reaches each replica, which leases that
    many consecutive ids of the device list; the group's ranks get shared memory."""
    ids = {"NPU_DEVICE_IDS": "0,1,2,3,4,5,6,7", "GPU_DEVICE_IDS": "0,1,2,3,4,5,6,7"}
    for world, groups in (("4", ((0, 1, 2, 3), (4, 5, 6, 7))), ("8", ((0, 1, 2, 3, 4, 5, 6, 7),))):
        worker = compose_config(override, WORLD_SIZE=world, **ids)["services"]["worker"]
        env = worker["environment"]
        assert env["TOKENLINE_WORLD_SIZE"] == world and env["TOKENLINE_DEVICE"] == "auto"
        assert worker["shm_size"] in ("16gb", 17179869184)
        settings = load_settings({**env, "MODEL_PATH": env["MODEL_PATH"]})
        assert settings.models[0].world_size == int(world)
        assert settings.groups_of(int(world)) == groups
    default = compose_config(override)["services"]["worker"]["environment"]
    assert default["TOKENLINE_WORLD_SIZE"] == "1"


def test_the_cuda_replicas_lease_any_of_eight_gpus_by_default() -> None:
    """The default was GPU 0 alone: the documented `--scale worker=4` left three replicas waiting for a
    lease forever."""
    env = compose_config("docker-compose.cuda.yml")["services"]["worker"]["environment"]
    assert load_settings(env).npu_device_ids == (0, 1, 2, 3, 4, 5, 6, 7)


def test_the_settings_both_check_requests_against_reach_the_api_and_the_workers() -> None:
    """`TOKENLINE_MAX_SEQ_LEN=8192 docker compose up` kept 2,560: compose forwarded none of them."""
    given = {"TOKENLINE_MAX_SEQ_LEN": "8192", "TOKENLINE_MAX_ITER_TIMES": "1024", "TOKENLINE_QUANTIZATION": "int8"}
    services = compose_config(**given)["services"]
    for name in ("api", "worker"):
        settings = load_settings(services[name]["environment"])
        assert (settings.max_seq_len, settings.max_iter_times, settings.quantization) == (8192, 1024, "int8")
    assert load_settings(compose_config()["services"]["api"]["environment"]).max_seq_len == 2560  # unset: default


def test_the_api_container_is_given_gunicorns_graceful_stop() -> None:
    """Docker's default (10 s) SIGKILLed gunicorn before its graceful_timeout (30 s) and the watch that
    ends open streams with an error event 2 s before it."""
    api = compose_config()["services"]["api"]
    grace = api["stop_grace_period"]
    seconds = int(grace.removesuffix("s")) if isinstance(grace, str) else grace / 1e9
    assert seconds > load_settings(api["environment"]).gunicorn_graceful_timeout


def test_the_70b_example_config_is_two_groups_of_four() -> None:
    settings = load_settings({"TOKENLINE_CONFIG": str(ROOT / "deploy/examples/npu-70b.json")})
    (model,) = settings.models
    assert (model.name, model.world_size) == ("qwen2.5-72b", 4)
    assert settings.groups_of(4) == ((0, 1, 2, 3), (4, 5, 6, 7)) and not settings.unused_keys


# Dockerfiles: what a build would need, checked statically.

DOCKERFILES = sorted((ROOT / "deploy").glob("*.Dockerfile"))


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def ignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()]
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_pinned_non_root_and_copies_what_exists(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    args = {v.split("=", 1)[0]: v.split("=", 1)[1] for k, v in steps if k == "ARG" and "=" in v}
    base = next(v for k, v in steps if k == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+[\w.-]*", base), f"unpinned base image {base}"
    users = [v for k, v in steps if k == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must end as a non-root user"
    for kind, value in steps:
        if kind == "COPY":
            *sources, _ = value.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"
                assert not ignored(source), f"{dockerfile.name}: COPY {source} is excluded by .dockerignore"
        if kind == "RUN" and "pip install" in value:
            assert "-r " in value or "==" in value, f"{dockerfile.name}: unpinned pip install: {value}"
    assert "HEALTHCHECK" in {k for k, _ in steps} or dockerfile.name == "dashboard.Dockerfile"


def test_the_two_model_example_gives_each_model_its_workers_and_the_api_both() -> None:
    services = compose_config("docker-compose.two-models.yml")["services"]
    mount = str(ROOT / "deploy/examples/two-models.json") + ":/etc/tokenline/config.json:ro"
    for name in ("api", "worker", "worker-llama"):
        assert mount in services[name]["volumes"], name
        assert services[name]["environment"]["TOKENLINE_CONFIG"] == "/etc/tokenline/config.json"
        assert services[name]["environment"]["MODEL_PATH"] == ""  # or it would replace the file's models
    settings = load_settings({"TOKENLINE_CONFIG": str(ROOT / "deploy/examples/two-models.json")})
    names = [m.name for m in settings.models]
    assert names == ["qwen2.5-7b", "llama-3.1-8b"]
    served = [services[w]["command"][services[w]["command"].index("--model") + 1] for w in ("worker", "worker-llama")]
    assert served == names
    # The second model's workers check requests against the same settings as the API and the first's
    # (a worker left at its default context took requests the API advertised past it, and refused them).
    assert services["worker-llama"]["environment"] == services["worker"]["environment"]


@pytest.mark.parametrize("files", [(), *[(o,) for o in OVERRIDES], ("docker-compose.two-models.yml",)])
def test_every_worker_keeps_its_compiled_steps_in_one_volume_under_its_users_home(files: tuple[str, ...]) -> None:
    """The worker process caches Inductor's code under ~/.cache/tokenline (workers/serving/main.py); in
    a container that is lost with the container unless a volume holds it. The image makes the
    directory its user's, so that a new named volume starts owned by that user."""
    services = compose_config(*files)["services"]
    workers = [
        name
        for name, service in services.items()
        if name != "demo-model"  # the one-shot step that builds the demo model compiles nothing
        and (
            service.get("build", {}).get("dockerfile") == "deploy/worker.Dockerfile"
            or service.get("image", "").startswith("tokenline-worker:")
        )
    ]
    assert workers == (["worker", "worker-llama"] if "docker-compose.two-models.yml" in files else ["worker"])
    for name in workers:
        mounts = {m.split(":")[1]: m.split(":")[0] for m in services[name]["volumes"]}
        assert mounts.get("/srv/tokenline/.cache/tokenline") == "compile-cache", name
    dockerfile = (ROOT / "deploy/worker.Dockerfile").read_text()
    assert "--home-dir /srv/tokenline " in dockerfile
    assert "mkdir -p /srv/tokenline/.cache/tokenline && chown -R tokenline:tokenline /srv/tokenline" in dockerfile


def test_the_worker_entrypoint_is_bash_and_runs_its_command() -> None:
    """The entrypoint sources NNAL's atb/set_env.sh, which is bash (dash stops at its syntax): it is a
    bash script, and off the NPU it runs its command."""
    entrypoint = ROOT / "deploy/worker-entrypoint.sh"
    assert entrypoint.read_text().splitlines()[0] == "#!/bin/bash"
    run = subprocess.run(
        [str(entrypoint), "echo", "served"], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0 and run.stdout == "served\n"


@pytest.mark.skipif(Path("/dev/davinci_manager").exists(), reason="an NPU host: its devices are there")
def test_the_worker_entrypoint_names_the_npu_devices_a_container_lacks() -> None:
    """An NPU worker started without the devices mounted stops with the one line that names them."""
    run = subprocess.run(
        [str(ROOT / "deploy/worker-entrypoint.sh"), "true"],
        env={"PATH": "/usr/bin:/bin", "TOKENLINE_ACCELERATOR": "npu"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2 and "/dev/davinci_manager is missing" in run.stderr


def test_the_cuda_worker_image_has_the_c_compiler_triton_builds_its_launcher_with() -> None:
    """Triton compiles a C launcher at its first kernel (flex attention, the compiled decode step); the
    slim base image has no compiler."""
    (install,) = [args for kind, args in instructions(ROOT / "deploy/worker.Dockerfile") if "cuda)" in args]
    cuda_branch = install.split("cuda)", 1)[1].split(";;", 1)[0]
    assert "apt-get install" in cuda_branch and " gcc " in cuda_branch and "libc6-dev" in cuda_branch
