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
FORMATS = {"chatml_tools": "string", "llama3_like": "openai", "qwen3_like": "string",
           "kwargs_probe": "string", "named": "string", "named_legacy": "string",
           "named_files_and_list": "string", "named_folder_only": "string"}

# Templates made here from the fixtures. kwargs_probe writes what vLLM passes from the request
# body (reasoning_effort, enable_thinking, documents) at the top of the prompt, where a wrong
# value would move every block. named is a model with a second template named tool_use, which
# transformers picks for a request with tools (even an empty list): saved as transformers 5
# saves it (additional_chat_templates/), and as older ones did (a list in
# tokenizer_config.json) for named_legacy. Where template files exist transformers reads them
# alone: named_files_and_list has chat_template.jinja and the list in the config (its tool_use
# unread), named_folder_only the tool_use file and a config string (no default: a request
# without tools is refused).
PROBE_HEAD = (
    "{%- if reasoning_effort is defined and reasoning_effort %}<|im_start|>system\n"
    "Reasoning: {{ reasoning_effort }}<|im_end|>\n{%- endif %}"
    "{%- if documents %}<|im_start|>system\n{%- for d in documents %}"
    "{{ d.title }}: {{ d.text }}\n{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- if enable_thinking is defined %}<|im_start|>system\n"
    "{%- if enable_thinking %}think{% else %}no_think{% endif %}<|im_end|>\n{%- endif %}")
TOOL_USE_HEAD = ("<|im_start|>system\n# Tool use\n{%- for t in tools %}\n"
                 "{{ t.function.name }}{%- endfor %}<|im_end|>\n")


def templates(name):
    """The model's default template, and its tool_use one or None."""
    base = "chatml_tools" if name == "kwargs_probe" or name.startswith("named") else name
    with open(os.path.join(TEMPLATES, base + ".jinja")) as f:
        template = f.read()
    if name == "kwargs_probe":
        return PROBE_HEAD + template, None
    if name.startswith("named"):
        return template, TOOL_USE_HEAD + template
    return template, None

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A balancer routes requests to replicas that hold their prefix in cache.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "You are a helpful assistant. What is the weather like today?",
    "<tool_call> tool_response think reasoning 0123456789 user assistant system",
    "function parameters object string properties required description type",
    "Überall café 東京 naïve — emoji 🙂 tabs\tand\nnewlines",
] * 3


def make_dir(path, template, tool_use=None, layout="files"):
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
    hf.chat_template = template if tool_use is None else {"default": template, "tool_use": tool_use}
    hf.save_pretrained(path)
    if layout != "files":
        default_file = os.path.join(path, "chat_template.jinja")
        extra = os.path.join(path, "additional_chat_templates")
        if layout in ("legacy", "folder_only"):
            os.remove(default_file)
        if layout in ("legacy", "files_and_list"):
            for f in os.listdir(extra):
                os.remove(os.path.join(extra, f))
            os.rmdir(extra)
        cfg_path = os.path.join(path, "tokenizer_config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        # As transformers 4 saved several templates: a list in tokenizer_config.json.
        cfg["chat_template"] = [{"name": "tool_use", "template": tool_use},
                                {"name": "default", "template": template}]
        if layout == "folder_only":
            cfg["chat_template"] = template
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
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


def merge_kwargs(defaults, overrides):
    """vLLM 0.33's renderers/params.py merge_kwargs: the overrides' values win, but for None and
    "auto"."""
    return {**(defaults or {}),
            **{k: v for k, v in (overrides or {}).items() if v is not None and v != "auto"}}


def vllm_kwargs(extra, tools):
    """The arguments vLLM 0.33 calls apply_chat_template with for a request: build_chat_params
    sets the request's own fields over its chat_template_kwargs (enable_thinking with an effort
    unless the kwargs name it), then with_defaults sets that over the server's own (the tools,
    tokenize)."""
    user = extra.get("chat_template_kwargs")
    effort = extra.get("reasoning_effort")
    own = {"add_generation_prompt": extra.get("add_generation_prompt", True),
           "continue_final_message": extra.get("continue_final_message", False),
           "documents": extra.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in (user or {}):
        own["enable_thinking"] = effort != "none"
    return merge_kwargs({"tools": vllm_tools(tools), "tokenize": False},
                        merge_kwargs(user, own))


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
    # The request's own fields win over its chat_template_kwargs, as vLLM merges them.
    for extra in ({"chat_template_kwargs": {"add_generation_prompt": False}},
                  {"add_generation_prompt": False,
                   "chat_template_kwargs": {"add_generation_prompt": True, "x": 1}},
                  {"reasoning_effort": "high"}, {"reasoning_effort": "none"},
                  {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
                  {"reasoning_effort": "high",
                   "chat_template_kwargs": {"reasoning_effort": "low", "documents": [
                       {"title": "kept", "text": "the request set none"}]}},
                  {"documents": [{"title": "Paris", "text": "21 °C and clear"},
                                 {"title": "東京", "text": "rain"}]},
                  {"documents": [{"title": "request", "text": "wins"}],
                   "chat_template_kwargs": {"documents": [{"title": "kwargs", "text": "lose"}]}},
                  # null and "auto" are dropped: the variable is undefined, and a null
                  # enable_thinking still keeps the effort's away.
                  {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": None}},
                  {"chat_template_kwargs": {"reasoning_effort": "auto", "documents": None}},
                  # The kwargs' tools replace the request's, as they come (and pick tool_use).
                  {"chat_template_kwargs": {"tools": [WEATHER], "tokenize": True}},
                  {"chat_template_kwargs": {"tools": None}},
                  # transformers' own arguments: the call fails.
                  {"chat_template_kwargs": {"messages": []}},
                  {"chat_template_kwargs": {"conversation": []}}):
        out.append((plain, None, extra))
        out.append((agent, [WEATHER], extra))
    # A continued last message (the rendering ends inside it), grown turn by turn; with the
    # generation prompt too, which vLLM refuses.
    for convo, tools in ((plain, None), (agent, [WEATHER]), (reasoning, None)):
        for n in range(1, len(convo) + 1):
            out.append((convo[:n], tools, {"add_generation_prompt": False,
                                           "continue_final_message": True}))
    out.append((plain, None, {"continue_final_message": True}))
    # An empty tools list: a request with tools to transformers (the tool_use template).
    out.append((plain[:3], [], {"add_generation_prompt": True}))
    return out


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_chat_ids_equal_transformers(tmp_path, name):
    template, tool_use = templates(name)
    layout = {"named_legacy": "legacy", "named_files_and_list": "files_and_list",
              "named_folder_only": "folder_only"}.get(name, "files")
    hf = make_dir(tmp_path, template, tool_use, layout)
    cases = conversations()
    lines = []
    want = []
    for messages, tools, extra in cases:
        body = {"messages": messages, **extra}
        if tools is not None:
            body["tools"] = tools
        lines.append(json.dumps(body, ensure_ascii=False))
        kwargs = vllm_kwargs(extra, tools)
        try:
            if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
                raise ValueError("vLLM's request model refuses both")
            # vLLM's renderer for a template without a developer role reads the default one.
            # vLLM asks for ids; tokenize: false or true gives the same.
            kwargs["tokenize"] = False
            text = hf.apply_chat_template(
                vllm_conversation(messages, FORMATS[name], template), **kwargs)
            want.append(hf.encode(text, add_special_tokens=False))
        # The template refused (raise_exception), or transformers did (a continued message
        # without text, no default template, one of its own arguments among the kwargs).
        except (jinja2.exceptions.TemplateError, ValueError, TypeError) as e:
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
