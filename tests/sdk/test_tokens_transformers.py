"""The balancer's token ids for chat equal transformers' apply_chat_template, as vLLM calls it.

A byte-level BPE is trained here (no downloads), wrapped as a PreTrainedTokenizerFast and saved
with each of the three fixture templates (tokens/templates/). A corpus of conversations, grown
turn by turn so the Rust side's message cache is used, goes to `inferlb-tokens DIR` as JSON lines;
the Python side builds the conversation vLLM's parse_chat_messages builds, renders it with
transformers and encodes it without special tokens, as vLLM does for chat.
"""

import copy
import json
import os
import subprocess

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
jinja2 = pytest.importorskip("jinja2")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("INFERLB_BIN_DIR", os.path.join(ROOT, "target", "release"))
TEMPLATES = os.path.join(ROOT, "tokens", "templates")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# vLLM's content format for each template (its auto-detection: a loop over message content).
FORMATS = {"chatml_tools": "string", "llama3_like": "openai", "qwen3_like": "string"}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A balancer routes requests to replicas that hold their prefix in cache.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "You are a helpful assistant. What is the weather like today?",
    "<tool_call> tool_response think reasoning 0123456789 user assistant system",
    "function parameters object string properties required description type",
    "Überall café 東京 naïve — emoji 🙂 tabs\tand\nnewlines",
] * 3


def make_dir(path, template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=1, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>",
                                              eos_token="<|im_end|>")
    # Non-special added tokens, normalized (as Qwen's <think> are added), next to the specials.
    hf.add_tokens(["<think>", "</think>"])
    hf.chat_template = template
    hf.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


BILLING = "x-anthropic-billing-header"


def without_billing_header(texts):
    """A system message's texts: Claude Code's attribution line taken off, as vLLM does."""
    out = []
    for t in texts:
        if not t.startswith(BILLING):
            out.append(t)
        elif t.partition("\n")[2]:
            out.append(t.partition("\n")[2])
    return out


def developer_as_system(conversation, template):
    """vLLM's renderer for a template that names no developer role: developer messages become
    system ones, and system messages not first (or several) merge into one first."""
    if not any(m["role"] == "developer" for m in conversation):
        return conversation
    if '"developer"' in template or "'developer'" in template:
        return conversation
    conversation = [{**m, "role": "system"} if m["role"] == "developer" else m
                    for m in conversation]
    contents, others, needed = [], [], False
    for i, m in enumerate(conversation):
        if m["role"] != "system":
            others.append(m)
            continue
        needed = needed or i > 0 or bool(contents)
        c = m.get("content", "")
        if isinstance(c, list):
            c = "\n".join(p["text"] if isinstance(p, dict) else p for p in c)
        if c:
            contents.append(c)
    if not needed:
        return conversation
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]


def vllm_conversation(messages, fmt, template=""):
    """The conversation vLLM's parse_chat_messages hands the template (text content only)."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content")
        if content is None:
            texts = []
        elif isinstance(content, str):
            texts = [content]
        else:
            texts = [p if isinstance(p, str) else p.get("text") for p in content]
            texts = [t for t in texts if t is not None]
        if role == "system":
            texts = without_billing_header(texts)
        if fmt == "openai" and role != "tool":
            c = [{"type": "text", "text": t} for t in texts]
        else:
            c = "\n".join(texts)
        msg = {"role": role, "content": c}
        if role == "assistant":
            if m.get("tool_calls"):
                # As the request model validates them: id, function (arguments, name), type.
                calls = []
                for call in copy.deepcopy(m["tool_calls"]):
                    args = call["function"].get("arguments")
                    parsed = json.loads(args) if isinstance(args, str) and args else args
                    calls.append({"id": call["id"],
                                  "function": {"arguments": parsed if isinstance(parsed, dict)
                                               else {}, "name": call["function"]["name"]},
                                  "type": call["type"]})
                msg["tool_calls"] = calls
            r = m.get("reasoning", m.get("reasoning_content"))
            if r is not None:
                msg["reasoning"] = r
                msg["reasoning_content"] = r
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return developer_as_system(out, template)


def vllm_tools(tools):
    """vLLM's ChatCompletionToolsParam.model_dump(): declared fields first, null when absent."""
    if tools is None:
        return None
    out = []
    for t in tools:
        t = dict(t)
        f = dict(t.pop("function"))
        fn = {k: f.pop(k, None) for k in ("name", "description", "parameters")}
        fn.update(f)
        out.append({"type": t.pop("type", "function"), "function": fn, **t})
    return out


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search",
                                           "parameters": {"type": "object", "properties": {}}},
          "strict": True}


def conversations():
    """(messages grown turn by turn, tools, extra body fields) for the corpus."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    call2 = {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": ""}}
    agent = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 21 °C and clear in Paris."},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"},
                                     {"type": "text", "text": "Also search for news."}]},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call, call2]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "rain"}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "no news"},
    ]
    plain = [
        {"role": "user", "content": "  Hello there!  "},
        {"role": "assistant", "content": "Hi. How can I help?"},
        {"role": "user", "content": "Write 東京 and café 🙂 with <|im_end|> inside."},
        {"role": "assistant", "content": "東京, café 🙂"},
        {"role": "user", "content": "Thanks\n\n\tbye"},
    ]
    reasoning = [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need a tool.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12"},
        {"role": "assistant", "content": "<think>\nchecked\n</think>\n\n12"},
        {"role": "user", "content": "ok"},
    ]
    # A coding agent's: Claude Code's attribution line on the system prompt, developer
    # messages (none of the templates names that role).
    codex = [
        {"role": "system", "content": BILLING + ": cc_version=1; cch=4f2a\nYou write code."},
        {"role": "developer", "content": "Follow the repository's style."},
        {"role": "user", "content": "Fix the bug."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                          {"type": "text", "text": "No emoji."}]},
        {"role": "user", "content": "Thanks"},
    ]
    header_only = [
        {"role": "system", "content": BILLING + ": cch=77"},
        {"role": "user", "content": "hi"},
    ]
    out = []
    for convo, tools in ((agent, [WEATHER, SEARCH]), (agent, None), (plain, None),
                         (plain, [WEATHER]), (reasoning, None), (reasoning, [SEARCH]),
                         (codex, [WEATHER]), (header_only, None)):
        for n in range(1, len(convo) + 1):
            for agp in (True, False):
                out.append((convo[:n], tools, {"add_generation_prompt": agp}))
    out.append((reasoning, None, {"add_generation_prompt": True,
                                  "chat_template_kwargs": {"enable_thinking": False}}))
    return out


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_chat_ids_equal_transformers(tmp_path, name):
    with open(os.path.join(TEMPLATES, name + ".jinja")) as f:
        template = f.read()
    hf = make_dir(tmp_path, template)
    cases = conversations()
    lines = []
    want = []
    for messages, tools, extra in cases:
        body = {"messages": messages, **extra}
        if tools is not None:
            body["tools"] = tools
        lines.append(json.dumps(body, ensure_ascii=False))
        try:
            text = hf.apply_chat_template(
                vllm_conversation(messages, FORMATS[name], template), tools=vllm_tools(tools),
                add_generation_prompt=extra["add_generation_prompt"], tokenize=False,
                **extra.get("chat_template_kwargs", {}))
            want.append(hf.encode(text, add_special_tokens=False))
        except jinja2.exceptions.TemplateError as e:  # the template refused (raise_exception)
            want.append(("error", str(e)))
    prompts = ["Hello world", "<|im_start|>user\nhi<|im_end|>", "café 東京 🙂"]
    for p in prompts:
        lines.append(json.dumps({"prompt": p}, ensure_ascii=False))
        want.append(hf.encode(p, add_special_tokens=True))
    proc = subprocess.run([os.path.join(BIN, "inferlb-tokens"), str(tmp_path)],
                          input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(got) == len(want)
    reused = 0
    for line, g, w in zip(lines, got, want):
        if isinstance(w, tuple):
            assert "error" in g, f"{name}: transformers refused ({w[1]}) but Rust did not: {line}"
            continue
        assert "error" not in g, f"{name}: {g['error']}: {line}"
        if g["ids"] != w:
            r, h = hf.decode(g["ids"]), hf.decode(w)
            at = next((i for i, (a, b) in enumerate(zip(r, h)) if a != b), min(len(r), len(h)))
            pytest.fail(f"{name}: ids differ for {line}\nfrom char {at}:\nrust: {r[at - 40:at + 80]!r}\nhf:   {h[at - 40:at + 80]!r}")
        reused += g.get("reused", 0)
    # The grown conversations were tokenized through the message cache.
    assert reused > 0
