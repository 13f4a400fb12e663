"""The openai Python SDK against inferlb in front of simulated replicas.

The SDK's own retries are switched off (max_retries=0): whatever it survives, inferlb made
survivable. Processes start on free loopback ports and are stopped at the end of each test.
Over HTTPS, the certificates are made at test time with trustme: a test CA and a certificate
from it for localhost.
"""
import asyncio
import os
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request

import openai
import pytest
import trustme

import procs
from procs import free_port, wait_http

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("INFERLB_BIN_DIR", os.path.join(ROOT, "target", "release"))


def wait_listening(port, limit=10.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


class Cluster:
    """Two simulated replicas and inferlb; with `tls` (certificate file, key file), inferlb's
    listener serves HTTPS with that certificate."""

    def __init__(self, tmp, tls=None):
        self.procs = {}
        self.sims = {}
        for i in range(2):
            port = free_port()
            self.sims[f"gpu{i}"] = port
            self.procs[f"gpu{i}"] = subprocess.Popen(
                [os.path.join(BIN, "inferlb-sim"), "--listen", f"127.0.0.1:{port}", "--id", f"gpu{i}", "--speed", "20"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for port in self.sims.values():
            assert wait_http(f"http://127.0.0.1:{port}/health")
        self.port, self.admin = free_port(), free_port()
        conf = os.path.join(tmp, "inferlb.yaml")
        replicas = "".join(f'    - {{id: {k}, address: "127.0.0.1:{p}"}}\n' for k, p in self.sims.items())
        tls_line = f'  tls: {{cert_file: "{tls[0]}", key_file: "{tls[1]}"}}\n' if tls else ""
        with open(conf, "w") as f:
            f.write(f"pid_file: {tmp}/lb.pid\nupgrade_sock: {tmp}/lb.sock\ninferlb:\n"
                    f"  listen: 127.0.0.1:{self.port}\n  admin_listen: 127.0.0.1:{self.admin}\n"
                    f"{tls_line}  health: {{interval_seconds: 2}}\n  replicas:\n{replicas}")
        self.procs["lb"] = subprocess.Popen([os.path.join(BIN, "inferlb"), "-c", conf],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_http(f"http://127.0.0.1:{self.admin}/metrics")
        if tls:
            # The admin port answers once the listeners are bound; wait for the proxy port too.
            assert wait_listening(self.port), "inferlb's TLS listener did not come up"
        self.base_url = f"{'https://localhost' if tls else 'http://127.0.0.1'}:{self.port}/v1"

    def stop(self, name):
        procs.stop(self.procs.pop(name), name == "lb")

    def close(self):
        for name in list(self.procs):
            self.stop(name)


@pytest.fixture
def cluster():
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(tmp)
        try:
            yield c
        finally:
            c.close()


def client(c):
    return openai.OpenAI(base_url=c.base_url, api_key="unused", max_retries=0, timeout=30)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def test_chat_and_completions_streamed_and_not(cluster):
    sdk = client(cluster)
    chat = sdk.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=5)
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens == 5
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(sdk.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=4,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage.completion_tokens == 4

    done = sdk.completions.create(model="sim-model", prompt="Once upon a time", max_tokens=3)
    assert done.choices[0].text and done.usage.completion_tokens == 3
    streamed = list(sdk.completions.create(model="sim-model", prompt="Once", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices)

    raw = sdk.chat.completions.with_raw_response.create(model="sim-model", messages=MESSAGES, max_tokens=1)
    assert raw.headers["x-inferlb-replica"] in ("gpu0", "gpu1")
    # A fresh prompt spreads; this one was sent before, so prefill_cost (the default) may send it
    # to the replica holding its prefix.
    assert raw.headers["x-inferlb-route"] in ("spread", "prefix")
    assert [m.id for m in sdk.models.list()] == ["sim-model"]


def test_async_client(cluster):
    async def run():
        sdk = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=30)
        many = await asyncio.gather(*[
            sdk.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2)
            for i in range(8)])
        assert all(r.choices[0].message.content for r in many)
        stream = await sdk.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=3, stream=True,
                                                   stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage.completion_tokens == 3
        await sdk.close()
    asyncio.run(run())


def test_a_replica_stopped_mid_run_is_invisible_to_the_sdk(cluster):
    sdk = client(cluster)
    conversation = list(MESSAGES)
    for i in range(16):
        if i == 5:
            cluster.stop("gpu0")
        if i % 2:
            reply = sdk.chat.completions.create(model="sim-model", messages=conversation, max_tokens=3)
            conversation += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": f"turn {i}"}]
        else:
            chunks = list(sdk.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": f"s{i}"}],
                                                      max_tokens=3, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.admin}/metrics") as r:
        metrics = r.read().decode()
    assert 'inferlb_failovers_total{reason="connect_refused",replica="gpu0"} 1' in metrics


# Over HTTPS.

@pytest.fixture
def test_ca():
    return trustme.CA(organization_name="inferlb SDK tests")


@pytest.fixture
def tls_cluster(test_ca):
    """inferlb serving HTTPS with a certificate for localhost from `test_ca`, and the CA's PEM
    file the clients trust."""
    with tempfile.TemporaryDirectory() as tmp:
        server = test_ca.issue_cert("localhost")
        cert, key, ca_file = (os.path.join(tmp, n) for n in ("server.crt", "server.key", "ca.pem"))
        with open(cert, "wb") as f:
            f.write(b"".join(blob.bytes() for blob in server.cert_chain_pems))
        server.private_key_pem.write_to_path(key)
        test_ca.cert_pem.write_to_path(ca_file)
        c = Cluster(tmp, tls=(cert, key))
        c.ca_file = ca_file
        try:
            yield c
        finally:
            c.close()


def https_client(c, verify):
    """The SDK with its own httpx client (the SDK's defaults) verifying against `verify`."""
    return openai.OpenAI(base_url=c.base_url, api_key="unused", max_retries=0, timeout=30,
                         http_client=openai.DefaultHttpxClient(verify=verify))


def trusting(ca_file):
    return ssl.create_default_context(cafile=ca_file)


def test_the_sdk_over_https_trusting_the_test_ca_streamed_and_not(tls_cluster):
    assert tls_cluster.base_url.startswith("https://localhost:")
    sdk = https_client(tls_cluster, trusting(tls_cluster.ca_file))
    chat = sdk.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=5)
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens == 5

    chunks = list(sdk.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=4,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 4

    streamed = list(sdk.completions.create(model="sim-model", prompt="Once", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices)

    raw = sdk.chat.completions.with_raw_response.create(model="sim-model", messages=MESSAGES, max_tokens=1)
    assert raw.http_request.url.scheme == "https"
    assert raw.headers["x-inferlb-replica"] in ("gpu0", "gpu1")
    assert [m.id for m in sdk.models.list()] == ["sim-model"]
    sdk.close()


def test_the_async_sdk_over_https_streamed_and_not(tls_cluster):
    async def run():
        sdk = openai.AsyncOpenAI(base_url=tls_cluster.base_url, api_key="unused", max_retries=0, timeout=30,
                                 http_client=openai.DefaultAsyncHttpxClient(verify=trusting(tls_cluster.ca_file)))
        many = await asyncio.gather(*[
            sdk.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2)
            for i in range(8)])
        assert all(r.choices[0].message.content for r in many)
        stream = await sdk.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=3, stream=True,
                                                   stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage.completion_tokens == 3
        await sdk.close()
    asyncio.run(run())


def certificate_error_in(exc):
    """The ssl.SSLCertVerificationError in an exception's cause chain, if any."""
    while exc is not None:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.mark.parametrize("trust", ["another CA", "the system roots"])
def test_a_client_that_does_not_trust_the_ca_gets_a_connection_error(tls_cluster, trust):
    if trust == "another CA":
        other = os.path.join(os.path.dirname(tls_cluster.ca_file), "other-ca.pem")
        trustme.CA(organization_name="not inferlb's").cert_pem.write_to_path(other)
        verify = trusting(other)
    else:
        verify = ssl.create_default_context()
    sdk = https_client(tls_cluster, verify)
    for stream in (False, True):
        with pytest.raises(openai.APIConnectionError) as caught:
            sdk.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=2, stream=stream)
        # Not a timeout nor an HTTP error: the handshake failed on the certificate, and the
        # cause says so.
        assert not isinstance(caught.value, openai.APITimeoutError)
        cause = certificate_error_in(caught.value)
        assert cause is not None, repr(caught.value.__cause__)
        assert "certificate verify failed" in str(cause)
    sdk.close()
    # The listener keeps serving the clients that do trust the CA.
    good = https_client(tls_cluster, trusting(tls_cluster.ca_file))
    assert good.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=2).choices[0].message.content
    good.close()
