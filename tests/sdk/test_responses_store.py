"""The openai Python SDK's Responses API against inferlb keeping the store itself
(`responses: {store: balancer}`), in front of simulated replicas without a store of their own
(`--no-response-store`, vLLM's default: any `previous_response_id` gets a 404 there).

A tool-calling agent loop chains ten turns by `previous_response_id`; the replicas must see whole
prompts (every earlier item), never an id to look up. The SDK's retries are off (max_retries=0).
Processes start on free loopback ports and are stopped at the end of each test.
"""
import json
import os
import subprocess
import tempfile
import urllib.request

import openai
import pytest

import procs
from procs import free_port, wait_http

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("INFERLB_BIN_DIR", os.path.join(ROOT, "target", "release"))

TOOLS = [{"type": "function", "name": "lookup", "description": "Looks a city's weather up.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                         "required": ["query"]}}]
TURNS = 10


class StoreCluster:
    """Two replicas without a response store, and inferlb keeping the store, routing by
    prefill_cost. Every process's output goes to a log file in `tmp` (shown when a test fails)."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.procs = {}
        self.logs = {}
        self.sims = {}
        try:
            self._start()
        except BaseException:
            self.close()
            self.print_logs()
            raise

    def _spawn(self, name, argv):
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")
        self.logs[name] = log.name
        try:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _start(self):
        for i in range(2):
            port = free_port()
            self.sims[f"gpu{i}"] = port
            self._spawn(f"gpu{i}", [os.path.join(BIN, "inferlb-sim"), "--listen", f"127.0.0.1:{port}",
                                    "--id", f"gpu{i}", "--speed", "20", "--no-response-store"])
        for port in self.sims.values():
            assert wait_http(f"http://127.0.0.1:{port}/health"), "a simulated replica did not come up"
        self.port, self.admin = free_port(), free_port()
        conf = os.path.join(self.tmp, "inferlb.yaml")
        replicas = "".join(f'    - {{id: {k}, address: "127.0.0.1:{p}"}}\n' for k, p in self.sims.items())
        with open(conf, "w") as f:
            f.write(f"pid_file: {self.tmp}/lb.pid\nupgrade_sock: {self.tmp}/lb.sock\ninferlb:\n"
                    f"  listen: 127.0.0.1:{self.port}\n  admin_listen: 127.0.0.1:{self.admin}\n"
                    f"  routing: prefill_cost\n  responses: {{store: balancer}}\n"
                    f"  health: {{interval_seconds: 2}}\n  replicas:\n{replicas}")
        self._spawn("lb", [os.path.join(BIN, "inferlb"), "-c", conf])
        assert wait_http(f"http://127.0.0.1:{self.admin}/metrics"), "inferlb did not come up"
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def received(self):
        """Every `/v1/responses` body the replicas received, as parsed JSON, per replica."""
        got = {}
        for name, port in self.sims.items():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/received?n=64", timeout=5) as r:
                ring = json.load(r)["received"]
            got[name] = [json.loads(x["body"]) for x in ring if x["path"] == "/v1/responses"]
        return got

    def stop(self, name):
        procs.stop(self.procs.pop(name), name == "lb")

    def close(self):
        for name in list(self.procs):
            self.stop(name)

    def print_logs(self, lines=60):
        for name, path in self.logs.items():
            with open(path, "rb") as f:
                tail = f.read().decode("utf-8", "replace").splitlines()[-lines:]
            print(f"--- {name} ({path}), last {len(tail)} lines ---")
            print("\n".join(tail))


@pytest.fixture
def store_cluster():
    with tempfile.TemporaryDirectory() as tmp:
        c = StoreCluster(tmp)
        try:
            yield c
        finally:
            c.close()
            # Shown by pytest only when the test failed (captured output).
            c.print_logs()


def client(c):
    return openai.OpenAI(base_url=c.base_url, api_key="unused", max_retries=0, timeout=30)


def create(sdk, stream, **body):
    """One turn, as a JSON answer or a stream read to `response.completed`; the response."""
    if not stream:
        return sdk.responses.create(model="sim-model", **body)
    events = list(sdk.responses.create(model="sim-model", stream=True, **body))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] == "response.completed", kinds
    assert not {"error", "response.failed", "response.incomplete"} & set(kinds), kinds
    # Every response object the stream shows says what the client sent, not what the replica got.
    for e in events:
        if getattr(e, "response", None) is not None:
            assert e.response.store is True, (e.type, e.response)
            assert e.response.previous_response_id == body.get("previous_response_id"), (e.type, e.response)
    return events[-1].response


def item_key(item):
    """What identifies an item in a prompt, whether it is the SDK's object or a dict as sent."""
    d = item if isinstance(item, dict) else item.model_dump(warnings=False)
    kind = d.get("type", "message")
    if kind == "function_call":
        return (kind, d["call_id"], d["name"], d["arguments"])
    if kind == "function_call_output":
        return (kind, d["call_id"], d["output"])
    content = d["content"]
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    return ("message", d["role"], text)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_ten_turn_tool_calling_chain_streamed_and_not(store_cluster, stream):
    sdk = client(store_cluster)
    ids, sent, call_id = [], [], None
    for turn in range(1, TURNS + 1):
        if turn % 2:
            own = [{"type": "message", "role": "user",
                    "content": f"Turn {turn}: look the weather in city {turn} up with the lookup tool."}]
            choice = "required"
        else:
            own = [{"type": "function_call_output", "call_id": call_id, "output": f"sunny, {turn * 2} degrees"}]
            choice = "auto"
        body = {"input": own, "tools": TOOLS, "tool_choice": choice, "max_output_tokens": 8}
        if ids:
            body["previous_response_id"] = ids[-1]
        response = create(sdk, stream, **body)
        assert response.status == "completed", (turn, response)
        assert response.store is True, (turn, response)
        assert response.previous_response_id == (ids[-1] if ids else None), (turn, response)
        assert len(response.output) == 1, (turn, response.output)
        out = response.output[0]
        if turn % 2:
            assert out.type == "function_call", (turn, out)
            assert out.name == "lookup" and out.call_id, (turn, out)
            assert "query" in json.loads(out.arguments), (turn, out)
            call_id = out.call_id
        else:
            assert out.type == "message", (turn, out)
            assert out.role == "assistant" and response.output_text, (turn, out)
        ids.append(response.id)
        sent.append((own, response.output))
    assert len(set(ids)) == TURNS

    # The replicas were sent whole prompts: each turn reached one replica once, never with an
    # id to look up nor asked to store.
    received = store_cluster.received()
    bodies = [b for per in received.values() for b in per]
    assert len(bodies) == TURNS, {k: len(v) for k, v in received.items()}
    for b in bodies:
        assert "previous_response_id" not in b, b
        assert b.get("store") is False, b
    # The last turn's prompt is every earlier turn's input and output, in order, then its own.
    want = [item_key(i) for own, output in sent[:-1] for i in (*own, *output)] + [item_key(i) for i in sent[-1][0]]
    assert len(want) == 2 * (TURNS - 1) + 1
    last = max(bodies, key=lambda b: len(b["input"]) if isinstance(b["input"], list) else 0)
    assert len(last["input"]) == len(want), last
    assert [item_key(i) for i in last["input"]] == want
    # Each turn's prompt is the one before it, its answer, and its own item.
    lengths = sorted(len(b["input"]) for b in bodies)
    assert lengths == [2 * t + 1 for t in range(TURNS)], lengths

    # The store answers for what it holds.
    got = sdk.responses.retrieve(ids[-1])
    assert got.id == ids[-1]
    assert got.previous_response_id == ids[-2]
    assert got.store is True
    assert [item_key(i) for i in got.output] == [item_key(i) for i in sent[-1][1]]
    items = sdk.responses.input_items.list(ids[-1])
    assert [item_key(i) for i in items.data] == [item_key(i) for i in sent[-1][0]]
    assert items.has_more is False
    asked = sdk.responses.input_items.list(ids[-2], order="asc")
    assert [item_key(i) for i in asked.data] == [item_key(i) for i in sent[-2][0]]

    # Deleted: gone from the store, and a turn on it fails clearly, never starting afresh.
    sdk.responses.delete(ids[-1])
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(ids[-1])
    with pytest.raises(openai.BadRequestError) as caught:
        create(sdk, stream, input="And tomorrow?", tools=TOOLS, tool_choice="auto", previous_response_id=ids[-1])
    assert caught.value.code == "previous_response_not_found", caught.value.body
    assert caught.value.param == "previous_response_id", caught.value.body
    assert sum(len(v) for v in store_cluster.received().values()) == TURNS, "the refused turn reached a replica"
    # The turn before it still continues.
    again = create(sdk, stream, input="And tomorrow?", tools=TOOLS, tool_choice="auto", previous_response_id=ids[-2],
                   max_output_tokens=4)
    assert again.previous_response_id == ids[-2] and again.output[0].type == "message"
    sdk.close()
