"""The agent APIs through their own SDKs: the openai SDK's Responses API and the anthropic SDK's
Messages API, against inferlb in front of two simulated replicas.

As in test_openai_sdk.py: the SDKs' own retries are off (max_retries=0), every process runs on a
free loopback port and is stopped when the test ends, whatever happened, and every wait is
bounded.
"""
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request

import anthropic
import openai
import pytest

from procs import free_port, wait_http

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("INFERLB_BIN_DIR", os.path.join(ROOT, "target", "release"))
MODEL = "sim-model"
KEY = "sk-inferlb-test-key"


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


class Cluster:
    """Two inferlb-sim replicas (gpu0, gpu1) and inferlb in front of them. Built by `start`, so
    that the fixture can stop whatever did start even when starting fails half-way."""

    def __init__(self, tmp, api_keys=()):
        self.tmp = tmp
        self.api_keys = list(api_keys)
        self.procs = {}
        self.sims = {}
        self.logs = []

    def spawn(self, name, argv, env=None):
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start(self):
        for exe in ("inferlb", "inferlb-sim"):
            assert os.access(os.path.join(BIN, exe), os.X_OK), \
                f"{BIN}/{exe} is missing: cargo build --release --workspace --bins"
        for i in range(2):
            name, port = f"gpu{i}", free_port()
            self.sims[name] = port
            self.spawn(name, [os.path.join(BIN, "inferlb-sim"), "--listen", f"127.0.0.1:{port}",
                              "--id", name, "--speed", "20"])
        for port in self.sims.values():
            assert wait_http(f"http://127.0.0.1:{port}/health")
        self.port, self.admin = free_port(), free_port()
        conf = os.path.join(self.tmp, "inferlb.yaml")
        replicas = "".join(f'    - {{id: {k}, address: "127.0.0.1:{p}"}}\n' for k, p in self.sims.items())
        keys = f"  api_keys: [{', '.join(self.api_keys)}]\n" if self.api_keys else ""
        with open(conf, "w") as f:
            f.write(f"pid_file: {self.tmp}/lb.pid\nupgrade_sock: {self.tmp}/lb.sock\ninferlb:\n"
                    f"  listen: 127.0.0.1:{self.port}\n  admin_listen: 127.0.0.1:{self.admin}\n"
                    f"  routing: adaptive\n  health: {{interval_seconds: 2}}\n{keys}  replicas:\n{replicas}")
        # The routes asserted here are adaptive mode's: $ROUTING would override the conf.
        env = {k: v for k, v in os.environ.items() if k != "ROUTING"}
        self.spawn("lb", [os.path.join(BIN, "inferlb"), "-c", conf], env=env)
        assert wait_http(f"http://127.0.0.1:{self.admin}/metrics")
        # The openai SDK's base URL ends in /v1; the anthropic SDK appends /v1/messages itself.
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.root_url}/v1"

    def sim_requests(self, name):
        """Requests the replica ran (every generating endpoint counts; GETs of stored responses
        do not)."""
        return json.loads(get(f"http://127.0.0.1:{self.sims[name]}/sim/stats"))["requests"]

    def lb_requests(self, replica):
        """inferlb_requests_total summed over every route and code of one replica."""
        text = get(f"http://127.0.0.1:{self.admin}/metrics")
        total = 0.0
        for line in text.splitlines():
            if line.startswith("inferlb_requests_total{") and f'replica="{replica}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, name):
        # inferlb: SIGINT (Pingora's quick stop); inferlb-sim: SIGTERM; SIGKILL after 10 s.
        p = self.procs.pop(name)
        try:
            if p.poll() is None:
                p.send_signal(signal.SIGINT if name == "lb" else signal.SIGTERM)
                p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)

    def close(self):
        # inferlb first (no client is left to see replicas vanish); each is stopped even if one fails.
        errors = []
        for name in sorted(self.procs, key=lambda n: n != "lb"):
            try:
                self.stop(name)
            except Exception as e:
                errors.append(e)
        for log in self.logs:
            log.close()
        if errors:
            raise errors[0]


def make_cluster(api_keys=()):
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(tmp, api_keys)
        try:
            c.start()
            yield c
        finally:
            c.close()


@pytest.fixture
def cluster():
    yield from make_cluster()


@pytest.fixture
def keyed_cluster():
    yield from make_cluster(api_keys=[KEY])


def openai_client(c, api_key="unused"):
    return openai.OpenAI(base_url=c.base_url, api_key=api_key, max_retries=0, timeout=30)


def anthropic_client(c, api_key="unused", **kw):
    return anthropic.Anthropic(base_url=c.root_url, api_key=api_key, max_retries=0, timeout=30, **kw)


def served(raw):
    """(replica, route) from inferlb's headers on a raw SDK response."""
    return raw.headers.get("x-inferlb-replica"), raw.headers.get("x-inferlb-route")


# Long enough (several hundred tokens) that a warm turn's cached prefix is unmistakable.
INSTRUCTIONS = " ".join(f"Rule {i}: answer in one short sentence and never repeat the question." for i in range(40))

STREAM_EVENTS_OPENING = ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
STREAM_EVENTS_CLOSING = ["response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]


def test_responses_create_streamed_and_not(cluster):
    sdk = openai_client(cluster)
    raw = sdk.responses.with_raw_response.create(model=MODEL, instructions=INSTRUCTIONS, input="Say hi.",
                                                 max_output_tokens=5)
    r = raw.parse()
    replica, route = served(raw)
    assert replica in cluster.sims and route == "spread"
    assert r.object == "response" and r.status == "completed" and r.output_text
    assert r.usage.output_tokens == 5 and r.usage.input_tokens > 0
    assert r.usage.input_tokens_details.cached_tokens == 0, "a fresh replica has nothing cached"

    stream = sdk.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="Count to three.",
                                  max_output_tokens=6, stream=True)
    stream_replica = stream.response.headers.get("x-inferlb-replica")
    assert stream_replica in cluster.sims
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == STREAM_EVENTS_OPENING, kinds
    assert kinds[-4:] == STREAM_EVENTS_CLOSING, kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"}, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-4].text
    created, completed = events[0].response, events[-1].response
    assert created.status == "in_progress" and completed.status == "completed"
    assert completed.id == created.id and completed.output_text == deltas
    assert completed.usage.output_tokens == 6 and completed.usage.input_tokens > 0
    assert completed.usage.input_tokens_details.cached_tokens >= 0

    # inferlb learnt the streamed response's id from its response.created event: a continuation,
    # a GET and a DELETE of it all go to the replica that stores it.
    raw = sdk.responses.with_raw_response.create(model=MODEL, input="And then?", previous_response_id=completed.id,
                                                 max_output_tokens=3)
    assert served(raw) == (stream_replica, "stored")
    nxt = raw.parse()
    assert nxt.previous_response_id == completed.id and nxt.instructions == INSTRUCTIONS
    assert nxt.usage.input_tokens_details.cached_tokens > 0
    got = sdk.responses.with_raw_response.retrieve(completed.id)
    assert served(got) == (stream_replica, "stored")
    assert got.parse().id == completed.id and got.parse().output_text == deltas
    sdk.responses.delete(completed.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(completed.id)


def test_a_ten_turn_chain_stays_on_the_replica_that_stores_it(cluster):
    """Two chains of ten turns, interleaved, each by previous_response_id alone."""
    sdk = openai_client(cluster)
    before = {name: cluster.sim_requests(name) for name in cluster.sims}
    chains = {}  # chain -> (its replica, its last response id)
    for turn in range(10):
        for chain in ("a", "b"):
            home, previous = chains.get(chain, (None, None))
            extra = {"previous_response_id": previous} if previous else {"instructions": f"Chain {chain}. {INSTRUCTIONS}"}
            raw = sdk.responses.with_raw_response.create(model=MODEL, input=f"Chain {chain}, turn {turn}: go on.",
                                                         max_output_tokens=4, **extra)
            r = raw.parse()
            replica, route = served(raw)
            assert r.status == "completed" and r.output_text
            if turn == 0:
                assert replica in cluster.sims and route == "spread"
                home = replica
            else:
                assert (replica, route) == (home, "stored"), f"chain {chain} turn {turn}"
                assert r.previous_response_id == previous
                assert r.usage.input_tokens_details.cached_tokens > 0, f"chain {chain} turn {turn} was cold"
                # The whole history is the prompt; all of it but this turn's input was generated
                # or sent before, on this replica.
                assert r.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens // 2
            chains[chain] = (home, r.id)
    # Fresh work goes to the least busy replica, ties taken in turn: one chain on each.
    assert sorted(home for home, _ in chains.values()) == sorted(cluster.sims), chains
    # Each replica ran exactly the turns of the chain it stores: none strayed, none retried.
    for name in cluster.sims:
        assert cluster.sim_requests(name) - before[name] == 10, name
    metrics = get(f"http://127.0.0.1:{cluster.admin}/metrics")
    assert "inferlb_failovers_total{" not in metrics
    assert not re.search(r'inferlb_requests_total\{[^}]*code="[45]xx"', metrics)


def test_a_chain_whose_replica_is_down_gets_a_clear_503(cluster):
    sdk = openai_client(cluster)
    previous = None
    home = None
    for turn in range(3):
        extra = {"previous_response_id": previous} if previous else {"instructions": INSTRUCTIONS}
        raw = sdk.responses.with_raw_response.create(model=MODEL, input=f"Turn {turn}.", max_output_tokens=3, **extra)
        home = home or served(raw)[0]
        assert served(raw)[0] == home
        previous = raw.parse().id
    (other,) = [name for name in cluster.sims if name != home]
    other_sim, other_lb = cluster.sim_requests(other), cluster.lb_requests(other)

    cluster.stop(home)
    # The health check may not have noticed yet: then the first attempt fails to connect, is not
    # sent elsewhere (no other replica has the response), and is a 502 that says it is an error.
    # That failure demotes the replica, so the next attempt at the latest is the clear 503.
    seen = []
    for attempt in range(4):
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.responses.create(model=MODEL, input="Are you there?", previous_response_id=previous,
                                 max_output_tokens=3)
        e, took = caught.value, time.monotonic() - t0
        seen.append((type(e).__name__, e.status_code, round(took, 3)))
        if e.status_code == 503:
            break
        assert attempt == 0 and e.status_code == 502, seen
        assert isinstance(e, openai.InternalServerError)
        assert isinstance(e.body, dict) and e.body.get("type") == "server_error" and e.body.get("message"), e.body
        time.sleep(0.2)
    print("503 attempts:", seen)
    assert e.status_code == 503, seen
    assert type(e) is openai.InternalServerError, seen
    assert took < 1.0, "a request about an unavailable stored response is answered at once"
    assert previous in e.message and "unavailable" in e.message, e.message
    assert e.body == {"message": e.body["message"], "type": "service_unavailable", "param": None, "code": 503}
    assert previous in e.body["message"] and home in e.body["message"]

    # A stream and a GET of that response are refused the same way, before anything streams.
    with pytest.raises(openai.InternalServerError) as caught:
        sdk.responses.create(model=MODEL, input="Still?", previous_response_id=previous, stream=True)
    assert caught.value.status_code == 503 and previous in caught.value.message
    with pytest.raises(openai.InternalServerError) as caught:
        sdk.responses.retrieve(previous)
    assert caught.value.status_code == 503 and previous in caught.value.message

    # Nothing about the stored response reached the replica that does not have it.
    assert cluster.sim_requests(other) == other_sim
    assert cluster.lb_requests(other) == other_lb
    # ... which serves everything else as before.
    raw = sdk.responses.with_raw_response.create(model=MODEL, instructions=INSTRUCTIONS, input="A fresh start.",
                                                 max_output_tokens=3)
    assert served(raw) == (other, "spread") and raw.parse().status == "completed"


SYSTEM = "You are terse."
HELLO = [{"role": "user", "content": "Say hi."}]


def test_anthropic_messages_streamed_and_not(cluster):
    sdk = anthropic_client(cluster)
    raw = sdk.messages.with_raw_response.create(model=MODEL, max_tokens=5, system=SYSTEM, messages=HELLO)
    msg = raw.parse()
    replica, route = served(raw)
    assert replica in cluster.sims and route == "spread"
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason == "end_turn"
    assert msg.usage.output_tokens == 5 and msg.usage.input_tokens > 0
    assert msg.usage.cache_read_input_tokens == 0

    with sdk.messages.stream(model=MODEL, max_tokens=6, system=SYSTEM,
                             messages=[{"role": "user", "content": "Count to three."}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        assert stream.response.headers.get("x-inferlb-replica") in cluster.sims
    assert text and final.content[0].text == text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 6 and final.usage.input_tokens > 0
    assert final.usage.cache_read_input_tokens == 0

    # The raw events, in Anthropic's order (the SDK drops `ping` events itself).
    kinds = [e.type for e in sdk.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=HELLO, stream=True)]
    assert kinds == ["message_start", "content_block_start"] + ["content_block_delta"] * 4 + \
        ["content_block_stop", "message_delta", "message_stop"], kinds


# About 2,400 words (some 16,000 bytes, about 4,000 prompt tokens): a cache hit cannot be missed.
LONG_SYSTEM = " ".join(
    f"Guideline {i}: when a question needs live data, call the weather tool once per city, "
    f"wait for its result, and quote the temperature exactly as the tool reported it."
    for i in range(100))
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The current weather in one city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_anthropic_tool_use_loop_stays_pinned_and_warm(cluster):
    assert len(LONG_SYSTEM.split()) >= 2000
    sdk = anthropic_client(cluster)
    messages = [{"role": "user", "content": "What is the weather in Paris, Oslo and Lima?"}]
    cities = ["Paris", "Oslo", "Lima"]
    home = None
    for turn, city in enumerate(cities):
        raw = sdk.messages.with_raw_response.create(model=MODEL, max_tokens=6, system=LONG_SYSTEM,
                                                    tools=[WEATHER_TOOL], messages=messages)
        msg = raw.parse()
        replica, route = served(raw)
        usage = msg.usage
        if turn == 0:
            assert replica in cluster.sims and route == "spread"
            assert usage.cache_read_input_tokens == 0
            home = replica
        else:
            assert (replica, route) == (home, "pinned"), f"turn {turn}"
            # Everything before this turn's tool result was prompt or output on this replica.
            assert usage.cache_read_input_tokens > 0, f"turn {turn} was cold"
            assert usage.cache_read_input_tokens > 3000, usage
            assert usage.input_tokens < usage.cache_read_input_tokens, usage
        # The simulated model writes text only; the tool call an agent would get back is written
        # here, after the text it did say, and answered by the tool's result.
        tool_id = f"toolu_{turn:02d}"
        messages += [
            {"role": "assistant", "content": [
                {"type": "text", "text": msg.content[0].text},
                {"type": "tool_use", "id": tool_id, "name": WEATHER_TOOL["name"], "input": {"city": city}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": tool_id, "content": f"{city}: 18 C, clear sky"}]},
        ]


def sent_key(headers):
    """How a request carried its key: ("x-api-key", key), ("bearer", key), or None."""
    if "x-api-key" in headers:
        return "x-api-key", headers["x-api-key"]
    auth = headers.get("authorization", "")
    return ("bearer", auth[len("Bearer "):]) if auth.startswith("Bearer ") else None


def test_anthropic_api_keys_accepted_as_x_api_key_and_bearer(keyed_cluster):
    c = keyed_cluster
    sent = []
    http = anthropic.DefaultHttpxClient(event_hooks={"request": [lambda req: sent.append(sent_key(req.headers))]})
    # The SDK's api_key as the SDK sends it: anthropic 0.x sent x-api-key; the 2.x installed here
    # sends Authorization: Bearer. Either way inferlb must take it.
    by_sdk = anthropic_client(c, api_key=KEY, http_client=http)
    msg = by_sdk.messages.create(model=MODEL, max_tokens=3, system=SYSTEM, messages=HELLO)
    assert msg.content[0].text and msg.usage.output_tokens == 3
    assert sent[-1] in (("x-api-key", KEY), ("bearer", KEY)), sent
    # x-api-key alone, as Anthropic's API documents it and curl-based agents send it.
    as_x_api_key = anthropic_client(c, api_key=KEY, http_client=http,
                                    default_headers={"x-api-key": KEY, "Authorization": anthropic.Omit()})
    msg = as_x_api_key.messages.create(model=MODEL, max_tokens=3, system=SYSTEM, messages=HELLO)
    assert msg.content[0].text
    assert sent[-1] == ("x-api-key", KEY), sent
    with as_x_api_key.messages.stream(model=MODEL, max_tokens=3, system=SYSTEM, messages=HELLO) as stream:
        assert "".join(stream.text_stream)
    assert sent[-1] == ("x-api-key", KEY), sent
    # The same key through the openai SDK (Authorization: Bearer) on the Responses API.
    assert openai_client(c, api_key=KEY).responses.create(model=MODEL, input="hi", max_output_tokens=2).output_text

    ran = sum(c.sim_requests(name) for name in c.sims)
    wrong = "sk-not-the-right-key"
    for bad in (anthropic_client(c, api_key=wrong, http_client=http),
                anthropic_client(c, api_key=wrong, http_client=http,
                                 default_headers={"x-api-key": wrong, "Authorization": anthropic.Omit()})):
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model=MODEL, max_tokens=3, system=SYSTEM, messages=HELLO)
        assert sent[-1][1] == wrong
        e = caught.value
        assert e.status_code == 401
        assert isinstance(e.body, dict) and e.body["type"] == "error", e.body
        assert e.body["error"]["type"] == "authentication_error" and e.body["error"]["message"], e.body
        with pytest.raises(anthropic.AuthenticationError):
            with bad.messages.stream(model=MODEL, max_tokens=3, system=SYSTEM, messages=HELLO) as stream:
                "".join(stream.text_stream)
    http.close()
    with pytest.raises(openai.AuthenticationError) as caught:
        openai_client(c, api_key=wrong).responses.create(model=MODEL, input="hi")
    assert caught.value.status_code == 401 and caught.value.body["type"] == "invalid_request_error"
    assert sum(c.sim_requests(name) for name in c.sims) == ran, "a refused request reached a replica"


def test_anthropic_sdk_sees_no_live_replica_in_anthropic_shape(cluster):
    sdk = anthropic_client(cluster)
    assert sdk.messages.create(model=MODEL, max_tokens=2, messages=HELLO).content[0].text
    for name in list(cluster.sims):
        cluster.stop(name)
    # As above: until both are demoted, an attempt may still fail to connect (502).
    seen = []
    for attempt in range(4):
        with pytest.raises(anthropic.APIStatusError) as caught:
            sdk.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
        e = caught.value
        seen.append((type(e).__name__, e.status_code))
        assert isinstance(e.body, dict) and e.body["type"] == "error" and e.body["error"]["message"], e.body
        if e.status_code == 503:
            break
        assert e.status_code == 502 and e.body["error"]["type"] == "api_error", seen
        time.sleep(0.2)
    print("anthropic attempts:", seen)
    assert e.status_code == 503, seen
    # anthropic 2.x names a 503 ServiceUnavailableError, a kind of InternalServerError.
    assert isinstance(e, getattr(anthropic, "ServiceUnavailableError", anthropic.InternalServerError)), seen
    assert e.body["error"]["type"] == "overloaded_error"
