"""The stack through the real nginx with deploy/nginx/default.conf.template, as `make run-https` runs it."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx2 as httpx
import pytest
import requests

from scripts import localstack, nginx_conf
from tests import raw_http
from tests.chat_runs import first_token

pytestmark = pytest.mark.e2e


@dataclass
class Https:
    url: str
    http_port: int
    https_port: int
    ca_file: Path
    directory: Path


def start(stack, directory: Path, **values: str) -> tuple[subprocess.Popen[bytes], Https]:  # type: ignore[no-untyped-def]
    api_port = urlparse(stack.base_url).port
    https_port, http_port = localstack.free_port(), localstack.free_port()
    proc, ca_file = localstack.start_nginx(directory, api_port, https_port, http_port, **values)
    return proc, Https(f"https://127.0.0.1:{https_port}", http_port, https_port, ca_file, directory)


@pytest.fixture(scope="module")
def https(stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Https]:  # type: ignore[no-untyped-def]
    # A generous rate limit here; test_rate_limit_answers_429_as_json runs its own strict nginx.
    proc, front = start(stack, tmp_path_factory.mktemp("nginx"), NGINX_RATE="1000r/s", NGINX_BURST="1000")
    yield front
    localstack.stop(proc)


def chat(max_tokens: int) -> dict:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def stream_times(client: httpx.Client, url: str, max_tokens: int) -> list[float]:
    """Seconds from sending the request to each SSE content event, as the client reads them."""
    times = []
    start_time = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=chat(max_tokens)) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                times.append(time.perf_counter() - start_time)
    return times


def test_openai_sdk_streams_over_verified_tls(https: Https) -> None:
    from openai import OpenAI

    client = OpenAI(
        base_url=f"{https.url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(https.ca_file))),
    )
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 12
    assert text
    assert stream.response.headers["strict-transport-security"] == "max-age=63072000"


def test_tokens_arrive_one_by_one_not_buffered(stack, https: Https) -> None:  # type: ignore[no-untyped-def]
    """Through nginx, the first token arrives long before the last, and as early as it does without nginx."""
    context = ssl.create_default_context(cafile=str(https.ca_file))
    with httpx.Client(verify=context, timeout=60) as proxied, httpx.Client(timeout=60) as direct:
        stream_times(proxied, https.url, 4)  # connect and handshake before timing
        stream_times(direct, stack.base_url, 4)
        ttft = {"direct": [], "nginx": []}
        for _ in range(7):
            ttft["direct"].append(stream_times(direct, stack.base_url, 4)[0])
            ttft["nginx"].append(stream_times(proxied, https.url, 4)[0])
        long = stream_times(proxied, https.url, 160)
    assert len(long) == 160
    # Buffered, every token would land at the end together; streamed, the first lands in the first tenth.
    assert long[0] < 0.1 * long[-1], long[:3] + long[-3:]
    # What nginx adds to each first token (a buffer's wait, Nagle's 40 ms) is in every sample, the best
    # included; the load of the other test process only adds to some (their medians differed by 39 ms
    # when their best ones did by 6).
    added = min(ttft["nginx"]) - min(ttft["direct"])
    assert added < 0.02, ttft  # a few milliseconds on this 2-core machine


def test_plain_http_redirects_to_https_keeping_the_method_and_body(https: Https) -> None:
    """A 308, not a 301: clients follow a 301 of a POST as a GET (requests, httpx, curl -L), which this
    API answers 405, or re-post it without its body."""
    connection = http.client.HTTPConnection("127.0.0.1", https.http_port, timeout=10)
    connection.request("GET", "/v1/models?x=1")
    response = connection.getresponse()
    assert response.status == 308
    assert response.getheader("Location") == f"https://127.0.0.1:{https.https_port}/v1/models?x=1"
    body = {**chat(2), "stream": False}
    followed = requests.post(f"http://127.0.0.1:{https.http_port}/v1/chat/completions", json=body, verify=https.ca_file)
    assert [r.status_code for r in followed.history] == [308]
    assert followed.status_code == 200, followed.text
    assert followed.json()["usage"]["completion_tokens"] == 2


def tls_handshake(https: Https, version: ssl.TLSVersion) -> str:
    """The protocol agreed when the client offers exactly `version`, or the error."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=str(https.ca_file))
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # let this client offer old protocols at all
    context.minimum_version = context.maximum_version = version
    with socket.create_connection(("127.0.0.1", https.https_port), timeout=10) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                return str(tls.version())
        except ssl.SSLError as exc:
            return exc.reason or str(exc)


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
def test_only_tls_1_2_and_1_3_are_accepted(https: Https) -> None:
    assert tls_handshake(https, ssl.TLSVersion.TLSv1_3) == "TLSv1.3"
    assert tls_handshake(https, ssl.TLSVersion.TLSv1_2) == "TLSv1.2"
    # The server answers a TLS 1.1 hello with a protocol_version alert.
    assert tls_handshake(https, ssl.TLSVersion.TLSv1_1) == "TLSV1_ALERT_PROTOCOL_VERSION"
    rendered = (https.directory / "tokenline.conf").read_text()
    assert "ssl_protocols TLSv1.2 TLSv1.3;" in rendered


def test_oversized_body_gets_413_as_json(https: Https) -> None:
    body = b'{"model": "demo", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    response = requests.post(
        f"{https.url}/generate",
        data=body,
        headers={"Content-Type": "application/json"},
        verify=str(https.ca_file),
        timeout=30,
    )
    assert response.status_code == 413
    assert response.headers["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "payload_too_large"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_metrics_are_not_published_through_nginx(stack, https: Https) -> None:  # type: ignore[no-untyped-def]
    assert requests.get(f"{stack.base_url}/metrics", timeout=10).status_code == 200  # the API serves them inside
    response = requests.get(f"{https.url}/metrics", verify=str(https.ca_file), timeout=10)
    assert response.status_code == 404 and response.json()["error"]["message"] == "not found"


def test_request_id_is_forwarded_and_returned(https: Https) -> None:
    url = f"{https.url}/v1/models"
    given = requests.get(url, headers={"X-Request-Id": "trace-42"}, verify=str(https.ca_file), timeout=10)
    assert given.headers["X-Request-Id"] == "trace-42"
    made = requests.get(url, verify=str(https.ca_file), timeout=10)
    assert len(made.headers["X-Request-Id"]) == 32  # nginx's $request_id, passed to the API and back


def test_rate_limit_answers_429_as_json(stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    proc, strict = start(stack, tmp_path, NGINX_RATE="1r/m", NGINX_BURST="2")
    try:
        session = requests.Session()
        responses = [session.get(f"{strict.url}/v1/models", verify=str(strict.ca_file), timeout=10) for _ in range(5)]
        probes = [
            session.get(f"{strict.url}{path}", verify=str(strict.ca_file), timeout=10)
            for path in ("/health", "/health/live", "/health/ready")
        ]
    finally:
        localstack.stop(proc)
    # One request and a burst of two pass; at one a minute, the rest of this second is refused.
    assert [r.status_code for r in responses] == [200, 200, 200, 429, 429]
    refused = responses[-1]
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert [p.status_code for p in probes] == [200, 200, 200]  # probes are not rate-limited


def raw_exchange(https: Https, request: bytes, tls: bool) -> tuple[int, str, bytes]:
    """Send bytes as they are (no client would send them malformed) and read the answer whole:
    its status, Content-Type and body."""
    port = https.https_port if tls else https.http_port
    context = ssl.create_default_context(cafile=str(https.ca_file)) if tls else None
    status, headers, body = raw_http.exchange(port, request, context)
    return status, headers.get("Content-Type", ""), body


CLOSE = b"Host: x\r\nConnection: close\r\n\r\n"
REFUSED_BY_NGINX = {
    "malformed request line": (b"GARBAGE\r\n\r\n", 400, "bad_request"),
    "TRACE": (b"TRACE /v1/models HTTP/1.1\r\n" + CLOSE, 405, "method_not_allowed"),
    "header over 8 KiB": (
        b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"a" * 10_000 + b"\r\n" + CLOSE,
        431,
        "headers_too_large",
    ),
    "request line over 8 KiB": (b"GET /v1/models?" + b"a" * 10_000 + b" HTTP/1.1\r\n" + CLOSE, 414, "uri_too_long"),
    "Content-Length and chunked": (
        b"POST /v1/models HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n" + CLOSE + b"0\r\n\r\n",
        400,
        "bad_request",
    ),
    "HTTP/2.0 on an HTTP/1.1 port": (b"GET /v1/models HTTP/2.0\r\n" + CLOSE, 505, "http_version_not_supported"),
    "a compressed body": (
        b"POST /generate HTTP/1.1\r\nTransfer-Encoding: gzip\r\n" + CLOSE,
        501,
        "not_implemented",
    ),
    # nginx's internal error URIs exist only for its own redirects: a client asking for one is not found.
    "an internal error URI": (b"GET /.tokenline/400 HTTP/1.1\r\n" + CLOSE, 404, None),
    "the internal not-found URI": (b"GET /.tokenline/404 HTTP/1.1\r\n" + CLOSE, 404, None),
}


@pytest.mark.parametrize("tls", [True, False], ids=["https", "http"])
@pytest.mark.parametrize("case", list(REFUSED_BY_NGINX))
def test_requests_nginx_refuses_itself_get_the_apis_error_envelope(https: Https, case: str, tls: bool) -> None:
    request, status, code = REFUSED_BY_NGINX[case]
    got, content_type, body = raw_exchange(https, request, tls)
    assert (got, content_type) == (status, "application/json")
    assert json.loads(body)["error"]["code"] == code


def test_a_request_line_that_nginx_takes_the_api_takes(https: Https) -> None:
    """Between gunicorn's default limit (4,094) and nginx's 8 KiB the API answered with gunicorn's
    HTML 414; the line is the API's now: its answer names the query parameter the route does not take."""
    request = b"GET /v1/models?pad=" + b"a" * 7_000 + b" HTTP/1.1\r\n" + CLOSE
    status, content_type, body = raw_exchange(https, request, tls=True)
    assert (status, content_type) == (400, "application/json")
    assert json.loads(body)["error"]["param"] == "pad"


@pytest.mark.parametrize(
    "headers",
    [
        b"".join(b"X-H%d: v\r\n" % i for i in range(120)),  # gunicorn's default: 100 fields
        b"X-Big: " + b"a" * 8_182 + b"\r\n",  # gunicorn's default: 8,190 bytes a field
    ],
    ids=["many headers", "a long header"],
)
def test_headers_that_nginx_takes_the_api_takes(https: Https, headers: bytes) -> None:
    """nginx passed them and gunicorn answered with its HTML 431."""
    status, content_type, body = raw_exchange(https, b"GET /v1/models HTTP/1.1\r\n" + headers + CLOSE, tls=True)
    assert (status, content_type) == (200, "application/json")
    assert json.loads(body)["object"] == "list"


def test_plain_http_to_the_https_port_gets_the_apis_error_envelope(https: Https) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", https.https_port, timeout=10)
    connection.request("GET", "/v1/models")
    response = connection.getresponse()
    assert (response.status, response.getheader("Content-Type")) == (400, "application/json")
    assert json.loads(response.read())["error"]["code"] == "plain_http_to_https_port"


def test_bodies_over_1_mib_are_redirected_from_http_and_reach_the_api_over_https(https: Https) -> None:
    """nginx's default limit (1 MiB) applied before the redirect; over HTTPS the body reaches the API
    (here it answers that the prompt is too long), held in memory, not in a temp file its workers
    could not write."""
    # 3 MB of JSON (each character escaped in six bytes), under the API's 512 Ki characters of content.
    body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "你" * 500_000}]}).encode()
    request = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: %d\r\n" % len(body) + CLOSE + body
    status, _, _ = raw_exchange(https, request, tls=False)
    assert status == 308
    status, content_type, answer = raw_exchange(https, request, tls=True)
    assert (status, content_type) == (400, "application/json")
    assert json.loads(answer)["error"]["code"] == "context_length_exceeded"  # the API's answer


def test_unreachable_api_gets_503_as_json(tmp_path: Path) -> None:
    https_port, http_port, dead_port = localstack.free_port(), localstack.free_port(), localstack.free_port()
    proc, ca_file = localstack.start_nginx(tmp_path, dead_port, https_port, http_port)
    try:
        response = requests.get(f"https://127.0.0.1:{https_port}/v1/models", verify=str(ca_file), timeout=10)
    finally:
        localstack.stop(proc)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "service_unavailable"


def test_template_renders_every_placeholder() -> None:
    rendered = nginx_conf.render({})
    assert "${" not in rendered
    assert "proxy_buffering off;" in rendered
    assert "gzip off;" in rendered
    assert "client_max_body_size 4m;" in rendered


def established_to(port: int) -> int:
    """TCP connections to 127.0.0.1:`port` in state ESTABLISHED, from /proc/net/tcp."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state = fields[2], fields[3]
        if remote == f"0100007F:{port:04X}" and state == "01":
            count += 1
    return count


def test_nginx_keeps_its_connections_to_the_api_alive(stack, https: Https) -> None:  # type: ignore[no-untyped-def]
    api_port = urlparse(stack.base_url).port
    session = requests.Session()
    for _ in range(5):
        assert session.get(f"{https.url}/v1/models", verify=str(https.ca_file), timeout=10).status_code == 200
    # Without upstream keep-alive nginx would close each connection after its response.
    assert 1 <= established_to(api_port) <= 5


def test_keep_alive_comments_carry_a_waiting_stream_past_nginx_read_timeout(  # type: ignore[no-untyped-def]
    stack, redis_conn, tmp_path: Path
) -> None:
    from rq.suspension import resume, suspend

    proc, front = start(stack, tmp_path, NGINX_READ_TIMEOUT="2s")
    suspend(redis_conn)  # the request waits 4 s in the queue: twice nginx's read timeout
    try:
        body = {**chat(3), "stream": True}
        with requests.post(
            f"{front.url}/v1/chat/completions", json=body, stream=True, verify=str(front.ca_file), timeout=60
        ) as response:
            lines = response.iter_lines()
            started = time.monotonic()
            while time.monotonic() - started < 4:
                next(lines)
            resume(redis_conn)
            rest = [line for line in lines if line.startswith(b"data: ")]
    finally:
        resume(redis_conn)
        localstack.stop(proc)
    assert rest[-1] == b"data: [DONE]" and any(b'"finish_reason":"length"' in line for line in rest)


def test_make_run_https_keeps_its_certificates_in_the_run_directory(demo_model: Path, tmp_path: Path) -> None:
    import signal
    import sys

    from tests.test_supervisor import start

    https_port, http_port = localstack.free_port(), localstack.free_port()
    stack = start(
        [sys.executable, "scripts/run_local.py", "--https"], demo_model, tmp_path,
        HTTPS_PORT=str(https_port), HTTP_PORT=str(http_port),
    )  # fmt: skip
    try:
        ca_file = tmp_path / "https" / "certs" / "ca.crt"  # $TOKENLINE_RUN_DIR/https, not the checkout's .run
        localstack.wait_for(lambda: "nginx serves it" in stack.output.read_text(), 60, "nginx")
        assert str(ca_file) in stack.output.read_text()
        response = requests.get(f"https://127.0.0.1:{https_port}/v1/models", verify=str(ca_file), timeout=10)
        assert response.status_code == 200 and response.json()["data"][0]["id"] == "demo"
        # A stream open when make run stops finishes through nginx, which stops after the API.
        body = {**chat(1000), "stream": True}
        with requests.post(
            f"https://127.0.0.1:{https_port}/v1/chat/completions",
            json=body,
            stream=True,
            verify=str(ca_file),
            timeout=60,
        ) as streamed:
            lines = (line for line in streamed.iter_lines() if line.startswith(b"data: "))
            first_token(lines)  # a worker generates it
            stack.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert rest[-1] == b"data: [DONE]" and b'"finish_reason":"length"' in rest[-2]
    finally:
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(60) == 0
