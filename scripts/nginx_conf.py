"""Render deploy/nginx/default.conf.template outside a container, the way the nginx image does.

The image runs envsubst over the template with the NGINX_* environment; `render` substitutes the same
`${NGINX_*}` names and leaves nginx's own `$variables` alone. `write_local_config` wraps the result in
a complete nginx.conf whose pid, logs and temp files live under one directory, so a plain `nginx -p DIR`
runs it without root paths (used by `make run-https` and the tests).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "deploy" / "nginx" / "default.conf.template"
CERT_SCRIPT = ROOT / "deploy" / "tls" / "make-cert.sh"

# The values docker-compose.yml uses unless its environment says otherwise.
DEFAULTS: dict[str, str] = {
    "NGINX_UPSTREAM": "api:8000",
    "NGINX_SERVER_NAME": "_",
    "NGINX_HTTP_PORT": "80",
    "NGINX_HTTPS_PORT": "443",
    "NGINX_PUBLIC_HTTPS_PORT": "443",
    "NGINX_CERT": "/etc/nginx/certs/server.crt",
    "NGINX_CERT_KEY": "/etc/nginx/certs/server.key",
    "NGINX_MAX_BODY": "4m",
    "NGINX_RATE": "20r/s",
    "NGINX_BURST": "40",
    "NGINX_READ_TIMEOUT": "3600s",
}
_NAME = re.compile(r"\$\{(NGINX_[A-Z0-9_]+)\}")


def render(values: Mapping[str, str], template: Path = TEMPLATE) -> str:
    """The template with every ${NGINX_*} replaced; a name with no value is an error, not an empty string."""
    merged = {**DEFAULTS, **values}
    text = template.read_text()
    missing = sorted({name for name in _NAME.findall(text) if name not in merged})
    if missing:
        raise KeyError(f"no value for {', '.join(missing)}")
    return _NAME.sub(lambda m: merged[m.group(1)], text)


def write_local_config(directory: Path, values: Mapping[str, str]) -> Path:
    """A complete nginx.conf under `directory` (pid, logs, temp files there too); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    temp = directory / "tmp"
    temp.mkdir(exist_ok=True)
    temp.chmod(0o1777)  # nginx's worker processes run as nobody when the master is root
    (directory / "tokenline.conf").write_text(render(values))
    # Request bodies are kept in memory, up to the largest taken: a body written to a temp file is
    # written by a worker process, which runs as nobody under a root master and cannot reach a
    # `directory` inside one that only root may enter (a test's temporary directory).
    body_buffer = {**DEFAULTS, **values}["NGINX_MAX_BODY"]
    conf = directory / "nginx.conf"
    conf.write_text(
        f"""daemon off;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    default_type application/octet-stream;
    access_log {directory}/access.log;
    client_body_buffer_size {body_buffer};
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    sendfile on;
    keepalive_timeout 65;
    include {directory}/tokenline.conf;
}}
"""
    )
    return conf


def nginx_binary() -> str:
    for candidate in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError("nginx is not installed (make installs Debian's nginx package: `make system-deps`)")


def nginx_command(conf: Path, *extra: str) -> list[str]:
    return [nginx_binary(), "-p", str(conf.parent), "-e", str(conf.parent / "error.log"), "-c", str(conf), *extra]


def check(conf: Path) -> None:
    """`nginx -t` on the config; CalledProcessError with nginx's own message if it is wrong."""
    subprocess.run(nginx_command(conf, "-t", "-q"), check=True, capture_output=True, text=True)


def make_certificate(directory: Path, hosts: str = "localhost,127.0.0.1,::1") -> Path:
    """The same self-signed CA + server certificate as the compose `certs` step; returns the CA file."""
    env = {"CERT_DIR": str(directory), "CERT_HOSTS": hosts, "PATH": "/usr/bin:/bin:/usr/local/bin"}
    subprocess.run(["sh", str(CERT_SCRIPT)], check=True, env=env, capture_output=True)
    return directory / "ca.crt"
